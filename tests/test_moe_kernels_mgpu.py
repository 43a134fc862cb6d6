"""Mosaic GPU dispatch / combine (pallas_kernels/moe_kernels_mgpu.py).

The kernels run on CPU in Pallas' GPU interpret mode, which simulates SMEM, TMA copies and
mbarriers and, with `detect_races=True`, reports unordered accesses to one buffer. Outputs and
every gradient (d x of dispatch; d y and d weight of combine) are compared with a plain numpy
reference, in fp32 and bf16. Small tiles (`SMALL`: 16-row blocks, 4 rows a stage, 3 stages)
give several CTAs per call and make the TMA ring wrap. The compiled kernels are checked by
compiling every default config for an H100 and an H200 without a GPU (the CUDA plugin's
deviceless compile).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

from gpu_compile import compile_for_gpu, needs_gpu_compile
from jaxspeed.moe import top_k_gating
from numerics import assert_close, mixed_rtol, sum_rtol
from pallas_kernels import moe_kernels_mgpu as kernels

INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
SMALL = kernels.Config(block_rows=16, block_cols=128, rows_per_stage=4, stages=3)


@pytest.fixture(autouse=True)
def fresh_interpreter():
    """GPU interpret mode keeps global state; a failed kernel leaves it behind."""
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    yield
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def routing(seed, tokens, experts, k, capacity):
    """Top-k routing of random logits, slots filled by `top_k_gating` (drops beyond C)."""
    logits = jax.random.normal(jax.random.key(seed), (tokens, experts))
    r = top_k_gating(logits, k, capacity=capacity, eval_mode=True)
    return np.asarray(r.expert_index), np.asarray(r.position)


def reference(x, y, expert_index, position, weight, d_dispatched, d_combined, capacity):
    """Dispatch, combine and their gradients with loops over (token, choice), in float64."""
    tokens, k = expert_index.shape
    dispatched, dy = np.zeros(y.shape), np.zeros(y.shape)
    combined, dx = np.zeros(x.shape), np.zeros(x.shape)
    dweight = np.zeros(weight.shape)
    for t in range(tokens):
        for j in range(k):
            e, c = expert_index[t, j], position[t, j]
            if not 0 <= c < capacity:
                continue
            dispatched[e, c] = x[t]
            dx[t] += d_dispatched[e, c]
            combined[t] += weight[t, j] * y[e, c]
            dy[e, c] += weight[t, j] * d_combined[t]
            dweight[t, j] = y[e, c] @ d_combined[t]
    return dict(dispatched=dispatched, combined=combined, dx=dx, dy=dy, dweight=dweight)


@functools.cache
def program(num_experts, capacity, config):
    def run(x, y, expert_index, position, weight, d_dispatched, d_combined):
        dispatched, dispatch_vjp = jax.vjp(
            lambda x: kernels.moe_dispatch(x, expert_index, position, num_experts, capacity,
                                           interpret=INTERPRET, config=config), x)
        combined, combine_vjp = jax.vjp(
            lambda y, w: kernels.moe_combine(y, expert_index, position, w,
                                             interpret=INTERPRET, config=config), y, weight)
        (dx,) = dispatch_vjp(d_dispatched)
        dy, dweight = combine_vjp(d_combined)
        return dict(dispatched=dispatched, combined=combined, dx=dx, dy=dy, dweight=dweight)

    return jax.jit(run)


def check(seed, *, tokens, width, experts, k, capacity, dtype, config=SMALL):
    expert_index, position = routing(seed, tokens, experts, k, capacity)
    rng = np.random.default_rng(seed)

    def normal(*shape):  # rounded to `dtype`, held in float64 for the reference
        return rng.normal(size=shape).astype(jnp.dtype(dtype)).astype(np.float64)

    # Random weights, nonzero on dropped choices too: those must contribute nothing.
    operands = dict(x=normal(tokens, width), y=normal(experts, capacity, width),
                    expert_index=expert_index, position=position,
                    weight=rng.random((tokens, k)).astype(np.float32),
                    d_dispatched=normal(experts, capacity, width),
                    d_combined=normal(tokens, width))
    low = ("x", "y", "d_dispatched", "d_combined")
    got = program(experts, capacity, config)(
        *(jnp.asarray(v, dtype if n in low else None) for n, v in operands.items()))
    got = jax.device_get(got)
    assert not interpret_pallas_call.get_races().races_found
    want = reference(**operands, capacity=capacity)
    assert got["dispatched"].dtype == got["combined"].dtype == got["dx"].dtype == dtype
    assert got["dweight"].dtype == np.float32
    # Dispatch copies rows: exact. The rest is one sum each (tests/numerics.py): over the k
    # choices (dx, combined, dy) or over the width (d weight), in fp32; in bf16 the result is
    # rounded once more, to bf16 (d weight stays fp32).
    np.testing.assert_array_equal(np.asarray(got.pop("dispatched"), np.float64),
                                  want.pop("dispatched"))
    rtol = (sum_rtol(max(width, k)) if dtype == "float32" else
            mixed_rtol(width=max(width, k), depth=1, casts=1, dtype=dtype))
    assert_close(got, want, rtol=rtol)
    return expert_index, position


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fp32", "bf16"])
def test_top2_with_drops_and_ragged_sizes(dtype):
    # T = 40 tokens and E * C = 28 slots are not multiples of the 16-row block; M = 64 is
    # padded to the 128-column register vector. C = 7 drops some of the 80 choices.
    _, p = check(0, tokens=40, width=64, experts=4, k=2, capacity=7, dtype=dtype)
    assert (p >= 7).any()


def test_top1_with_empty_slots_full_width():
    # M = 256: two column blocks of 128, no padding; C = 20 leaves slots empty.
    e, p = check(1, tokens=32, width=256, experts=4, k=1, capacity=20, dtype="float32")
    assert (np.bincount(e[p < 20], minlength=4) < 20).any()


def test_default_config_single_block():
    # The default tiles (64-row blocks, 8 rows a stage) on a call smaller than one block.
    check(2, tokens=24, width=128, experts=4, k=2, capacity=8, dtype="bfloat16", config=None)


def test_kernels_keep_dtype_and_skip_invalid_positions():
    x = jnp.arange(4 * 128, dtype=jnp.bfloat16).reshape(4, 128)
    e = jnp.asarray([[0], [1], [0], [1]], jnp.int32)
    p = jnp.asarray([[0], [0], [-1], [5]], jnp.int32)  # negative and >= capacity: dropped
    out = kernels.moe_dispatch(x, e, p, 2, 2, interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16
    want = np.zeros((2, 2, 128))
    want[0, 0], want[1, 0] = x[0], x[1]
    np.testing.assert_array_equal(np.asarray(out, np.float64), want)
    back = kernels.moe_combine(out, e, p, jnp.full((4, 1), 2.0), interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(back, np.float64),
                                  np.concatenate([2 * want[:, 0], np.zeros((2, 128))]))
    assert not interpret_pallas_call.get_races().races_found


def test_config_that_does_not_fit_is_refused_before_launch():
    big = kernels.Config(block_rows=1024, block_cols=256, rows_per_stage=8, stages=4)
    assert kernels.smem_bytes(big, 4096, jnp.float32) > kernels.SMEM_LIMIT
    with pytest.raises(ValueError, match=rf"over the limit of {kernels.SMEM_LIMIT} bytes$"):
        kernels.check_fits(big, 4096, jnp.float32, kernels.SMEM_LIMIT)
    x = jnp.zeros((8, 256), jnp.float32)
    e = p = jnp.zeros((8, 1), jnp.int32)
    with pytest.raises(ValueError, match="shared memory") as info:
        kernels.moe_dispatch(x, e, p, 2, 4, config=big)  # compiled: refused before lowering
    assert "\n" not in str(info.value)
    for config in kernels.AUTO_CONFIGS:
        for dtype in (jnp.float32, jnp.bfloat16):
            kernels.check_fits(config, 8192, dtype, kernels.SMEM_LIMIT, top_k=8)


def test_bad_input_is_named():
    x, e = jnp.zeros((4, 128)), jnp.zeros((4, 1), jnp.int32)
    with pytest.raises(ValueError, match="block_cols must be 128 or 256, got 64"):
        kernels.moe_dispatch(x, e, e, 2, 2, config=kernels.Config(16, 64, 4, 2))
    with pytest.raises(ValueError, match="block_rows must be a multiple of rows_per_stage=4"):
        kernels.moe_combine(jnp.zeros((2, 2, 128)), e, e, jnp.ones((4, 1)),
                            config=kernels.Config(18, 128, 4, 2))
    with pytest.raises(ValueError, match="dtype must be one of"):
        kernels.moe_dispatch(x.astype(jnp.int32), e, e, 2, 2)
    with pytest.raises(ValueError, match="position must be an integer array"):
        kernels.moe_combine(jnp.zeros((2, 2, 128)), e, jnp.ones((4, 1)), jnp.ones((4, 1)))
    assert kernels.supports(4096, jnp.bfloat16) and not kernels.supports(4000, jnp.bfloat16)
    assert not kernels.supports(4096, jnp.int8)


# ---- deviceless compile for Hopper --------------------------------------------------------------


@needs_gpu_compile
@pytest.mark.parametrize("target, dtype", [("h100", "float32"), ("h200", "bfloat16")])
@pytest.mark.parametrize("config", kernels.AUTO_CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_every_auto_config_compiles_for_hopper(config, target, dtype):
    # Forward and backward, both dtypes over the two targets (a compile takes ~6 s here).
    tokens, k, experts, capacity, width = 256, 2, 8, 72, 512
    if kernels.default_config(width, dtype) != config:
        width = 384  # 3 x 128 columns: the 128-column config
    assert kernels.default_config(width, dtype) == config

    def loss(x, w, e, p):
        d = kernels.moe_dispatch(x, e, p, experts, capacity)
        return kernels.moe_combine(d * 2, e, p, w).astype(jnp.float32).sum()

    compiled = compile_for_gpu(
        jax.value_and_grad(loss, argnums=(0, 1)), jax.ShapeDtypeStruct((tokens, width), dtype),
        jax.ShapeDtypeStruct((tokens, k), jnp.float32),
        jax.ShapeDtypeStruct((tokens, k), jnp.int32), jax.ShapeDtypeStruct((tokens, k), jnp.int32),
        target=target)
    # dispatch, combine; backward: combine (dx), scaled dispatch (dy), d weight
    assert compiled.as_text().count('custom_call_target="mosaic_gpu') == 5
