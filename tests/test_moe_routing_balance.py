"""Expert-choice routing and bias balancing (DeepSeek-V3) of the `MoE` layer.

Expert choice equals a dense reference (every expert on every token, masked to the tokens
each expert took), forward and gradients, on one device and expert-parallel. The balancing
bias picks experts but never weights them; its cotangent is the step's centred expert load on
any layout; the sign rule moves it by exactly `rate`; and it evens out a skewed router's load.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspeed.errors import ConfigError
from jaxspeed.moe.balance import BIAS_PARAM, centered_load, with_bias_update
from jaxspeed.moe.expert_choice import expert_choice_gating
from jaxspeed.moe.gating import top_k_gating
from jaxspeed.moe.layer import AUX_LOSS, METRICS, MoE
from jaxspeed.runtime.mesh import make_mesh
from jaxspeed.sharding.planner import plan_sharding
from numerics import assert_close, mixed_rtol, program_rtol

E, M, H = 8, 12, 16
X = np.random.default_rng(1).normal(size=(8, 8, M)).astype(np.float32)  # 64 tokens
COT = np.random.default_rng(2).normal(size=X.shape).astype(np.float32)
#: The dense reference and the layer add the same products in another order. Widest sums:
#: the 64 tokens of a weight gradient; a chain of 6 reductions forward (gate matmul, softmax,
#: the FFN's two matmuls, the combine over experts, the loss), 3x with the backward.
RTOL = program_rtol(width=64, depth=3 * 6)


def _abstract(module):
    return jax.eval_shape(lambda x: module.init(
        {"params": jax.random.key(0), "gating": jax.random.key(1)}, x), jnp.zeros(X.shape))


def _params(module, scale=0.5):
    shapes = nn.unbox(_abstract(module)["params"])
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: (rng.normal(size=s.shape) * scale).astype(np.float32), shapes)


def _loss(module, params, x):
    y, state = module.apply({"params": params}, x, rngs={"gating": jax.random.key(3)},
                            mutable=[AUX_LOSS, METRICS])
    return jnp.sum(y * COT) + sum(jax.tree.leaves(state[AUX_LOSS])), (y, state[METRICS])


def _grads(module, params, x):
    fn = jax.jit(jax.value_and_grad(functools.partial(_loss, module), argnums=(0, 1),
                                    has_aux=True))
    return fn(params, x)


@functools.cache
def _one_device(options: tuple, num_groups: int):
    """`(((loss, (y, metrics)), (d params, d x)), params)` of the single-device layer with
    `dict(options)` and `num_groups`, at `_params`' params (numpy): computed once a file (or a
    worker) for every test that compares against it."""
    module = MoE(num_groups=num_groups, **dict(options))
    params = _params(module)
    return _grads(module, jax.tree.map(jnp.asarray, params), jnp.asarray(X)), params


def _on_mesh_and_one_device(options, axes, *, num_groups=None, **extra):
    """`(on the mesh, on one device with num_groups (default 8), the mesh's compiled HLO)`,
    each `((loss, (y, metrics)), (d params, d x))`, the same params on both."""
    ref, params = _one_device(tuple(sorted(options.items())), num_groups or 8)
    mesh = make_mesh(axes)
    module = MoE(**options, num_groups=num_groups, **extra)
    specs = nn.get_partition_spec(_abstract(module))["params"]
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, plan_sharding(params, specs, mesh, stage=0).params)
        x = jax.device_put(X, NamedSharding(mesh, P(("data", "expert"))))
        fn = jax.jit(jax.value_and_grad(functools.partial(_loss, module), argnums=(0, 1),
                                        has_aux=True))
        compiled = fn.lower(placed, x).compile()  # once, for the values and the HLO
        return compiled(placed, x), ref, compiled.as_text()


# -- expert choice -----------------------------------------------------------------------------

EC = dict(num_experts=E, d_ff=H, k=2, capacity_factor=1.0, min_capacity=1,
          routing="expert_choice", aux_loss_coef=0.1)


def _dense_expert_choice(params, x, *, groups):
    """Every expert on every token; expert e keeps the C tokens of each group with its highest
    router probability, weighted by that probability."""
    tokens = x.reshape(groups, -1, M)
    capacity = int(np.ceil(2 * tokens.shape[1] / E))
    logits = jnp.einsum("gtm,me->gte", tokens, params["gate_kernel"],
                        precision=jax.lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)
    picked = jax.lax.top_k(jnp.swapaxes(probs, 1, 2), capacity)[1]  # [G, E, C]
    mask = jnp.zeros(probs.shape).at[
        jnp.arange(groups)[:, None, None], picked, jnp.arange(E)[None, :, None]].set(1.0)
    hidden = jax.nn.gelu(jnp.einsum("gtm,emh->gteh", tokens, params["expert_w_in"]),
                         approximate=False)
    out = jnp.einsum("gteh,ehm->gtem", hidden, params["expert_w_out"])
    y = jnp.einsum("gte,gtem->gtm", jax.lax.stop_gradient(mask) * probs, out)
    return y.reshape(x.shape)


def test_expert_choice_gating_fills_every_expert_and_keeps_the_probabilities():
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(32, E)), jnp.float32)
    r = expert_choice_gating(logits, 2, 1.0, min_capacity=1)
    probs = jax.nn.softmax(logits, -1)
    assert r.capacity == 8 and r.expert_index.shape == (32, E)
    kept = np.asarray(r.position < r.capacity)
    assert (kept.sum(0) == 8).all()  # every expert takes exactly C tokens
    assert sorted(np.asarray(r.position)[kept[:, 3], 3]) == list(range(8))  # slots 0..C-1
    for e in range(E):  # ... its C best
        best = np.argsort(-np.asarray(probs[:, e]), kind="stable")[:8]
        assert set(np.flatnonzero(kept[:, e])) == set(best)
    np.testing.assert_array_equal(np.asarray(r.weight), np.where(kept, probs, 0))
    assert float(r.dropped_fraction) == pytest.approx(np.mean(~kept.any(1)))
    assert float(r.aux_loss) == 0


def test_expert_choice_equals_the_dense_reference_forward_and_gradients():
    ((loss, (y, metrics)), grads), params = _one_device(tuple(sorted(EC.items())), 8)
    params = jax.tree.map(jnp.asarray, params)

    @jax.jit
    def dense(p, x):  # the output and the gradients of `sum(y * COT)`
        ref_y, vjp = jax.vjp(lambda p, x: _dense_expert_choice(p, x, groups=8), p, x)
        return ref_y, vjp(jnp.asarray(COT))

    ref_y, ref_grads = dense(params, jnp.asarray(X))
    assert_close(y, ref_y, rtol=RTOL)
    assert_close(grads, ref_grads, rtol=RTOL)  # the router's gradient comes through the weights
    assert float(jnp.abs(grads[0]["gate_kernel"]).max()) > 0
    chex.assert_trees_all_equal(metrics["expert_counts"][0], jnp.full((E,), 8 * 2, jnp.int32))


# 2 experts a device and their gradients summed over `data`: the exchange of {"expert": 8}
# (one expert a device) and more.
@pytest.mark.parametrize("axes", [{"data": 2, "expert": 4}])
def test_expert_choice_expert_parallel_equals_one_device(axes):
    ((_, (y, _)), grads), ((_, (ref_y, _)), ref_grads), _ = _on_mesh_and_one_device(EC, axes)
    assert_close((y, grads), (ref_y, ref_grads), rtol=RTOL)


@pytest.mark.parametrize("clash", [dict(drop_tokens=False), dict(dynamic_capacity=True),
                                   dict(balance="bias")])
def test_expert_choice_refuses_what_it_cannot_do(clash):
    with pytest.raises(ConfigError, match="expert_choice"):
        MoE(**{**EC, **clash}).init({"params": jax.random.key(0)}, jnp.zeros((8, M)),
                                    deterministic=True)


def test_expert_choice_is_refused_in_decode_and_in_training_samples():
    from jaxspeed.config import load_config
    from jaxspeed.models import build_gpt
    from jaxspeed.models.sampling import generate

    sets = ["model.moe.routing=expert_choice", "model.n_layers=2", "model.moe.every_n_layers=1",
            "model.d_model=32", "model.n_heads=2", "model.moe.d_ff=32"]
    config = load_config("configs/gpt_moe.yaml", overrides=sets)
    with pytest.raises(ConfigError, match="^this model cannot decode: model.moe.routing="):
        generate(build_gpt(config.model), {}, jnp.zeros((1, 4), jnp.int32), max_new_tokens=2,
                 temperature=0)
    with pytest.raises(ConfigError, match="logging.sample_every_n_steps needs decoding"):
        load_config("configs/gpt_moe.yaml", overrides=[*sets, "logging.sample_every_n_steps=5"])


# -- bias balancing ----------------------------------------------------------------------------

BIAS = dict(num_experts=E, d_ff=H, k=2, capacity_factor=2.0, min_capacity=1, use_rts=False,
            balance="bias", aux_loss_coef=0.1)


def test_the_bias_picks_the_experts_but_never_weights_them():
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(16, E)), jnp.float32)
    bias = jnp.zeros(E).at[5].set(100.0)
    r = top_k_gating(logits, 2, 8.0, selection_bias=bias, normalize_gate=False)
    assert (np.asarray(r.expert_index)[:, 0] == 5).all()  # every token's first choice
    probs = np.asarray(jax.nn.softmax(logits, -1))
    np.testing.assert_allclose(np.asarray(r.weight)[:, 0], probs[:, 5], rtol=1e-6)
    plain = top_k_gating(logits, 2, 8.0)
    chex.assert_trees_all_equal(top_k_gating(logits, 2, 8.0, selection_bias=jnp.zeros(E)), plain)


def test_balance_bias_adds_no_aux_loss_and_reports_the_load_as_the_bias_cotangent():
    ((loss, (y, metrics)), (grads, _)), params = _one_device(tuple(sorted(BIAS.items())), 8)
    assert params[BIAS_PARAM].shape == (E,)
    np.testing.assert_allclose(loss, jnp.sum(y * COT), rtol=1e-6)  # no aux loss
    want = centered_load(metrics["expert_counts"][0])
    np.testing.assert_allclose(grads[BIAS_PARAM], want, rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(want).max()) > 0 and abs(float(want.sum())) < 1e-6


@pytest.mark.parametrize("axes", [{"data": 8}, {"data": 2, "expert": 4}])
def test_the_load_cotangent_is_the_same_on_every_layout(axes):
    ((_, (y, _)), grads), ((_, (ref_y, _)), ref_grads), _ = _on_mesh_and_one_device(BIAS, axes)
    assert_close((y, grads), (ref_y, ref_grads), rtol=RTOL)


def test_the_sign_rule_moves_only_the_bias_by_exactly_the_rate():
    params = {"w": jnp.ones(3), "moe": {BIAS_PARAM: jnp.zeros(4)}}
    grads = {"w": jnp.full(3, 100.0), "moe": {BIAS_PARAM: jnp.array([0.2, -0.1, 0.0, -0.1])}}
    tx = with_bias_update(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), 0.01)
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["moe"][BIAS_PARAM], [-0.01, 0.01, 0.0, 0.01])
    # the clipping's global norm is the weights' alone: 100 * sqrt(3) -> 1
    np.testing.assert_allclose(updates["w"], np.full(3, -0.1 / np.sqrt(3)), rtol=1e-6)


def _spread(counts):
    counts = np.asarray(counts, np.float64).reshape(-1, E).sum(0)
    return counts.max() / counts.mean()


def test_bias_balancing_evens_out_a_skewed_router():
    """A router that sends most tokens to expert 0: with the router frozen, the sign rule
    alone brings the busiest expert's load towards the mean, step by step."""
    module = MoE(num_groups=8, **BIAS)
    params = jax.tree.map(jnp.asarray, _params(module, scale=0.3))
    params["gate_kernel"] = params["gate_kernel"].at[:, 0].add(0.3)  # skewed to expert 0 ...
    x = jnp.asarray(X + 1.0)  # ... for tokens of a positive mean
    tx = with_bias_update(optax.sgd(0.0), 0.05)  # only the bias moves
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        (_, (_, metrics)), (grads, _) = _grads(module, params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, metrics["expert_counts"][0]

    spreads = []
    for _ in range(60):
        params, state, counts = step(params, state)
        spreads.append(_spread(counts))
    assert spreads[0] > 2.5, spreads[0]  # the skew is real
    assert np.mean(spreads[-10:]) < 0.5 * spreads[0], spreads  # measured: 3.4 -> 1.2
    assert float(params[BIAS_PARAM][0]) < 0  # the overloaded expert's bias went down


def test_balance_values_are_checked():
    with pytest.raises(ConfigError, match="MoE.balance must be one of"):
        MoE(**{**BIAS, "balance": "loss"}).init({"params": jax.random.key(0)},
                                                 jnp.zeros((8, M)), deterministic=True)


# -- the all-to-all: chunked, hierarchical ------------------------------------------------------

from jaxspeed.cost.hlo import collectives  # noqa: E402
from jaxspeed.moe.all_to_all import hierarchical_all_to_all  # noqa: E402
from jaxspeed.sharding.two_level import spanned_hosts  # noqa: E402
from jaxspeed.moe.all_to_all import MAX_AUTO_CHUNKS, MIN_CHUNK_BYTES, a2a_chunk_count  # noqa: E402
from jaxspeed.moe.all_to_all import collectives_overlap  # noqa: E402


#: `(split_axis, concat_axis)` pairs: either before the other, the same, a trailing one.
A2A_AXES = ((0, 1), (1, 0), (0, 0), (1, 2))


def _a2a_and_transpose(exchange):
    """`exchange(a, split, concat)` for each of `A2A_AXES` in one program on 8 devices, and its
    transpose at a cotangent: `(outputs, d x)`."""
    mesh = make_mesh({"expert": 8})
    x = jnp.asarray(np.random.default_rng(6).normal(size=(8 * 16, 8, 3)), jnp.float32)
    cot = jnp.asarray(np.random.default_rng(7).normal(size=x.shape), jnp.float32)
    body = jax.jit(jax.shard_map(lambda a: [exchange(a, *axes) for axes in A2A_AXES],
                                 mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    out, vjp = jax.vjp(body, x)
    return out, vjp(body(cot))[0]


@functools.cache
def _flat_a2a_and_transpose():
    return _a2a_and_transpose(
        lambda a, split, concat: jax.lax.all_to_all(a, "expert", split, concat, tiled=True))


@pytest.mark.parametrize("hosts", [2, 4])
def test_hierarchical_all_to_all_equals_the_flat_one_and_so_does_its_transpose(hosts):
    """Every pair of `A2A_AXES` (one program a `hosts`)."""
    two = _a2a_and_transpose(
        lambda a, split, concat: hierarchical_all_to_all(a, "expert", split, concat, hosts=hosts))
    chex.assert_trees_all_equal(two, _flat_a2a_and_transpose())  # the same values moved: exact


def test_spanned_hosts_counts_processes_along_the_axis():
    mesh = jax.sharding.AbstractMesh((2, 1, 4, 1), ("data", "sequence", "expert", "tensor"))
    assert spanned_hosts(mesh, "expert") == 1  # one process here
    assert spanned_hosts(mesh, "expert", processes=2) == 1  # experts inside each process
    assert spanned_hosts(mesh, "expert", processes=4) == 2  # 2 devices a process
    assert spanned_hosts(mesh, "data", processes=2) == 2
    flat = jax.sharding.AbstractMesh((1, 4, 2), ("data", "expert", "tensor"))
    assert spanned_hosts(flat, "expert", processes=2) == 2  # 2 experts x 2 tensor a process
    assert spanned_hosts(flat, "missing", processes=2) == 1


def test_a2a_chunk_count():
    row = MIN_CHUNK_BYTES // 4  # a chunk needs 4 rows
    assert a2a_chunk_count("auto", 64, row, ep=1) == 1  # nothing to overlap
    assert a2a_chunk_count("auto", 64, row, ep=4) == MAX_AUTO_CHUNKS
    assert a2a_chunk_count("auto", 12, row, ep=4) == 3  # 4 rows each, dividing 12
    assert a2a_chunk_count("auto", 6, row, ep=4) == 1  # too small to cut
    assert a2a_chunk_count(2, 6, row, ep=4) == 2
    assert a2a_chunk_count("auto", 64, row, ep=4, overlap=False) == 1  # CPU: nothing overlaps
    assert a2a_chunk_count(2, 64, row, ep=4, overlap=False) == 2  # asked for
    with pytest.raises(ConfigError, match="a2a_chunks=4 must divide the capacity buffer's 6 slots"):
        a2a_chunk_count(4, 6, row, ep=4)


def test_collectives_overlap_except_on_cpu_devices():
    from types import SimpleNamespace as NS

    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))
    assert not collectives_overlap(mesh.abstract_mesh)
    with jax.set_mesh(mesh):
        assert not collectives_overlap()
    assert collectives_overlap(NS(abstract_device=NS(platform="cuda")))


EP = dict(num_experts=E, d_ff=H, k=2, capacity_factor=1.0, min_capacity=1, gate_noise=1.0,
          use_rts=True, aux_loss_coef=0.1)


@pytest.mark.parametrize("axes,extra,collective,count", [
    ({"expert": 8}, dict(a2a_chunks=2), "all-to-all", 4 * 2),  # 2 slots a device: 1 group x C
    # the slots cross (fewer bytes than the tokens here); chunked as well: `tests/
    # test_moe_host_tokens.py::test_chunks_that_overlap_the_ffn_keep_the_slots`
    ({"expert": 8}, dict(all_to_all="hierarchical", a2a_hosts=2), "collective-permute", None),
])
def test_chunked_and_hierarchical_exchanges_equal_one_device(axes, extra, collective, count):
    out, ref, hlo = _on_mesh_and_one_device(EP, axes, **extra)
    ((_, (y, metrics)), grads), ((_, (ref_y, ref_metrics)), ref_grads) = out, ref
    chex.assert_trees_all_equal(metrics["expert_counts"], ref_metrics["expert_counts"])
    assert_close((y, grads), (ref_y, ref_grads), rtol=RTOL)
    ops = [op.kind for op in collectives(hlo, num_devices=8) for _ in range(op.executions)]
    assert collective in ops
    if count is not None:  # 2 exchanges forward and 2 backward, each in `chunks` pieces
        assert ops.count(collective) == count, ops.count(collective)
    if extra.get("all_to_all") == "hierarchical":
        assert "all-to-all" not in ops


def test_hierarchical_exchange_options_are_checked():
    with pytest.raises(ConfigError, match="MoE.all_to_all must be one of"):
        MoE(**EP, all_to_all="tree").init({"params": jax.random.key(0)}, jnp.zeros((8, M)),
                                          deterministic=True)
    module = MoE(**EP, all_to_all="hierarchical", a2a_hosts=3)
    with jax.set_mesh(make_mesh({"expert": 8})), pytest.raises(
            ConfigError, match="a2a_hosts=3 must divide the size 8 of the mesh axis 'expert'"):
        jax.eval_shape(module.init, {"params": jax.random.key(0), "gating": jax.random.key(1)},
                       jax.device_put(X, NamedSharding(make_mesh({"expert": 8}), P("expert"))))


def test_a_bf16_layer_on_the_mesh_equals_one_device():
    """bf16 experts replicated over `data` (data=2 x expert=4): their gradients are summed over
    the devices in fp32 (XLA:CPU aborted the process compiling the bf16 all-reduce that JAX
    makes of it) and equal the single-device layer's within bf16 rounding."""
    out, ref, hlo = _on_mesh_and_one_device(dict(EP, dtype=jnp.bfloat16), {"data": 2, "expert": 4})
    ((_, (y, metrics)), grads), ((_, (ref_y, ref_metrics)), ref_grads) = out, ref
    chex.assert_trees_all_equal(metrics["expert_counts"], ref_metrics["expert_counts"])
    assert y.dtype == jnp.float32 and grads[0]["expert_w_in"].dtype == jnp.float32
    # per token: x and each expert's hidden and output rounded to bf16, forward and backward
    rtol = mixed_rtol(width=64, depth=3 * 6, casts=6, dtype="bfloat16")
    assert_close((y, grads), (ref_y, ref_grads), rtol=rtol)
    reduced = [line for line in hlo.splitlines() if " all-reduce(" in line]
    assert reduced and not [line for line in reduced if "= bf16[" in line]
