"""Dispatch / combine (jaxspeed/moe/dispatch.py, pallas_kernels/moe_dispatch.py).

Both implementations, the Pallas kernels (interpreted on CPU, compiled on a GPU) and the XLA
scatter/gather path, are checked against a dense one-hot reference (`[T, E, C]` tensors, built
here only), in the outputs and in every gradient: d x of dispatch, d y and d weight of combine,
in fp32 and bf16. Routings with the same shapes share one compiled program, so the edge cases
(empty experts, every token on one expert, k = E, capacities that are not a multiple of the
block) cost little.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_lowering import lower_for_cuda

from jaxspeed.moe.dispatch import combine, dispatch
from jaxspeed.moe.gating import Routing
from numerics import assert_close, mixed_rtol, sum_rtol
from pallas_kernels import moe_kernels as kernels
from pallas_kernels.backend import MOSAIC_GPU, kernel_backend


def fill_slots(expert_index, num_experts):
    """GShard slot filling, plainly: choice by choice, tokens in order."""
    tokens, k = expert_index.shape
    position = np.zeros((tokens, k), np.int32)
    fill = [0] * num_experts
    for j in range(k):
        for t in range(tokens):
            position[t, j] = fill[expert_index[t, j]]
            fill[expert_index[t, j]] += 1
    return position


def random_choices(rng, tokens, k, experts):
    return np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)


def make_case(seed, expert_index, num_experts, capacity, width, dtype="float32"):
    """Random operands, rounded to `dtype` (but held as float32, for the reference); the
    combine weights stay fp32, as the gate computes them."""
    rng = np.random.default_rng(seed)
    tokens, k = expert_index.shape

    def normal(*shape):
        return rng.normal(size=shape).astype(jnp.dtype(dtype)).astype(np.float32)

    return dict(
        expert_index=expert_index, position=fill_slots(expert_index, num_experts),
        weight=rng.random((tokens, k)).astype(np.float32), x=normal(tokens, width),
        y=normal(num_experts, capacity, width), d_dispatched=normal(num_experts, capacity, width),
        d_combined=normal(tokens, width), num_experts=num_experts, capacity=capacity,
        dtype=dtype)


def dense_reference(case):
    """Outputs and gradients from `[T, E, C]` one-hot dispatch and combine tensors."""
    e, p, w, C = case["expert_index"], case["position"], case["weight"], case["capacity"]
    tokens, k = e.shape
    mask = np.zeros((tokens, case["num_experts"], C))
    weights = np.zeros_like(mask)
    for t in range(tokens):
        for j in range(k):
            if p[t, j] < C:
                mask[t, e[t, j], p[t, j]] = 1.0
                weights[t, e[t, j], p[t, j]] = w[t, j]
    x, y, dd, dc = case["x"], case["y"], case["d_dispatched"], case["d_combined"]
    dw = np.einsum("tec,ecm,tm->tec", mask, y, dc)
    dw = np.array([[dw[t, e[t, j], p[t, j]] if p[t, j] < C else 0.0 for j in range(k)]
                   for t in range(tokens)])
    return dict(dispatched=np.einsum("tec,tm->ecm", mask, x),
                dx=np.einsum("tec,ecm->tm", mask, dd),
                combined=np.einsum("tec,ecm->tm", weights, y),
                dy=np.einsum("tec,tm->ecm", weights, dc), dweight=dw)


@functools.cache
def compiled(impl, num_experts, capacity):
    """Dispatch and combine with their VJPs, as one jitted program (cached per geometry)."""

    def run(x, y, expert_index, position, weight, d_dispatched, d_combined):
        def routing(w):
            zero = jnp.zeros((), jnp.float32)
            return Routing(expert_index, position, w, capacity, zero, zero,
                           jnp.zeros((num_experts,), jnp.int32), zero)

        dispatched, dispatch_vjp = jax.vjp(
            lambda x: dispatch(x, routing(weight), num_experts, impl=impl), x)
        combined, combine_vjp = jax.vjp(lambda y, w: combine(y, routing(w), impl=impl), y, weight)
        (dx,) = dispatch_vjp(d_dispatched)
        dy, dweight = combine_vjp(d_combined)
        return dict(dispatched=dispatched, dx=dx, combined=combined, dy=dy, dweight=dweight)

    return jax.jit(run)


def check(case, impl):
    fn = compiled(impl, case["num_experts"], case["capacity"])
    dtype = case["dtype"]
    low = ("x", "y", "d_dispatched", "d_combined")  # in `dtype`; the routing as built
    names = ("x", "y", "expert_index", "position", "weight", "d_dispatched", "d_combined")
    got = fn(*(jnp.asarray(case[n], dtype if n in low else None) for n in names))
    want = dense_reference(case)
    assert got["dispatched"].shape == (case["num_experts"], case["capacity"], case["x"].shape[1])
    assert got["dispatched"].dtype == got["combined"].dtype == got["dx"].dtype == dtype
    # Dispatch copies rows: exact. The rest is one sum each against float64 (tests/numerics.py):
    # over the k choices (dx, combined), over the width (d weight), or a product (dy), in fp32;
    # in bf16 the result is rounded once more, to bf16 (point 4; d weight stays fp32).
    np.testing.assert_array_equal(np.asarray(got.pop("dispatched"), np.float32),
                                  want.pop("dispatched"))
    width, k = case["x"].shape[1], case["expert_index"].shape[1]
    rtol = (sum_rtol(max(width, k)) if dtype == "float32" else
            mixed_rtol(width=max(width, k), depth=1, casts=1, dtype=dtype))
    assert_close(got, want, rtol=rtol)


def edge_cases(seed, tokens, experts, capacity, width, dtype="float32"):
    """Top-2 choices: random (with drops); only experts 0 and 1 used (the others get no
    tokens); every first choice on expert 0."""
    rng = np.random.default_rng(seed)
    random = random_choices(rng, tokens, 2, experts)
    two_experts = np.stack([rng.permutation(2) for _ in range(tokens)]).astype(np.int32)
    one_expert = np.stack([np.zeros(tokens), rng.integers(1, experts, tokens)], 1)
    return [make_case(seed + i, e.astype(np.int32), experts, capacity, width, dtype)
            for i, e in enumerate((random, two_experts, one_expert))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_matches_dense_reference_with_drops_and_edge_cases(impl, dtype):
    # C = 7 is not a multiple of any block; E * C = 28 and M = 24 are padded by the kernels.
    for case in edge_cases(0, tokens=40, experts=4, capacity=7, width=24, dtype=dtype):
        assert (case["position"] >= 7).any()
        check(case, impl)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_k_equals_num_experts(impl):
    rng = np.random.default_rng(1)
    check(make_case(1, random_choices(rng, 16, 4, 4), 4, 12, 16), impl)


def test_pallas_multi_block_grids(monkeypatch):
    # Tiny blocks: several token, slot and column blocks per call, blocks straddling experts.
    if kernel_backend() == MOSAIC_GPU:  # the GPU suite on Hopper: tiled by its own config
        pytest.skip("block_rows/block_cols tile the Triton and interpreted kernels only "
                    "(the Mosaic GPU kernels' tiling: test_moe_kernels_mgpu.py)")
    monkeypatch.setattr(kernels, "BLOCK_ROWS", 8)
    monkeypatch.setattr(kernels, "BLOCK_COLS", 8)
    compiled.cache_clear()
    with pytest.raises(ValueError, match="block_cols must be a power of 2, got 24"):
        kernels.moe_dispatch(jnp.zeros((4, 3)), jnp.zeros((4, 1), jnp.int32),
                             jnp.zeros((4, 1), jnp.int32), 2, 2, block_cols=24)
    rng = np.random.default_rng(2)
    for case in (make_case(2, random_choices(rng, 24, 3, 6), 6, 5, 24),
                 make_case(3, np.array([[0, 1 + t % 5, 1 + (t + 1) % 5] for t in range(24)],
                                       np.int32), 6, 5, 24)):
        check(case, "pallas")
    compiled.cache_clear()


def test_kernels_keep_dtype_and_skip_invalid_positions():
    x = jnp.arange(12.0, dtype=jnp.bfloat16).reshape(4, 3)
    e = jnp.asarray([[0], [1], [0], [1]], jnp.int32)
    p = jnp.asarray([[0], [0], [-1], [5]], jnp.int32)  # negative and >= capacity: dropped
    out = kernels.moe_dispatch(x, e, p, 2, 2, interpret=True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, np.array([[[0, 1, 2], [0, 0, 0]], [[3, 4, 5], [0, 0, 0]]]))
    back = kernels.moe_combine(out, e, p, jnp.full((4, 1), 2.0), interpret=True)
    np.testing.assert_array_equal(back, np.array([[0, 2, 4], [6, 8, 10], [0] * 3, [0] * 3]))


@pytest.mark.parametrize(("device_kind", "call"), [("NVIDIA A100-SXM4-80GB", "__gpu$xla.gpu.triton"),
                                                   ("NVIDIA H200", "mosaic_gpu_v2")])
def test_pallas_lowers_for_triton(device_kind, call):
    """Forward and backward lower to GPU kernels: Triton on an A100, Mosaic GPU on Hopper,
    chosen by the device lowered for (`tests/test_gpu_compile.py` compiles them too)."""
    tokens, k, experts, capacity, width = 64, 2, 8, 20, 512
    e = jnp.asarray(random_choices(np.random.default_rng(4), tokens, k, experts))
    p = jnp.asarray(fill_slots(np.asarray(e), experts))

    def loss(x, w):
        d = kernels.moe_dispatch(x, e, p, experts, capacity)
        out = kernels.moe_combine(d * 2, e, p, w)
        return out.astype(jnp.float32).sum()

    x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((tokens, k), jnp.float32)
    # value_and_grad: the loss keeps the forward combine live (jax 0.12 drops it from a grad).
    text = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), x, w, device_kind=device_kind)
    # dispatch, combine; backward: combine (dx), weighted dispatch (dy), d weight.
    assert text.count(f"custom_call @{call}(") == 5


def test_bad_input_is_named():
    r = Routing(jnp.zeros((4, 1), jnp.int32), jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1)),
                2, 0.0, 0.0, jnp.zeros(2, jnp.int32), 0.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch(jnp.zeros((4, 3)), r, 2, impl="triton")
    with pytest.raises(ValueError, match=r"y must have shape \[experts, capacity=2, model\]"):
        combine(jnp.zeros((2, 3, 3)), r, impl="xla")
    with pytest.raises(ValueError, match="num_experts must be a positive Python int, got 0"):
        dispatch(jnp.zeros((4, 3)), r, 0, impl="xla")
    with pytest.raises(ValueError, match="x must have shape"):
        dispatch(jnp.zeros((5, 3)), r, 2, impl="xla")
    with pytest.raises(ValueError, match="expert_index must have shape"):
        dispatch(jnp.zeros((5, 3)), r, 2, impl="pallas")
    with pytest.raises(ValueError, match="position must be an integer array"):
        kernels.moe_combine(jnp.zeros((2, 2, 3)), r.expert_index, r.weight, r.weight)
