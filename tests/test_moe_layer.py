"""The `MoE` Flax layer (jaxspeed/moe/layer.py) without a mesh.

The reference is written from the building blocks for one token group: `gate_logits` ->
`top_k_gating` -> `dispatch` -> `expert_ffn` -> `combine`, plus the aux loss formula.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspeed.errors import ConfigError
from jaxspeed.moe.dispatch import combine, dispatch
from jaxspeed.moe.experts import ExpertParams, expert_ffn
from jaxspeed.moe.gating import gate_logits, top_k_gating
from jaxspeed.moe.layer import AUX_LOSS, METRICS, MoE
from numerics import assert_close, program_rtol

#: The layer against another program of its math (the blocks, dropless, another capacity path;
#: tests/numerics.py). Widest sums: the 32 tokens a weight gradient sums over (M = 12, H = 8,
#: E = 4 are narrower). Forward chain of 6 reductions: gate matmul, softmax, the top-k
#: renormalisation, the expert FFN's two matmuls, the combine over k; 3x with the backward.
#: A routing or slot bug moves outputs and gradients by O(1) relative, far above this.
RTOL = program_rtol(width=32, depth=3 * 6)


def f32(a):
    return jnp.asarray(np.asarray(a, np.float32))


def init_shapes(module, x):
    """`module.init(..., deterministic=True)` traced only (no compile)."""
    init = functools.partial(module.init, deterministic=True)
    return jax.eval_shape(init, {"params": jax.random.key(0)}, x)


def random_params(module, x, seed=0, scale=0.5):
    """The layer's params (with their logical metadata) filled from numpy: no init compile."""
    shapes = init_shapes(module, x)
    rng = np.random.default_rng(seed)
    return {"params": jax.tree.map(
        lambda s: f32(rng.normal(size=s.shape) * scale), shapes["params"])}


def tokens(shape=(4, 8, 12), seed=1):
    return f32(np.random.default_rng(seed).normal(size=shape))


def layer_loss(module, params, x, rngs=None, deterministic=False):
    """A scalar touching the output (fixed random cotangent) plus the sown aux loss."""
    y, state = module.apply(params, x, rngs=rngs, deterministic=deterministic,
                            mutable=[AUX_LOSS, METRICS])
    cot = f32(np.random.default_rng(7).normal(size=y.shape))
    aux = sum(jax.tree.leaves(state[AUX_LOSS]))
    return jnp.sum(y * cot) + aux, (y, aux, state[METRICS])


@pytest.mark.parametrize("k,activation", [(1, "relu"), (2, "swiglu")])
def test_layer_matches_blocks_reference(k, activation):
    module = MoE(num_experts=4, d_ff=8, k=k, capacity_factor=0.75, activation=activation,
                 use_rts=False, aux_loss_coef=0.1, z_loss_coef=0.01, num_groups=1)
    x = tokens()
    params = random_params(module, x)

    def reference(p, x):
        p = nn.unbox(p)["params"]
        flat = x.reshape(-1, x.shape[-1])
        routing = top_k_gating(gate_logits(flat, p["gate_kernel"]), k, 0.75, z_loss_coef=0.01)
        experts = ExpertParams(p["expert_w_in"], p["expert_w_out"], p.get("expert_w_gate"))
        buf = dispatch(flat, routing, 4)
        y = combine(expert_ffn(buf, experts, activation=activation), routing).reshape(x.shape)
        aux = 0.1 * routing.aux_loss + routing.z_loss
        cot = f32(np.random.default_rng(7).normal(size=y.shape))
        return jnp.sum(y * cot) + aux, (y, aux, routing)

    def both(p, x):
        layer = jax.value_and_grad(functools.partial(layer_loss, module), argnums=(0, 1),
                                   has_aux=True)(p, x)
        return layer, jax.value_and_grad(reference, argnums=(0, 1), has_aux=True)(p, x)

    ((_, (y, aux, metrics)), grads), ((_, (y_ref, aux_ref, routing)), grads_ref) = (
        jax.jit(both)(params, x))

    assert float(routing.dropped_fraction) > 0  # the capacity really drops choices
    assert_close((y, aux, grads), (y_ref, aux_ref, grads_ref), rtol=RTOL)
    # Dropped choices / (T * k): a count over a power of two, exact in any order.
    chex.assert_trees_all_equal(metrics["dropped_fraction"][0], routing.dropped_fraction)
    chex.assert_trees_all_equal(metrics["expert_counts"][0], routing.expert_counts)
    assert np.abs(np.asarray(nn.unbox(grads[0])["params"]["gate_kernel"])).max() > 0


def test_aux_loss_is_sown_and_differentiable():
    module = MoE(num_experts=4, d_ff=8, k=2, use_rts=False, aux_loss_coef=0.5,
                 z_loss_coef=0.1, num_groups=2)
    x = tokens()
    params = random_params(module, x)

    def aux_only(p):
        _, state = module.apply(p, x, mutable=[AUX_LOSS])
        (value,) = jax.tree.leaves(state[AUX_LOSS])
        return value

    value, grads = jax.jit(jax.value_and_grad(aux_only))(params)
    gate_grad = np.asarray(nn.unbox(grads)["params"]["gate_kernel"])
    chex.assert_shape(value, ())
    assert float(value) > 0
    assert np.all(np.isfinite(gate_grad)) and np.abs(gate_grad).max() > 0


def test_dropless_equals_large_capacity():
    common = dict(num_experts=4, d_ff=8, k=2, use_rts=False, num_groups=2)
    dropless = MoE(drop_tokens=False, **common)
    large = MoE(capacity_factor=2.0, **common)  # capacity = k * 2 * Tg / E = Tg: no drops
    x = tokens()
    params = random_params(large, x)
    step = lambda m, p: jax.value_and_grad(  # noqa: E731
        functools.partial(layer_loss, m), argnums=(0, 1), has_aux=True)(p, x)
    ((_, (y_a, aux_a, metrics_a)), grads_a), ((_, (y_b, aux_b, metrics_b)), grads_b) = (
        jax.jit(lambda p: (step(dropless, p), step(large, p)))(params))
    assert float(metrics_b["dropped_fraction"][0]) == 0.0
    assert_close((y_a, aux_a, grads_a), (y_b, aux_b, grads_b), rtol=RTOL)


def test_residual_and_shared_experts_have_gradients():
    module = MoE(num_experts=4, d_ff=8, k=1, use_residual=True, num_shared_experts=2,
                 activation="swiglu", use_rts=False)
    x = tokens()
    params = random_params(module, x)
    names = set(params["params"])
    assert {"residual_w_in", "residual_w_out", "residual_w_gate", "residual_coef_kernel",
            "residual_coef_bias", "shared_w_in", "shared_w_out", "shared_w_gate"} <= names
    chex.assert_shape(nn.unbox(params)["params"]["shared_w_in"], (12, 16))
    (_, (y, _, _)), (grads, _) = jax.jit(jax.value_and_grad(
        functools.partial(layer_loss, module), argnums=(0, 1), has_aux=True))(params, x)
    chex.assert_shape(y, x.shape)
    for name, g in nn.unbox(grads)["params"].items():
        g = np.asarray(g)
        assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, name


def test_shapes_dtypes_and_logical_axes():
    module = MoE(num_experts=4, d_ff=8, activation="swiglu", use_residual=True,
                 num_shared_experts=1)
    x = tokens()
    shapes = jax.eval_shape(module.init, {"params": jax.random.key(0),
                                          "gating": jax.random.key(1)}, x)
    specs = nn.get_partition_spec(shapes)["params"]
    assert tuple(specs["expert_w_in"]) == ("expert", "embed", "mlp")
    assert tuple(specs["expert_w_out"]) == ("expert", "mlp", "embed")
    assert tuple(specs["gate_kernel"]) == ("embed", None)
    assert tuple(specs["shared_w_in"]) == ("embed", "mlp")
    assert tuple(specs["residual_w_out"]) == ("mlp", "embed")
    params = {"params": shapes["params"]}
    for inp in (x.astype(jnp.bfloat16), x.reshape(32, 12)):
        out = jax.eval_shape(functools.partial(module.apply, deterministic=True), params, inp)
        assert out.shape == inp.shape and out.dtype == inp.dtype


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=5), "k"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(capacity_factor=-1.0), "capacity_factor"),
    (dict(noisy_gate_policy="Gaussian"), "noisy_gate_policy"),
    (dict(activation="tanh"), "activation"),
    (dict(num_experts=0), "num_experts"),
])
def test_bad_options_raise(kwargs, match):
    module = MoE(**{"num_experts": 4, "d_ff": 8, **kwargs})
    with pytest.raises(ConfigError, match=match):
        init_shapes(module, tokens())


def test_bad_num_groups_raise():
    module = MoE(num_experts=4, d_ff=8, num_groups=5)
    with pytest.raises(ConfigError, match="num_groups"):
        init_shapes(module, tokens())


@pytest.mark.parametrize("kwargs,match", [
    (dict(), "use_rts"),
    (dict(use_rts=False, gate_noise=1.0), "gate_noise"),
    (dict(use_rts=False, noisy_gate_policy="Jitter"), "Jitter"),
    (dict(use_rts=False, noisy_gate_policy="RSample"), "RSample"),
])
def test_missing_gating_rng_raises(kwargs, match):
    module = MoE(num_experts=4, d_ff=8, **kwargs)
    x = tokens()
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(module.init, {"params": jax.random.key(0)}, x)
    # deterministic needs no rng; with one, training traces
    init_shapes(module, x)
    jax.eval_shape(module.init, {"params": jax.random.key(0), "gating": jax.random.key(1)}, x)


@pytest.mark.parametrize("cap_factor, want", [(4.0, "dropless"), (1.0, "fixed")])
def test_dynamic_capacity_matches_its_bucket(cap_factor, want):
    """k=1, 16 tokens per group, 4 experts. Cap 16 (buckets 8, 16): the busiest expert fits,
    so nothing drops and it equals dropless. Cap 4 (one bucket): it equals the fixed capacity."""
    common = dict(num_experts=4, d_ff=8, k=1, use_rts=False, num_groups=2)
    dynamic = MoE(capacity_factor=cap_factor, dynamic_capacity=True, **common)
    other = MoE(drop_tokens=False, **common) if want == "dropless" else MoE(
        capacity_factor=cap_factor, **common)
    x = tokens()
    params = random_params(dynamic, x)
    step = lambda m, p: jax.value_and_grad(  # noqa: E731
        functools.partial(layer_loss, m), argnums=(0, 1), has_aux=True)(p, x)
    both = jax.jit(lambda p: (step(dynamic, p), step(other, p)))
    ((_, (y_a, aux_a, metrics_a)), grads_a), ((_, (y_b, aux_b, metrics_b)), grads_b) = both(params)
    if want == "dropless":
        assert float(metrics_a["dropped_fraction"][0]) == 0.0
        assert "conditional" in both.lower(params).compile().as_text()  # one branch per bucket
    else:
        assert float(metrics_a["dropped_fraction"][0]) > 0.0
        # a count over a power of two: exact in any order
        chex.assert_trees_all_equal(metrics_a["dropped_fraction"], metrics_b["dropped_fraction"])
    assert_close((y_a, aux_a, grads_a), (y_b, aux_b, grads_b), rtol=RTOL)
