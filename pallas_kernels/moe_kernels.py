"""MoE dispatch and combine as Pallas kernels: token rows scattered to expert slots and back.

A routing assigns each token `t` up to `k` (expert, slot) pairs. Flattened, slot `s = e * C +
c` of the `[E * C, M]` expert buffer holds at most one (token, choice). No `[T, E, C]` one-hot
tensor is ever built (GShard's einsum formulation); both directions are row gathers:

  - `moe_combine` (grid: token blocks x column blocks). Each program loads its tokens' `k` flat
    slot indices from a `[k, T]` table and gathers those rows of `y`, accumulating
    `weight * row` in fp32. A dropped choice has slot `-1` and contributes nothing.
  - `moe_dispatch` (grid: slot blocks x column blocks). A cheap XLA scatter of int32 token ids
    first builds the inverse map `src [E * C]` (slot -> token, `-1` for an empty slot); each
    program then gathers its slots' rows of `x` and writes zeros to empty slots. Slot blocks
    run over the flattened `E * C` axis, so a capacity that is not a multiple of the block
    size costs nothing extra.

Backward passes are the same kernels (Tutel's encode/decode duality):
  - d x of dispatch = combine of the cotangent with weight 1 on every kept choice;
  - d y of combine = dispatch of the cotangent, each slot scaled by its choice's weight;
  - d weight of combine = per (token, choice) the dot of `y[slot]` with the output cotangent,
    a third kernel over token blocks (partial sums per column block, summed by XLA).

On Hopper (sm_90) and newer, `moe_dispatch` and `moe_combine` run the Mosaic GPU kernels of
`moe_kernels_mgpu` instead (same semantics; TMA row gathers): JAX deprecates its Triton
backend, which jaxspeed keeps for older GPUs (A100) for as long as JAX has it.

The kernels here use only what the Pallas Triton lowering supports: row gathers with an int32 index
vector (`ref[idx, :]`), power-of-2 tiles, elementwise math and row reductions, so the same
source runs with `interpret=True` on CPU and compiles for NVIDIA GPUs. Rows are padded only
where a size is not a multiple of its block (tokens or slots to the block, columns to a power
of 2 block), which typical model widths never need.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as _backend
from pallas_kernels._moe_shared import check_routing, differentiable_ops, pad_to, slot_table
from pallas_kernels._shapes import out_like

#: Tokens (combine) or slots (dispatch) handled by one program, at most.
BLOCK_ROWS = 32
#: Feature columns handled by one program, at most (a power of 2).
BLOCK_COLS = 256
#: The smallest row block used without padding; below it the rows are padded instead.
_MIN_ROWS = 8


class _Static(NamedTuple):
    """The hashable, trace-time geometry of one call."""

    num_tokens: int  # T
    num_slots: int  # E * C
    width: int  # M
    block_t: int
    tokens_padded: int
    block_s: int
    slots_padded: int
    block_m: int
    width_padded: int
    interpret: bool


def _row_block(n: int, block: int) -> tuple[int, int]:
    """A power-of-2 row block for `n` rows and the padded row count it needs."""
    b = min(block, pl.next_power_of_2(max(n, 1)))
    if n % b == 0:
        return b, n
    divisor = b
    while n % divisor:
        divisor //= 2
    if divisor >= _MIN_ROWS:
        return divisor, n
    return b, pl.cdiv(n, b) * b


def _geometry(num_tokens, num_slots, width, interpret, block_rows, block_cols) -> _Static:
    block_rows = BLOCK_ROWS if block_rows is None else block_rows
    block_cols = BLOCK_COLS if block_cols is None else block_cols
    for name, value in (("block_rows", block_rows), ("block_cols", block_cols)):
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of 2, got {value!r}")
    block_t, tokens_padded = _row_block(num_tokens, block_rows)
    block_s, slots_padded = _row_block(num_slots, block_rows)
    block_m = min(block_cols, pl.next_power_of_2(width))
    width_padded = pl.cdiv(width, block_m) * block_m
    return _Static(num_tokens, num_slots, width, block_t, tokens_padded, block_s,
                   slots_padded, block_m, width_padded, bool(interpret))


def _compiler_params():
    return plgpu.CompilerParams(num_warps=4, num_stages=1)


# ---- kernels ------------------------------------------------------------------------------------


def _gather_rows(ref, idx):
    """Rows `ref[idx]` of the current column block; `idx < 0` reads row 0 (callers mask)."""
    return ref[jnp.maximum(idx, 0), :]


def _combine_kernel(slots_ref, w_ref, y_ref, o_ref, *, k: int):
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for j in range(k):
        idx = slots_ref[j, :]
        w = w_ref[j, :]
        rows = _gather_rows(y_ref, idx).astype(jnp.float32) * w[:, None]
        acc += jnp.where((idx >= 0)[:, None], rows, 0.0)
    o_ref[...] = acc.astype(o_ref.dtype)


def _dispatch_kernel(src_ref, x_ref, o_ref):
    idx = src_ref[...]
    rows = _gather_rows(x_ref, idx)
    o_ref[...] = jnp.where((idx >= 0)[:, None], rows, jnp.zeros_like(rows))


def _scaled_dispatch_kernel(src_ref, scale_ref, x_ref, o_ref):
    idx = src_ref[...]
    rows = _gather_rows(x_ref, idx).astype(jnp.float32) * scale_ref[...][:, None]
    o_ref[...] = jnp.where((idx >= 0)[:, None], rows, 0.0).astype(o_ref.dtype)


def _combine_dw_kernel(slots_ref, y_ref, do_ref, dw_ref, *, k: int):
    do = do_ref[...].astype(jnp.float32)
    for j in range(k):
        idx = slots_ref[j, :]
        rows = _gather_rows(y_ref, idx).astype(jnp.float32)
        dw_ref[j, :] = jnp.where(idx >= 0, jnp.sum(rows * do, axis=1), 0.0)


# ---- pallas_call wrappers (padded operands) -----------------------------------------------------


def _combine_call(y, slots, weight, static: _Static):
    """`out[t] = sum_j weight[j, t] * y[slots[j, t]]`: y `[S, Mp]`, slots/weight `[k, Tp]`."""
    k = slots.shape[0]
    bt, bm = static.block_t, static.block_m
    table = pl.BlockSpec((k, bt), lambda i, m: (0, i))
    return pl.pallas_call(
        functools.partial(_combine_kernel, k=k),
        grid=(static.tokens_padded // bt, static.width_padded // bm),
        in_specs=[table, table, pl.BlockSpec((y.shape[0], bm), lambda i, m: (0, m))],
        out_specs=pl.BlockSpec((bt, bm), lambda i, m: (i, m)),
        out_shape=out_like((y, slots, weight), (static.tokens_padded, static.width_padded), y.dtype),
        compiler_params=_compiler_params(),
        interpret=static.interpret,
        name="moe_combine",
    )(slots, weight, y)


def _dispatch_call(x, src, scale, static: _Static):
    """`out[s] = scale[s] * x[src[s]]` (0 where `src < 0`): x `[Tp, Mp]`, src/scale `[Sp]`."""
    bs, bm = static.block_s, static.block_m
    vec = pl.BlockSpec((bs,), lambda i, m: (i,))
    rows = pl.BlockSpec((x.shape[0], bm), lambda i, m: (0, m))
    if scale is None:
        kernel, in_specs, operands = _dispatch_kernel, [vec, rows], (src, x)
    else:
        kernel, in_specs, operands = _scaled_dispatch_kernel, [vec, vec, rows], (src, scale, x)
    return pl.pallas_call(
        kernel,
        grid=(static.slots_padded // bs, static.width_padded // bm),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bs, bm), lambda i, m: (i, m)),
        out_shape=out_like(operands, (static.slots_padded, static.width_padded), x.dtype),
        compiler_params=_compiler_params(),
        interpret=static.interpret,
        name="moe_dispatch",
    )(*operands)


def _combine_dw_call(y, slots, do, static: _Static):
    """`dw[j, t] = <y[slots[j, t]], do[t]>`, fp32 `[k, Tp]` (0 for dropped choices)."""
    k = slots.shape[0]
    bt, bm = static.block_t, static.block_m
    num_col_blocks = static.width_padded // bm
    partial = pl.pallas_call(
        functools.partial(_combine_dw_kernel, k=k),
        grid=(static.tokens_padded // bt, num_col_blocks),
        in_specs=[
            pl.BlockSpec((k, bt), lambda i, m: (0, i)),
            pl.BlockSpec((y.shape[0], bm), lambda i, m: (0, m)),
            pl.BlockSpec((bt, bm), lambda i, m: (i, m)),
        ],
        out_specs=pl.BlockSpec((None, k, bt), lambda i, m: (m, 0, i)),
        out_shape=out_like((y, slots, do), (num_col_blocks, k, static.tokens_padded), jnp.float32),
        compiler_params=_compiler_params(),
        interpret=static.interpret,
        name="moe_combine_dweight",
    )(slots, y, do)
    return partial.sum(axis=0)


_dispatch, _combine = differentiable_ops(_combine_call, _dispatch_call, _combine_dw_call)


# ---- public API ---------------------------------------------------------------------------------


def _family(backend, interpret, block_rows, block_cols):
    """`_backend.resolve`, refusing the Triton kernels' tiling for the Mosaic GPU ones."""
    family, interpret = _backend.resolve(backend, interpret)
    if family == _backend.MOSAIC_GPU and (block_rows, block_cols) != (None, None):
        raise ValueError(
            "block_rows/block_cols tile the Triton kernels; the Mosaic GPU kernels (sm_90 and "
            "newer) take their tiling from pallas_kernels.moe_kernels_mgpu.default_config")
    return family, interpret


def moe_dispatch(x, expert_index, position, num_experts: int, capacity: int, *,
                 interpret=None, block_rows: int | None = None,
                 block_cols: int | None = None, backend: str | None = None):
    """Scatters token rows into per-expert capacity buffers (differentiable in `x`).

    Args:
      x: `[tokens, model]` token rows.
      expert_index: int `[tokens, k]`, the expert of each choice.
      position: int `[tokens, k]`, its slot in that expert's buffer; a choice with
        `position >= capacity` (or negative) is dropped.
      num_experts: `E`, static.
      capacity: `C`, slots per expert, static.
      interpret: run the kernels interpreted; default: when not compiling for a GPU (see
        `_backend.resolve`; an `InterpretGPUParams` runs the Mosaic GPU kernels interpreted).
      block_rows: slots (tokens, in the backward pass) per program, a power of 2; default
        `BLOCK_ROWS` (Triton kernels only).
      block_cols: columns per program, a power of 2; default `BLOCK_COLS` (Triton only).
      backend: "mosaic_gpu" or "triton"; default: from the device compiled for (Mosaic GPU
        on sm_90 and newer, Triton on older GPUs, the Triton-form kernels interpreted on CPU).

    Returns:
      `[E, C, model]` in `x`'s dtype; slots no choice fills are zero.
    """
    family, interpret = _family(backend, interpret, block_rows, block_cols)
    if family == _backend.MOSAIC_GPU:
        from pallas_kernels import moe_kernels_mgpu

        return moe_kernels_mgpu.moe_dispatch(x, expert_index, position, num_experts, capacity,
                                             interpret=interpret)
    if x.ndim != 2:
        raise ValueError(f"x must have shape [tokens, model], got {x.shape}")
    num_experts, capacity = int(num_experts), int(capacity)
    if num_experts < 1 or capacity < 1:
        raise ValueError(
            f"num_experts and capacity must be positive ints, got {num_experts} and {capacity}")
    check_routing(expert_index, position, x.shape[0])
    tokens, width = x.shape
    static = _geometry(tokens, num_experts * capacity, width, interpret, block_rows, block_cols)
    slots = slot_table(expert_index, position, capacity, static)
    out = _dispatch(pad_to(x, static.tokens_padded, static.width_padded), slots, static)
    return out[: static.num_slots, :width].reshape(num_experts, capacity, width)


def moe_combine(y, expert_index, position, weight, *, interpret=None,
                block_rows: int | None = None, block_cols: int | None = None,
                backend: str | None = None):
    """Weighted gather of expert outputs back to tokens (differentiable in `y` and `weight`).

    `out[t] = sum_j weight[t, j] * y[expert_index[t, j], position[t, j]]` over the kept
    choices (`0 <= position < C`); a dropped choice contributes nothing, whatever its weight.

    Args:
      y: `[E, C, model]` expert outputs.
      expert_index: int `[tokens, k]`.
      position: int `[tokens, k]`; `>= C` (or negative) marks a dropped choice.
      weight: `[tokens, k]` combine weights (computed in fp32; the gradient has its dtype).
      interpret, backend: as for `moe_dispatch`.
      block_rows: tokens (slots, in the backward pass) per program, a power of 2; default
        `BLOCK_ROWS` (Triton kernels only).
      block_cols: columns per program, a power of 2; default `BLOCK_COLS` (Triton only).

    Returns:
      `[tokens, model]` in `y`'s dtype, accumulated in fp32.
    """
    family, interpret = _family(backend, interpret, block_rows, block_cols)
    if family == _backend.MOSAIC_GPU:
        from pallas_kernels import moe_kernels_mgpu

        return moe_kernels_mgpu.moe_combine(y, expert_index, position, weight,
                                            interpret=interpret)
    if y.ndim != 3:
        raise ValueError(f"y must have shape [experts, capacity, model], got {y.shape}")
    num_experts, capacity, width = y.shape
    tokens = expert_index.shape[0] if expert_index.ndim == 2 else -1
    check_routing(expert_index, position, tokens, weight=weight)
    static = _geometry(tokens, num_experts * capacity, width, interpret, block_rows, block_cols)
    slots = slot_table(expert_index, position, capacity, static)
    w = jnp.pad(weight.astype(jnp.float32).T, ((0, 0), (0, static.tokens_padded - tokens)))
    y_flat = pad_to(y.reshape(num_experts * capacity, width), static.num_slots,
                     static.width_padded)
    out = _combine(y_flat, slots, w, static)
    return out[:tokens, :width]
