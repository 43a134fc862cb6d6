"""Tests for the reference GPT (jaxspeed/models/gpt.py)."""

import functools
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspeed.errors import ConfigError
from jaxspeed.ops.losses import lm_loss
from jaxspeed.models import GPT, build_gpt
from jaxspeed.models.gpt import count_params
from jaxspeed.models.layers import swiglu
from numerics import assert_close, gpt_rtol, mixed_rtol, sum_rtol

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16)
BATCH, LENGTH = 2, 16
#: Two orders of TINY's logits and gradients on one batch agree to this (tests/numerics.py).
RTOL = gpt_rtol(tokens=BATCH * LENGTH, d_model=32, d_ff=64, n_layers=2, vocab=64)


def _tokens(seed=0, length=LENGTH):
    return jax.random.randint(jax.random.key(seed), (BATCH, length), 0, TINY["vocab_size"])


ALL_VARIANTS = dict(norm="layernorm", mlp="swiglu", positions="learned", tie_embeddings=False)


def _init(model, tokens=None):
    tokens = _tokens() if tokens is None else tokens
    return nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens))


@functools.lru_cache(maxsize=None)
def _model_and_params(**variant):
    """Model, unboxed params and jitted apply, cached: XLA compiles are the slow part on CPU."""
    model = GPT(**TINY, **variant)
    return model, _init(model), jax.jit(model.apply)


def test_init_shapes_and_count():
    _, params, _ = _model_and_params()
    params = params["params"]
    d, h, hd, f, n = 32, 2, 16, 64, 2
    shapes = jax.tree.map(jnp.shape, params)
    assert shapes["embedding"] == (64, d)
    assert shapes["layers"]["attn"]["query"] == (n, d, h, hd)
    assert shapes["layers"]["attn"]["out"] == (n, h, hd, d)
    assert shapes["layers"]["mlp"]["wi"] == (n, d, f)
    assert shapes["layers"]["mlp"]["wo"] == (n, f, d)
    assert shapes["final_norm"]["scale"] == (d,)
    assert "head" not in params and "pos_embedding" not in params
    expected = 64 * d + d + n * (4 * d * d + 2 * d * f + 2 * d)
    assert count_params(params) == expected


@pytest.mark.parametrize(
    "variant", [{}, ALL_VARIANTS]
)
def test_every_param_has_logical_names(variant):
    model = GPT(**TINY, **variant)
    abstract = jax.eval_shape(model.init, jax.random.key(0), _tokens())["params"]
    specs = nn.get_partition_spec(abstract)
    boxed = jax.tree_util.tree_flatten_with_path(
        abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )[0]
    allowed = {"layers", "vocab", "embed", "length", "heads", "kv", "mlp"}
    for path, leaf in boxed:
        assert isinstance(leaf, nn.LogicallyPartitioned), path
        spec = leaf.get_partition_spec()
        assert len(spec) == leaf.value.ndim, (path, spec, leaf.value.shape)
        assert set(spec) <= allowed, (path, spec)
        stacked = path[0].key == "layers"
        assert (spec[0] == "layers") == stacked, (path, spec)
    if variant:
        assert specs["head"] == jax.P("embed", "vocab")
        assert specs["pos_embedding"] == jax.P("length", "embed")
        assert specs["final_norm"]["bias"] == jax.P("embed")
        assert specs["layers"]["mlp"]["wi_gate"] == jax.P("layers", "embed", "mlp")


def test_output_shape_and_dtype():
    _, params, apply = _model_and_params()
    logits = apply(params, _tokens())
    assert logits.shape == (BATCH, LENGTH, TINY["vocab_size"])
    assert logits.dtype == jnp.float32
    assert np.all(np.isfinite(logits))


@pytest.mark.parametrize("variant", [{}, ALL_VARIANTS], ids=["rotary", "learned"])
def test_causality(variant):
    _, params, apply = _model_and_params(**variant)
    tokens = _tokens()[:1]
    t = 9
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % TINY["vocab_size"])
    logits = apply(params, jnp.concatenate([tokens, changed]))  # one compile for both rows
    base, new = logits[:1], logits[1:]
    np.testing.assert_array_equal(base[:, :t], new[:, :t])
    assert not np.allclose(base[:, t], new[:, t])


def test_variants_run():
    """layernorm + swiglu + learned positions + untied head, and shorter sequences."""
    model, params, _ = _model_and_params(**ALL_VARIANTS)
    logits = jax.jit(model.apply)(params, _tokens(length=5))
    assert logits.shape == (BATCH, 5, TINY["vocab_size"])
    assert np.all(np.isfinite(logits))


@functools.lru_cache(maxsize=None)
def _logits_and_grads(remat_policy):
    _, params, _ = _model_and_params()
    tokens = _tokens()
    batch = {"targets": jnp.roll(tokens, -1, axis=1)}
    model = GPT(**TINY, remat_policy=remat_policy)

    @jax.jit
    def run(params):
        loss_fn = lambda p: lm_loss(model.apply(p, tokens), batch)  # noqa: E731
        return model.apply(params, tokens), jax.grad(loss_fn)(params)

    return run(params)


def test_full_remat_matches_no_remat():
    # Recomputing the forward pass is another program (its fusions differ), not the same one.
    assert_close(_logits_and_grads("full"), _logits_and_grads("none"), rtol=RTOL)


@pytest.mark.parametrize(
    "policy", ["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"]
)
def test_remat_policy_appears_in_the_jaxpr(policy):
    _, params, _ = _model_and_params()
    model = GPT(**TINY, remat_policy=policy)
    loss_fn = lambda p: model.apply(p, _tokens()).sum()  # noqa: E731
    text = str(jax.make_jaxpr(jax.grad(loss_fn))(params))
    assert ("checkpoint" in text or "remat" in text) == (policy != "none")


def test_bf16_params_give_finite_float32_logits():
    _, params, apply = _model_and_params()
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    logits = apply(bf16, _tokens())
    assert logits.dtype == jnp.float32
    assert np.all(np.isfinite(logits))
    # The bf16 forward pass (tests/numerics.py, point 4): its dots accumulate in fp32 (sums of
    # at most 64 terms, d_ff and vocab; 8 a layer + 4 chained), and per layer its 8 reductions,
    # 2 residual adds and 6 weights each round to bf16 once, as do the embedding, the final
    # norm and the head's two operands (4).
    rtol = mixed_rtol(width=64, depth=8 * 2 + 4, casts=16 * 2 + 4, dtype="bfloat16")
    assert_close(logits, apply(params, _tokens()), rtol=rtol)


def test_compute_dtype_attribute():
    _, params, _ = _model_and_params()
    model = GPT(**TINY, dtype=jnp.bfloat16)
    logits = jax.jit(model.apply)(params, _tokens())
    assert logits.dtype == jnp.float32 and np.all(np.isfinite(logits))


def test_layers_are_scanned_not_unrolled():
    def num_eqns(n_layers):
        model = GPT(**{**TINY, "n_layers": n_layers})
        params = jax.eval_shape(model.init, jax.random.key(0), _tokens())
        jaxpr = jax.make_jaxpr(model.apply)(nn.unbox(params), _tokens())
        return len(jaxpr.jaxpr.eqns), str(jaxpr)

    eqns2, text2 = num_eqns(2)
    eqns8, _ = num_eqns(8)
    assert eqns2 == eqns8
    assert "scan" in text2


def test_build_gpt_from_namespace():
    cfg = SimpleNamespace(
        type="gpt", **TINY, norm="layernorm", mlp="swiglu", positions="rotary",
        tie_embeddings=True, moe=None, sparse_attention=None,
    )
    model = build_gpt(cfg, remat_policy="full")
    assert isinstance(model, GPT)
    assert (model.d_model, model.norm, model.mlp, model.remat_policy) == (32, "layernorm", "swiglu", "full")


@pytest.mark.parametrize(
    "moe, match",
    [
        ({"k": 2}, r"model\.moe\.num_experts is required"),
        ({"num_experts": 4, "top_k": 2}, "model.moe.top_k: unknown key"),
        ({"num_experts": 4, "every_n_layers": 3}, r"model\.moe: .*every_n_layers=3 must divide"),
        ({"num_experts": 2, "k": 3}, r"model\.moe: .*k must be <= num_experts=2"),
    ],
)
def test_build_gpt_rejects_bad_moe_blocks(moe, match):
    with pytest.raises(ConfigError, match=match):
        build_gpt(SimpleNamespace(**TINY, moe=moe))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(norm="batchnorm"), "rmsnorm"),
        (dict(mlp="relu"), "swiglu"),
        (dict(positions="alibi"), "learned"),
        (dict(remat_policy="sometimes"), "dots_saveable"),
        (dict(n_heads=3), "divisible"),
        (dict(n_heads=32), "even head size"),
    ],
)
def test_bad_values_name_accepted(kwargs, match):
    """Model keys are checked by the config (`build_gpt` validates what it is given); the
    remat policy when the layers are built."""
    remat = kwargs.pop("remat_policy", "none")
    with pytest.raises(ConfigError, match=match):
        model = build_gpt({**TINY, **kwargs}, remat_policy=remat)
        model.init(jax.random.key(0), _tokens())


def test_too_long_sequence_is_rejected():
    model = GPT(**TINY)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.init(jax.random.key(0), _tokens(length=TINY["max_seq_len"] + 1))


def test_logical_axes_shard_on_a_mesh():
    """With rules and a mesh the hints become sharding constraints; results are unchanged."""
    model, params, apply = _model_and_params()
    tokens = jax.random.randint(jax.random.key(1), (4, LENGTH), 0, TINY["vocab_size"])
    boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = (("batch", "data"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
        sharded = jax.device_put(params, shardings)
        logits = jax.jit(model.apply)(sharded, tokens)
    assert sharded["params"]["layers"]["attn"]["query"].sharding.spec == jax.P(None, None, "tensor", None)
    assert logits.sharding.spec == jax.P("data", None, "tensor")
    # Tensor-parallel partial sums: the same forward pass summed in another order.
    rtol = gpt_rtol(tokens=4 * LENGTH, d_model=32, d_ff=64, n_layers=2, vocab=64)
    assert_close(logits, apply(params, tokens), rtol=rtol)


def test_swiglu_equals_autodiff_of_silu_times_up():
    """The hand-written backward pass (which keeps only `gate` and `up`) against autodiff."""
    kg, ku, kc = jax.random.split(jax.random.key(0), 3)
    gate = 4 * jax.random.normal(kg, (3, 16, 64))
    up = jax.random.normal(ku, (3, 16, 64))
    cot = jax.random.normal(kc, (3, 16, 64))

    def reference(g, u):
        return nn.silu(g) * u

    out, vjp = jax.vjp(swiglu, gate, up)
    want_out, want_vjp = jax.vjp(reference, gate, up)
    # Elementwise: the two forms differ by a few roundings per value, no sums.
    rtol = sum_rtol(8)
    assert_close(out, want_out, rtol=rtol)
    assert_close(vjp(cot), want_vjp(cot), rtol=rtol)
