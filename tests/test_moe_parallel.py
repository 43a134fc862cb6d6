"""Expert parallelism of the `MoE` layer (jaxspeed/moe/parallel.py) on 8 emulated devices.

Every layout computes the same math as one device with `num_groups=8`: outputs, gradients
(params and input), the sown aux loss and the expert counts, with drops, random token
selection and gate noise on.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspeed.errors import ConfigError
from jaxspeed.runtime.mesh import make_mesh
from jaxspeed.moe.layer import AUX_LOSS, METRICS, MoE
from jaxspeed.sharding.planner import plan_sharding
from numerics import assert_close, program_rtol

OPTIONS = dict(num_experts=8, d_ff=16, k=2, capacity_factor=1.0, min_capacity=1,
               gate_noise=1.0, use_rts=True, aux_loss_coef=0.1, z_loss_coef=0.01)


def f32(a):
    return jnp.asarray(np.asarray(a, np.float32))


X = np.random.default_rng(1).normal(size=(8, 8, 12)).astype(np.float32)  # T=64, Tg=8, C=2
COT = np.random.default_rng(2).normal(size=X.shape).astype(np.float32)

#: A layout against one device (tests/numerics.py): the same math with sums in another order.
#: Widest sums: the 64 tokens a weight gradient sums over (psum'd across devices; M = 12,
#: H = 16, E = 8 are narrower). Forward chain of 6 reductions: gate matmul, softmax, the top-k
#: renormalisation, the expert FFN's two matmuls, the combine over k; 3x with the backward.
#: A misrouted token or expert moves values by O(1) relative, far above this.
RTOL = program_rtol(width=64, depth=3 * 6)
#: The loss `sum(y * COT) + aux` adds one more sum, over the 64 x 12 outputs; as its terms
#: cancel, it is compared relative to `sum |y * COT|`, the magnitude the model bounds.
LOSS_RTOL = program_rtol(width=64 * 12, depth=6 + 1)


def abstract(module):
    return jax.eval_shape(functools.partial(module.init, deterministic=True),
                          {"params": jax.random.key(0)}, jnp.zeros(X.shape))


def numpy_params(module):
    rng = np.random.default_rng(0)
    shapes = nn.unbox(abstract(module)["params"])
    return jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.5).astype(np.float32), shapes)


def loss_fn(module, params, x, key):
    y, state = module.apply({"params": params}, x, rngs={"gating": key},
                            mutable=[AUX_LOSS, METRICS])
    aux = sum(jax.tree.leaves(state[AUX_LOSS]))
    return jnp.sum(y * COT) + aux, (y, aux, state[METRICS])


def assert_same_math(out, ref):
    """`run`'s outputs equal up to the rounding of reordered sums; counts exactly."""
    (loss, (y, aux, metrics)), grads = out
    (ref_loss, (ref_y, ref_aux, ref_metrics)), ref_grads = ref
    # Choices per expert and the dropped fraction count routing decisions: exact.
    counts = ("expert_counts", "dropped_fraction")
    chex.assert_trees_all_equal({k: metrics[k] for k in counts},
                                {k: ref_metrics[k] for k in counts})
    rest = lambda m: {k: v for k, v in m.items() if k not in counts}  # noqa: E731
    assert_close((y, aux, rest(metrics), grads), (ref_y, ref_aux, rest(ref_metrics), ref_grads),
                 rtol=RTOL)
    scale = float(np.abs(np.asarray(ref_y, np.float64) * COT).sum() + abs(float(ref_aux)))
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=LOSS_RTOL * scale)


def run(module, params, x):
    """(loss, (y, aux, metrics)), (d params, d x), and the lowered program's text."""
    step = jax.jit(jax.value_and_grad(functools.partial(loss_fn, module), argnums=(0, 1),
                                       has_aux=True))
    lowered = step.lower(params, x, jax.random.key(3))
    return lowered.compile()(params, x, jax.random.key(3)), lowered.as_text()


@functools.cache
def single_device(drop_tokens=True):
    module = MoE(num_groups=8, drop_tokens=drop_tokens, **OPTIONS)
    params = jax.tree.map(jnp.asarray, numpy_params(module))
    out, _ = run(module, params, f32(X))
    return out


@pytest.mark.parametrize("axes,stage", [
    ({"data": 8}, 0),
    ({"expert": 8}, 0),
    # expert parallelism, tensor-split experts, ZeRO-3 over data, 2 groups per device (what
    # {"expert": 4, "tensor": 2} at ZeRO-0 ran, and more; ZeRO-0 is the cases above)
    ({"data": 2, "expert": 2, "tensor": 2}, 3),
])
def test_layouts_equal_single_device(axes, stage):
    ref = single_device()
    metrics = ref[0][1][2]
    assert int(metrics["expert_counts"][0].sum()) == 64 * 2
    assert float(metrics["dropped_fraction"][0]) > 0
    mesh = make_mesh(axes)
    dp = mesh.shape["data"] * mesh.shape["expert"]
    module = MoE(num_groups=None if dp == 8 else 8, **OPTIONS)
    host_params = numpy_params(module)
    specs = nn.get_partition_spec(abstract(module))["params"]
    with jax.set_mesh(mesh):
        plan = plan_sharding(host_params, specs, mesh, stage=stage)
        params = jax.device_put(host_params, plan.params)
        x = jax.device_put(X, NamedSharding(mesh, P(("data", "expert"))))
        out, text = run(module, params, x)
    if mesh.shape["expert"] > 1:
        assert "all_to_all" in text
    if stage == 3:  # experts ZeRO-3 over data (and split over tensor), the router over both
        assert params["expert_w_in"].sharding.spec == P("expert", "data", "tensor")
        assert params["gate_kernel"].sharding.spec == P(("data", "expert"), None)
    assert_same_math(out, ref)


@pytest.mark.slow
def test_dropless_under_expert_parallelism_equals_single_device():
    ref = single_device(drop_tokens=False)
    module = MoE(drop_tokens=False, **OPTIONS)
    params = numpy_params(module)
    with jax.set_mesh(make_mesh({"expert": 8})):
        out, text = run(module, params, f32(X))
    assert "all_to_all" in text
    assert_same_math(out, ref)


@pytest.mark.slow
def test_dropless_under_data_parallelism_equals_single_device():
    """expert=1: each device runs the dropless grouped matmul on its own groups (per-device
    group sizes inside the partial-manual `shard_map`), no all-to-all."""
    ref = single_device(drop_tokens=False)
    module = MoE(drop_tokens=False, **OPTIONS)
    params = numpy_params(module)
    with jax.set_mesh(make_mesh({"data": 8})):
        out, text = run(module, params, f32(X))
    assert "all_to_all" not in text
    assert_same_math(out, ref)


def test_zero3_plan_shards_experts_over_data_only():
    mesh = make_mesh({"data": 2, "expert": 2, "tensor": 2})
    module = MoE(num_experts=4, d_ff=16, use_residual=True, num_shared_experts=1)
    shapes = nn.unbox(abstract(module)["params"])
    specs = nn.get_partition_spec(abstract(module))["params"]
    plan = plan_sharding(shapes, specs, mesh, stage=3)
    got = jax.tree.map(lambda s: s.spec, plan.params)

    def axes(spec):
        return [a for e in spec for a in ((e,) if isinstance(e, str) else e or ())]

    for name, spec in got.items():
        if name.startswith("expert_"):
            assert spec[0] == "expert" and axes(spec).count("expert") == 1, (name, spec)
            assert "data" in axes(spec) and "tensor" in axes(spec), (name, spec)
        elif name not in ("residual_coef_bias",):  # 2 elements: too small to shard 4 ways
            assert {"data", "expert"} <= set(axes(spec)), (name, spec)


def test_num_experts_not_divisible_by_expert_axis_raises():
    module = MoE(num_experts=6, d_ff=8, num_groups=8)
    with jax.set_mesh(make_mesh({"expert": 4, "data": 2})):
        with pytest.raises(ConfigError, match="num_experts=6"):
            abstract(module)


def test_num_groups_must_be_a_multiple_of_data_parallel_size():
    module = MoE(num_experts=8, d_ff=8, num_groups=4)
    with jax.set_mesh(make_mesh({"data": 8})):
        with pytest.raises(ConfigError, match="num_groups=4"):
            abstract(module)


def test_dynamic_capacity_under_expert_parallelism_equals_single_device():
    """Every device picks the same bucket (a pmax of the busiest expert), so expert=8 gives
    the single-device result (8 tokens per group, cap 16: buckets 8 and 16). The cap holds
    every token's 2 choices, so no bucket that holds the busiest expert drops one: that result
    is the single-device dropless layer's (one device's buckets: `tests/test_moe_layer.py`)."""
    options = {**OPTIONS, "capacity_factor": 8.0, "dynamic_capacity": True}
    module = MoE(**options)
    params = numpy_params(module)
    with jax.set_mesh(make_mesh({"expert": 8})):
        got, text = run(module, params, f32(X))
    assert "all_to_all" in text and "stablehlo.case" in text
    assert_same_math(got, single_device(drop_tokens=False))
