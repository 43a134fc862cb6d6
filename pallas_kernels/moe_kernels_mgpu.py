"""MoE dispatch and combine as Pallas Mosaic GPU kernels for Hopper (sm_90a).

The same row-gather formulation as `pallas_kernels/moe_kernels.py` (the Triton kernels), and
its index tables: combine gathers each token's `k` slot rows of `y`; dispatch gathers each
slot's source token row of `x` through the inverse table `src [E * C]` (-1: empty slot). The
backward passes are these kernels again: d x of dispatch is a combine with weight 1, d y of
combine a dispatch scaled by each slot's weight, and d weight a third kernel (row dots).

Each CTA owns `block_rows` tokens (or slots) by `block_cols` columns and runs one warpgroup:

  - its index (and weight) table tile is brought to SMEM with one TMA copy;
  - rows are gathered by TMA, one `[1, block_cols]` copy per row (Hopper has no TMA gather;
    Blackwell's `gather4` is sm_100 only), `rows_per_stage` rows a stage on one mbarrier, in a
    ring of `stages` stages: the copies of the next stages are in flight while one is summed;
  - sums are fp32 register vectors (`block_cols / 128` values a thread); outputs leave SMEM by
    TMA stores issued as soon as a stage's rows are done.

A dropped choice (or an empty slot) still gathers row 0 so that every stage's barrier expects
the same number of copies; its value is never used (`lax.cond` skips it, an empty slot's row is
overwritten with zeros), so a `nan` or `inf` in row 0 does not leak. Widths are padded to a
multiple of 128 (the 1-D register layout needs it) and row counts to the row block; typical
model widths never need the former.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._shapes import out_like
from pallas_kernels._moe_shared import check_routing, differentiable_ops, pad_to, slot_table

#: Shared memory one CTA may use on H100 and H200 (`sharedMemPerBlockOptin`, 227 KiB).
SMEM_LIMIT = 232448
#: Columns of one register vector: one value per thread of the warpgroup, at least.
_LANES = 128
#: SMEM Mosaic GPU reserves for cross-thread reductions (its `CompilerParams` default), plus
#: a margin for the barriers.
_RESERVED_SMEM = 2048 + 1024
_DTYPES = ("float32", "bfloat16", "float16")


class Config(NamedTuple):
    """Tiling of the kernels.

    Attributes:
      block_rows: tokens (combine, d weight) or slots (dispatch) per CTA, a multiple of
        `rows_per_stage`.
      block_cols: columns per CTA, 128 or 256 (a TMA box is at most 256 wide).
      rows_per_stage: rows gathered per pipeline stage (one mbarrier wait for all of them).
      stages: pipeline depth, at least 2: stages whose copies are in flight at once.
    """

    block_rows: int = 64
    block_cols: int = 256
    rows_per_stage: int = 8
    stages: int = 4


#: Every config `default_config` can pick, for a compile-every-config test.
AUTO_CONFIGS = (Config(64, 256, 8, 4), Config(64, 128, 8, 4))


def supports(width: int, dtype) -> bool:
    """Whether the kernels take `[., width]` rows of `dtype` without padding copies."""
    return jnp.dtype(dtype).name in _DTYPES and width > 0 and width % _LANES == 0


def default_config(width: int, dtype) -> Config:
    """The config used when none is given: 256 columns a CTA where the width allows."""
    del dtype  # the same tiles suit fp32 and 16-bit rows (at most ~100 KiB of SMEM)
    padded = -(-width // _LANES) * _LANES
    return AUTO_CONFIGS[0] if padded % AUTO_CONFIGS[0].block_cols == 0 else AUTO_CONFIGS[1]


def smem_bytes(config: Config, width: int, dtype, *, top_k: int = 2) -> int:
    """Shared memory one CTA of the largest of the kernels needs, in bytes.

    Args:
      config: the tiling.
      width: the row width `M` (a narrower one shrinks the column block).
      dtype: the dtype of the gathered rows.
      top_k: choices per token (the index tables hold `top_k` rows).
    """
    size = jnp.dtype(dtype).itemsize
    cols = min(config.block_cols, -(-width // _LANES) * _LANES)
    ring = config.stages * config.rows_per_stage * cols * size
    tile = config.block_rows * cols * size  # combine's output / d weight's cotangent tile
    tables = 3 * top_k * config.block_rows * 4  # slots, weights (and d weight's output)
    return ring + tile + tables + _RESERVED_SMEM


def check_fits(config: Config, width: int, dtype, smem_limit: int, *, top_k: int = 2) -> None:
    """Raises a one-line `ValueError` unless `config` fits in `smem_limit` bytes of SMEM."""
    need = smem_bytes(config, width, dtype, top_k=top_k)
    if need > smem_limit:
        raise ValueError(
            f"MoE Mosaic GPU config {tuple(config)} (block_rows, block_cols, rows_per_stage, "
            f"stages) needs {need} bytes of shared memory for width {width} "
            f"{jnp.dtype(dtype).name}, over the limit of {smem_limit} bytes")


def _check_config(config: Config) -> None:
    c = config
    if c.block_cols not in (128, 256):
        raise ValueError(f"block_cols must be 128 or 256, got {c.block_cols!r}")
    if c.rows_per_stage < 1 or c.stages < 2:
        raise ValueError(f"rows_per_stage must be >= 1 and stages >= 2, got "
                         f"{c.rows_per_stage!r} and {c.stages!r}")
    if c.block_rows < c.rows_per_stage or c.block_rows % c.rows_per_stage:
        raise ValueError(f"block_rows must be a multiple of rows_per_stage={c.rows_per_stage}, "
                         f"got {c.block_rows!r}")


class _Static(NamedTuple):
    """The hashable, trace-time geometry of one call (field names as `moe_kernels._Static`,
    whose table helpers read `num_tokens`, `num_slots`, `tokens_padded`, `slots_padded`)."""

    num_tokens: int  # T
    num_slots: int  # E * C
    width: int  # M
    block_t: int
    tokens_padded: int
    block_s: int
    slots_padded: int
    block_m: int
    width_padded: int
    rows: int  # rows per stage
    stages: int
    interpret: Any  # None (compiled) or a plgpu.InterpretGPUParams


def _row_block(n: int, block: int, rows: int) -> tuple[int, int]:
    """The row block for `n` rows (a multiple of `rows`, at most `block`) and the padded `n`."""
    b = min(block, -(-n // rows) * rows)
    return b, -(-n // b) * b


def _geometry(num_tokens, num_slots, width, dtype, config, interpret, top_k) -> _Static:
    if jnp.dtype(dtype).name not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {jnp.dtype(dtype).name}")
    config = default_config(width, dtype) if config is None else Config(*config)
    _check_config(config)
    check_fits(config, width, dtype, SMEM_LIMIT, top_k=top_k)
    width_padded = -(-width // _LANES) * _LANES
    block_m = config.block_cols if width_padded % config.block_cols == 0 else _LANES
    block_t, tokens_padded = _row_block(num_tokens, config.block_rows, config.rows_per_stage)
    block_s, slots_padded = _row_block(num_slots, config.block_rows, config.rows_per_stage)
    return _Static(num_tokens, num_slots, width, block_t, tokens_padded, block_s, slots_padded,
                   block_m, width_padded, config.rows_per_stage, config.stages, interpret)


# ---- kernels ------------------------------------------------------------------------------------


def _gather(src_gmem, index, cols, ring, stage, barrier, *, rows: int):
    """Starts the TMA copies of rows `src[max(index(r), 0)]` into `ring[stage]`, r < rows."""
    for r in range(rows):
        row = jnp.maximum(index(r), 0)
        plgpu.copy_gmem_to_smem(src_gmem.at[pl.ds(row, 1), cols],
                                ring.at[stage, pl.ds(r, 1)], barrier.at[stage])


def _weighted_rows_kernel(slots_gmem, w_gmem, y_gmem, do_gmem, out_gmem, scratch, *, k: int,
                          static: _Static, dweight: bool):
    """Combine (`out[t] = sum_j w[j, t] * y[slots[j, t]]`) or, with `dweight`, its d weight
    (`out[m, j, t] = <y[slots[j, t]], do[t]>` over column block `m`).

    Steps run over (token group g of `rows` tokens, choice j); step `g * k + j` gathers the
    j-th choice rows of group g into ring stage `(g * k + j) % stages`.
    """
    ring, tile, slots_smem, w_smem, bars, table_bar = scratch
    bt, bm, rows, stages = static.block_t, static.block_m, static.rows, static.stages
    i, m = lax.axis_index("rows"), lax.axis_index("cols")
    t0, cols = i * bt, pl.ds(m * bm, bm)
    num_steps = (bt // rows) * k
    stages = min(stages, num_steps)

    plgpu.copy_gmem_to_smem(slots_gmem.at[:, pl.ds(t0, bt)], slots_smem, table_bar)
    if dweight:  # the cotangent rows of the whole tile
        plgpu.copy_gmem_to_smem(do_gmem.at[pl.ds(t0, bt), cols], tile, table_bar)
    else:
        plgpu.copy_gmem_to_smem(w_gmem.at[:, pl.ds(t0, bt)], w_smem, table_bar)
    plgpu.barrier_wait(table_bar)

    def fetch(step, stage):
        g, j = step // k, step % k
        _gather(y_gmem, lambda r: slots_smem[j, g * rows + r], cols, ring, stage, bars,
                rows=rows)

    for step in range(stages):
        fetch(step, step)

    def group(g, carry):
        acc = [jnp.zeros((bm,), jnp.float32) for _ in range(rows)]
        for j in range(k):
            step = g * k + j
            stage = lax.rem(step, stages)
            plgpu.barrier_wait(bars.at[stage])
            for r in range(rows):
                t = g * rows + r
                kept = slots_smem[j, t] >= 0
                if dweight:
                    dot = lambda: jnp.sum(ring[stage, r, :].astype(jnp.float32)
                                          * tile[t, :].astype(jnp.float32))
                    w_smem[j, t] = lax.cond(kept, dot, lambda: jnp.float32(0.0))
                else:
                    add = lambda a: a + ring[stage, r, :].astype(jnp.float32) * w_smem[j, t]
                    acc[r] = lax.cond(kept, add, lambda a: a, acc[r])
            plgpu.commit_smem()  # every thread's reads of the stage are done: refill it

            @pl.when(step + stages < num_steps)
            def _():
                fetch(step + stages, stage)

        if not dweight:
            for r in range(rows):
                tile[g * rows + r, :] = acc[r].astype(tile.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile.at[pl.ds(g * rows, rows)],
                                    out_gmem.at[pl.ds(t0 + g * rows, rows), cols])
        return carry

    lax.fori_loop(0, bt // rows, group, None)
    if dweight:
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(w_smem, out_gmem.at[m, :, pl.ds(t0, bt)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _dispatch_kernel(src_gmem, scale_gmem, x_gmem, out_gmem, scratch, *, static: _Static):
    """`out[s] = scale[s] * x[src[s]]`, 0 where `src[s] < 0` (no scaling without `scale`)."""
    ring, src_smem, scale_smem, bars, table_bar = scratch
    bs, bm, rows = static.block_s, static.block_m, static.rows
    i, m = lax.axis_index("rows"), lax.axis_index("cols")
    s0, cols = i * bs, pl.ds(m * bm, bm)
    num_steps = bs // rows
    stages = min(static.stages, num_steps + 1)

    plgpu.copy_gmem_to_smem(src_gmem.at[pl.ds(s0, bs)], src_smem, table_bar)
    if scale_gmem is not None:
        plgpu.copy_gmem_to_smem(scale_gmem.at[pl.ds(s0, bs)], scale_smem, table_bar)
    plgpu.barrier_wait(table_bar)

    def fetch(step, stage):
        _gather(x_gmem, lambda r: src_smem[step * rows + r], cols, ring, stage, bars,
                rows=rows)

    # One stage is being stored while `stages - 1` are being gathered.
    for step in range(min(stages - 1, num_steps)):
        fetch(step, step)

    def body(step, carry):
        stage = lax.rem(step, stages)
        ahead = step + stages - 1

        @pl.when(ahead < num_steps)
        def _():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous store left its stage
            fetch(ahead, lax.rem(ahead, stages))

        plgpu.barrier_wait(bars.at[stage])
        for r in range(rows):
            s = src_smem[step * rows + r]

            @pl.when(s < 0)
            def _():
                ring[stage, r, :] = jnp.zeros((bm,), ring.dtype)

            if scale_gmem is not None:
                @pl.when(s >= 0)
                def _():
                    row = ring[stage, r, :].astype(jnp.float32) * scale_smem[step * rows + r]
                    ring[stage, r, :] = row.astype(ring.dtype)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ring.at[stage], out_gmem.at[pl.ds(s0 + step * rows, rows), cols])
        return carry

    lax.fori_loop(0, num_steps, body, None)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# ---- kernel launches (padded operands) ----------------------------------------------------------


def _launch(body, out_type, scratch, grid, static: _Static, name: str):
    return plgpu.kernel(
        lambda *refs: body(*refs[:-len(scratch)], refs[-len(scratch):]),
        out_type=out_type, scratch_types=scratch, grid=grid, grid_names=("rows", "cols"),
        compiler_params=plgpu.CompilerParams(), interpret=static.interpret, kernel_name=name)


def _ring(static: _Static, dtype):
    return plgpu.SMEM((static.stages, static.rows, static.block_m), dtype)


def _weighted_rows_scratch(static: _Static, k: int, rows_dtype, tile_dtype):
    """`_weighted_rows_kernel`'s scratch: the gather ring, a `[bt, bm]` tile (the output rows,
    or the cotangent rows for d weight), the `[k, bt]` slot and weight tables, the ring's
    barriers and the tables' barrier."""
    bt = static.block_t
    return (_ring(static, rows_dtype), plgpu.SMEM((bt, static.block_m), tile_dtype),
            plgpu.SMEM((k, bt), jnp.int32), plgpu.SMEM((k, bt), jnp.float32),
            plgpu.Barrier(num_arrivals=static.rows, num_barriers=static.stages),
            plgpu.Barrier(num_arrivals=2))


def _combine_call(y, slots, weight, static: _Static):
    """`out[t] = sum_j weight[j, t] * y[slots[j, t]]`: y `[S, Mp]`, slots/weight `[k, Tp]`."""
    k, bt = slots.shape[0], static.block_t
    scratch = _weighted_rows_scratch(static, k, y.dtype, y.dtype)
    kernel = functools.partial(_weighted_rows_kernel, k=k, static=static, dweight=False)
    grid = (static.tokens_padded // bt, static.width_padded // static.block_m)
    out = out_like((y, slots, weight), (static.tokens_padded, static.width_padded), y.dtype)
    return _launch(lambda s, w, y_, o, scr: kernel(s, w, y_, None, o, scr), out, scratch, grid,
                   static, "moe_combine_mgpu")(slots, weight, y)


def _combine_dw_call(y, slots, do, static: _Static):
    """`dw[j, t] = <y[slots[j, t]], do[t]>`, fp32 `[k, Tp]` (0 for dropped choices)."""
    k, bt = slots.shape[0], static.block_t
    scratch = _weighted_rows_scratch(static, k, y.dtype, do.dtype)
    kernel = functools.partial(_weighted_rows_kernel, k=k, static=static, dweight=True)
    num_col_blocks = static.width_padded // static.block_m
    grid = (static.tokens_padded // bt, num_col_blocks)
    out = out_like((y, slots, do), (num_col_blocks, k, static.tokens_padded), jnp.float32)
    partial = _launch(lambda s, y_, d, o, scr: kernel(s, None, y_, d, o, scr), out, scratch,
                      grid, static, "moe_combine_dweight_mgpu")(slots, y, do)
    return partial.sum(axis=0)


def _dispatch_call(x, src, scale, static: _Static):
    """`out[s] = scale[s] * x[src[s]]` (0 where `src < 0`): x `[., Mp]`, src/scale `[Sp]`."""
    bs = static.block_s
    scratch = (_ring(static, x.dtype), plgpu.SMEM((bs,), jnp.int32),
               plgpu.SMEM((bs,), jnp.float32),
               plgpu.Barrier(num_arrivals=static.rows, num_barriers=static.stages),
               plgpu.Barrier(num_arrivals=1 if scale is None else 2))
    grid = (static.slots_padded // bs, static.width_padded // static.block_m)
    out = out_like([a for a in (x, src, scale) if a is not None],
                   (static.slots_padded, static.width_padded), x.dtype)
    kernel = functools.partial(_dispatch_kernel, static=static)
    if scale is None:
        return _launch(lambda s, x_, o, scr: kernel(s, None, x_, o, scr), out, scratch, grid,
                       static, "moe_dispatch_mgpu")(src, x)
    return _launch(kernel, out, scratch, grid, static, "moe_scaled_dispatch_mgpu")(src, scale, x)


# ---- differentiable ops on padded operands ------------------------------------------------------


_dispatch, _combine = differentiable_ops(_combine_call, _dispatch_call, _combine_dw_call)


# ---- public API ---------------------------------------------------------------------------------


def moe_dispatch(x, expert_index, position, num_experts: int, capacity: int, *,
                 interpret=None, config: Config | None = None):
    """Scatters token rows into per-expert capacity buffers (differentiable in `x`).

    Args:
      x: `[tokens, model]` token rows (fp32, bf16 or fp16).
      expert_index: int `[tokens, k]`, the expert of each choice.
      position: int `[tokens, k]`, its slot in that expert's buffer; a choice with
        `position >= capacity` (or negative) is dropped.
      num_experts: `E`, static.
      capacity: `C`, slots per expert, static.
      interpret: None: compiled for the GPU; a `plgpu.InterpretGPUParams`: GPU interpret mode.
      config: the tiling; default `default_config(model, x.dtype)`.

    Returns:
      `[E, C, model]` in `x`'s dtype; slots no choice fills are zero.
    """
    if x.ndim != 2:
        raise ValueError(f"x must have shape [tokens, model], got {x.shape}")
    num_experts, capacity = int(num_experts), int(capacity)
    if num_experts < 1 or capacity < 1:
        raise ValueError(
            f"num_experts and capacity must be positive ints, got {num_experts} and {capacity}")
    check_routing(expert_index, position, x.shape[0])
    tokens, width = x.shape
    static = _geometry(tokens, num_experts * capacity, width, x.dtype, config, interpret,
                       expert_index.shape[1])
    slots = slot_table(expert_index, position, capacity, static)
    out = _dispatch(pad_to(x, tokens, static.width_padded), slots, static)
    return out[: static.num_slots, :width].reshape(num_experts, capacity, width)


def moe_combine(y, expert_index, position, weight, *, interpret=None,
                config: Config | None = None):
    """Weighted gather of expert outputs back to tokens (differentiable in `y` and `weight`).

    `out[t] = sum_j weight[t, j] * y[expert_index[t, j], position[t, j]]` over the kept
    choices (`0 <= position < C`); a dropped choice contributes nothing, whatever its weight.

    Args:
      y: `[E, C, model]` expert outputs (fp32, bf16 or fp16).
      expert_index: int `[tokens, k]`.
      position: int `[tokens, k]`; `>= C` (or negative) marks a dropped choice.
      weight: `[tokens, k]` combine weights (computed in fp32; the gradient has its dtype).
      interpret: None: compiled for the GPU; a `plgpu.InterpretGPUParams`: GPU interpret mode.
      config: the tiling; default `default_config(model, y.dtype)`.

    Returns:
      `[tokens, model]` in `y`'s dtype, accumulated in fp32.
    """
    if y.ndim != 3:
        raise ValueError(f"y must have shape [experts, capacity, model], got {y.shape}")
    num_experts, capacity, width = y.shape
    tokens = expert_index.shape[0] if expert_index.ndim == 2 else -1
    check_routing(expert_index, position, tokens, weight=weight)
    static = _geometry(tokens, num_experts * capacity, width, y.dtype, config, interpret,
                       expert_index.shape[1])
    slots = slot_table(expert_index, position, capacity, static)
    w = jnp.pad(weight.astype(jnp.float32).T, ((0, 0), (0, static.tokens_padded - tokens)))
    y_flat = pad_to(y.reshape(num_experts * capacity, width), static.num_slots,
                     static.width_padded)
    out = _combine(y_flat, slots, w, static)
    return out[:tokens, :width]
