"""Block-sparse flash attention as Pallas Mosaic GPU kernels for Hopper (sm_90a).

The same algorithm as `pallas_kernels.block_sparse_attention` (FlashAttention-2's online
softmax over the key blocks of a query block's row, Dao 2023, Alg. 1; the backward recomputes
the probabilities from the saved base-2 log-sum-exp, dq over the rows and dk/dv over the
columns of the layout's index tables), written for Hopper's units:
  - every tile moves GMEM -> SMEM by TMA (`plgpu.copy_gmem_to_smem`), signalled on an mbarrier;
  - the key (value) blocks of a row, or the query blocks of a column, stream through a ring of
    `Config.stages` SMEM slots: the copy of step `j + stages` is issued as soon as step `j` has
    read its slot, so up to `stages` copies run while the tensor cores work;
  - every matmul is a `plgpu.wgmma` on one warpgroup (M = `Config.tile` rows, 64), fp32
    accumulation, with the probabilities fed to the second matmul from registers.
One program owns `tile` query rows (forward, dq) or `tile` key rows (dk/dv) of one head of one
batch element, on a `(seq / tile, heads, batch)` grid.

The same source runs in GPU interpret mode on CPU (jax 0.12), which shaped two choices:
  - each matmul accumulates into a fresh `plgpu.ACC` opened with `pl.run_scoped` and is added
    to a register carry, rather than accumulating in place through `pl.run_state`: the
    interpreter has no rule for `run_state`, so it jits it as plain arithmetic and fails on its
    effects (`_WGMMAPipelineEffect`, ...). It costs one register add per tile and step;
  - the interpreter's wgmma reads both operands from refs, so when interpreting, the
    probabilities (`ds`) are stored to an SMEM buffer first; compiled, they stay in registers.

Numerics: fp16/bf16 operands, fp32 accumulation and softmax. fp32 inputs are rounded to bf16
before the kernels (and the gradients come back in fp32): wgmma computes f32 operands as tf32,
and tf32 wgmma only reads K-major SMEM operands, while `p @ v`, `ds @ k` and `ds^T @ q` read
`v`, `k` and `q` N-major (transposing them would cost an extra copy of each per step). So an
fp32 call has bf16 input rounding (unit roundoff 2^-8), not fp32 accuracy.

Supported: block (the layout's block) 64 or 128, head_dim 64 or 128 (a multiple of the 128-byte
swizzle's 64 bf16 columns, and small enough that a warpgroup's accumulators stay in
registers), fp32/bf16/fp16, `seq` a multiple of the block. `supports` says whether a shape is
in that domain; `attention` raises a one-line `ValueError` outside it.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._shapes import out_like
from pallas_kernels._sparse_shared import MASK_VALUE, differentiable, layout_tables

#: Hopper's opt-in shared memory per block (`shared_memory_per_block_optin` of H100/H200).
HOPPER_SMEM_LIMIT = 232448
#: Layout block sizes the kernels take: a multiple of wgmma's M (64), at most 128 (registers).
BLOCKS = (64, 128)
#: Head dims: multiples of the 128-byte swizzle's 64 16-bit columns, at most 128 (registers).
HEAD_DIMS = (64, 128)
DTYPES = ("float32", "bfloat16", "float16")
_GRID = ("tiles", "heads", "batch")
_LOG2E = math.log2(math.e)
_SWIZZLE = 128  # bytes: the widest TMA/wgmma swizzle, 64 columns of a 16-bit dtype
_ALIGN = 1024  # a 128-byte-swizzled SMEM buffer starts on a 1024-byte boundary
_ROW = plgpu.Layout.WGMMA.reduce(1)  # a value per row of a wgmma accumulator
_COL = plgpu.Layout.WGMMA.reduce(0)  # a value per column of a wgmma accumulator


class Config(NamedTuple):
    """Tiling of the Mosaic GPU kernels.

    Attributes:
      block: the layout's block: the key blocks of the forward/dq ring, the query blocks of the
        dk/dv ring.
      tile: rows one warpgroup owns, the wgmma M: query rows (forward, dq) or key rows (dk/dv).
        64; a layout block of 128 is then split over two programs.
      stages: SMEM slots of the key (query) block ring, i.e. TMA copies in flight (>= 1).
    """

    block: int
    tile: int = 64
    stages: int = 2


class _Static(NamedTuple):
    """The hashable, trace-time settings of one call."""

    config: Config
    causal: bool
    sm_scale: float
    shared_layout: bool  # one layout for every head
    interpret: object  # None (compiled) or a hashable plgpu.InterpretGPUParams
    set_blocks: int = 0  # set (query, key) blocks of one batch element, all heads together


#: block x block x head_dim products (2 FLOPs each) per set block of each kernel: the forward's
#: q k^T and p v; dq's recomputed q k^T, do v^T and ds k; dk/dv's recomputed q k^T, p^T do,
#: do v^T and ds^T q. Diagonal blocks of a causal layout are computed whole, then masked.
_MATMULS = {"forward": 2, "dq": 3, "dkdv": 4}


#: jax 0.12's `plgpu.kernel` takes a cost estimate; 0.11's does not (its kernels then have none).
_TAKES_COST = "cost_estimate" in inspect.signature(plgpu.kernel).parameters


def _cost(kernel: str, q, static: _Static) -> pl.CostEstimate:
    """The kernel's FLOPs (its matmuls over the set blocks), exponentials and the bytes of
    its operands and outputs, as XLA's cost analysis and `jaxspeed.cost.roofline` read them
    (Mosaic GPU puts it in the custom call's `cost_estimate_json`)."""
    batch, _, _, head_dim = q.shape
    products = batch * static.set_blocks * static.config.block**2
    itemsize = jnp.dtype(q.dtype).itemsize
    tensors = {"forward": 4, "dq": 5, "dkdv": 6}[kernel]  # [b, s, h, d] operands and outputs
    return pl.CostEstimate(flops=2 * _MATMULS[kernel] * products * head_dim,
                           transcendentals=products,  # one exp per score, recomputed by each
                           bytes_accessed=tensors * q.size * itemsize)


def supports(block: int, head_dim: int, dtype) -> bool:
    """Whether the Mosaic GPU kernels take this layout block, head dim and dtype."""
    return block in BLOCKS and head_dim in HEAD_DIMS and jnp.dtype(dtype).name in DTYPES


def _kernel_dtype(dtype) -> np.dtype:
    """The operand dtype inside the kernels: fp32 is rounded to bf16 (module docstring)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.bfloat16) if dtype == jnp.float32 else dtype


def _buffer(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def smem_bytes(config: Config, head_dim: int, dtype) -> int:
    """Shared memory per program of the largest of the forward, dq and dk/dv kernels.

    Args:
      config: the tiling.
      head_dim: the head dim.
      dtype: q's dtype (fp32 counts as bf16, what the kernels hold).

    Returns:
      Bytes, an upper bound: every buffer rounded up to the 1024-byte alignment of swizzled
      tiles, plus the mbarriers (8 bytes each). Mosaic GPU's own count is at most this (block
      128, head_dim 128, bf16, 3 stages: 233584 bytes by Mosaic, 235632 here).
    """
    block = config.block
    size = _kernel_dtype(dtype).itemsize
    tile = _buffer(config.tile * head_dim * size)  # a [tile, head_dim] operand
    ring = config.stages * _buffer(block * head_dim * size)  # [stages, block, head_dim]
    vec_tile, vec_ring = _buffer(config.tile * 4), config.stages * _buffer(block * 4)
    forward = tile + 2 * ring + vec_tile + 8 * (1 + 2 * config.stages)  # q/o, k, v, lse
    dq = 2 * tile + 2 * ring + 2 * vec_tile + 8 * (4 + 2 * config.stages)
    dkdv = 2 * tile + 2 * ring + 2 * vec_ring + 8 * (2 + 4 * config.stages)
    return max(forward, dq, dkdv)


def check_fits(config: Config, head_dim: int, dtype, smem_limit: int) -> None:
    """Raises a one-line `ValueError` when the kernels need more shared memory than
    `smem_limit` bytes (the GPU's `shared_memory_per_block_optin`)."""
    need = smem_bytes(config, head_dim, dtype)
    if need > smem_limit:
        raise ValueError(
            f"block-sparse attention (Mosaic GPU): block {config.block} x head_dim {head_dim} in "
            f"{jnp.dtype(dtype).name} with {config.stages} stages needs {need} bytes of shared "
            f"memory per block, over the GPU's limit of {smem_limit} "
            f"(shared_memory_per_block_optin); use a smaller block or fewer stages"
        )


def auto_config(block: int, head_dim: int, dtype) -> Config:
    """The tiling `impl="auto"` uses: 64-row tiles, a double-buffered ring (2 stages).

    Two stages hide one TMA copy behind one step's matmuls and keep a 64-block program small
    enough for several programs per SM; deeper rings are not measured yet.
    """
    if not supports(block, head_dim, dtype):
        raise ValueError(_unsupported(block, head_dim, dtype))
    return Config(block=block, tile=64, stages=2)


def _unsupported(block, head_dim, dtype) -> str:
    return (
        f"block-sparse attention (Mosaic GPU) supports block in {BLOCKS}, head_dim in "
        f"{HEAD_DIMS} and dtype in {DTYPES}, got block {block}, head_dim {head_dim}, dtype "
        f"{jnp.dtype(dtype).name}"
    )


#: Every `(block, head_dim, dtype name) -> Config` that `auto_config` returns.
AUTO_CONFIGS = {
    (block, head_dim, dtype): auto_config(block, head_dim, dtype)
    for block in BLOCKS for head_dim in HEAD_DIMS for dtype in DTYPES
}


# ---- kernels ------------------------------------------------------------------------------------


def _smem(shape, dtype):
    """An SMEM buffer in the 128-byte-swizzled tiling TMA writes and wgmma reads."""
    columns = _SWIZZLE // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(_SWIZZLE))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _matmul(a, b, shape, staging=None):
    """`a @ b` on the tensor cores, fp32 `[M, N]`; `a` in SMEM or registers, `b` in SMEM.

    With `staging` (an SMEM ref, given in interpret mode only) the register value `a` is first
    stored there: the interpreter's wgmma reads both operands from refs.
    """
    if staging is not None:
        staging[...] = a
        plgpu.commit_smem()
        a = staging

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def _rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _logits(s, q_start, k_start, *, transposed: bool, static: _Static):
    """Scaled base-2 logits of a `[queries, keys]` (or, transposed, `[keys, queries]`) tile,
    causally masked."""
    s = s * (static.sm_scale * _LOG2E)
    if static.causal:
        q_dim, k_dim = (1, 0) if transposed else (0, 1)
        layout = plgpu.Layout.WGMMA
        q_ids = q_start + plgpu.broadcasted_iota(jnp.int32, s.shape, q_dim, layout=layout)
        k_ids = k_start + plgpu.broadcasted_iota(jnp.int32, s.shape, k_dim, layout=layout)
        s = jnp.where(q_ids >= k_ids, s, MASK_VALUE)
    return s


class _Place(NamedTuple):
    """Where a program works: its tile's first row, head, batch element and table row."""

    start: jax.Array
    head: jax.Array
    batch: jax.Array
    entry: tuple  # index of the program's table row: (layout head, block)


def _place(static: _Static) -> _Place:
    tile_index, head, batch = (lax.axis_index(name) for name in _GRID)
    start = tile_index * static.config.tile
    layout_head = 0 if static.shared_layout else head
    return _Place(start, head, batch, (layout_head, start // static.config.block))


def _ring(table_ref, place: _Place, static: _Static, copies):
    """Runs the TMA ring over the blocks listed in one table row.

    Args:
      table_ref: GMEM `[layout_heads, nb, 1 + width]` (count, then block indices).
      place: the program's place.
      static: settings.
      copies: `copies(block_index, slot)` issues the slot's TMA copies.

    Returns:
      `(count, block_of, refill)`: the row's block count, `block_of(j)` its j-th block, and
      `refill(j, slot)` which issues step `j + stages`'s copies into `slot` if there is one.
    """
    stages = static.config.stages
    count = table_ref[(*place.entry, 0)]

    def block_of(j):
        return table_ref[(*place.entry, j + 1)]

    for slot in range(stages):

        @pl.when(slot < count)
        def _prologue():
            copies(block_of(slot), slot)

    def refill(j, slot):
        @pl.when(j + stages < count)
        def _():
            copies(block_of(j + stages), slot)

    return count, block_of, refill


def _slot(j, stages):
    return lax.rem(j, jnp.int32(stages))


def _forward_kernel(rows_gmem, q_gmem, k_gmem, v_gmem, o_gmem, lse_gmem,
                    q_smem, k_smem, v_smem, lse_smem, q_bar, k_bar, v_bar, stage=None, *,
                    static: _Static):
    block, tile, stages = static.config
    head_dim = q_smem.shape[-1]
    at = _place(static)
    q_tile = (at.batch, pl.ds(at.start, tile), at.head)
    plgpu.copy_gmem_to_smem(q_gmem.at[q_tile], q_smem, q_bar.at[0])

    def copies(key_block, slot):
        keys = (at.batch, pl.ds(key_block * block, block), at.head)
        plgpu.copy_gmem_to_smem(k_gmem.at[keys], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_gmem.at[keys], v_smem.at[slot], v_bar.at[slot])

    count, block_of, refill = _ring(rows_gmem, at, static, copies)
    plgpu.barrier_wait(q_bar.at[0])

    def step(j, carry):
        acc, m, l = carry
        slot = _slot(j, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        s = _matmul(q_smem, k_smem.at[slot].transpose((1, 0)), (tile, block))
        s = _logits(s, at.start, block_of(j) * block, transposed=False, static=static)
        m_next = jnp.maximum(m, s.max(axis=1))
        correction = jnp.exp2(m - m_next)
        p = jnp.exp2(s - _rows(m_next, s.shape))
        l = l * correction + p.sum(axis=1)
        plgpu.barrier_wait(v_bar.at[slot])
        pv = _matmul(p.astype(v_smem.dtype), v_smem.at[slot], (tile, head_dim), stage)
        refill(j, slot)  # both matmuls of this step have read the slot
        return acc * _rows(correction, acc.shape) + pv, m_next, l

    init = (
        plgpu.layout_cast(jnp.zeros((tile, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((tile,), -jnp.inf, jnp.float32), _ROW),
        plgpu.layout_cast(jnp.zeros((tile,), jnp.float32), _ROW),
    )
    acc, m, l = lax.fori_loop(0, count, step, init)
    q_smem[...] = (acc / _rows(l, acc.shape)).astype(q_smem.dtype)  # q_smem now holds o
    lse_smem[...] = m + jnp.log2(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_gmem.at[q_tile])
    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[at.batch, at.head, pl.ds(at.start, tile)])
    plgpu.wait_smem_to_gmem(0)


def _dq_kernel(rows_gmem, q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, dq_gmem,
               q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, tile_bar, k_bar, v_bar,
               stage=None, *, static: _Static):
    block, tile, stages = static.config
    head_dim = q_smem.shape[-1]
    at = _place(static)
    q_tile = (at.batch, pl.ds(at.start, tile), at.head)
    vec_tile = (at.batch, at.head, pl.ds(at.start, tile))
    for i, (src, dst) in enumerate([(q_gmem.at[q_tile], q_smem), (do_gmem.at[q_tile], do_smem),
                                    (lse_gmem.at[vec_tile], lse_smem),
                                    (delta_gmem.at[vec_tile], delta_smem)]):
        plgpu.copy_gmem_to_smem(src, dst, tile_bar.at[i])

    def copies(key_block, slot):
        keys = (at.batch, pl.ds(key_block * block, block), at.head)
        plgpu.copy_gmem_to_smem(k_gmem.at[keys], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_gmem.at[keys], v_smem.at[slot], v_bar.at[slot])

    count, block_of, refill = _ring(rows_gmem, at, static, copies)
    for i in range(4):
        plgpu.barrier_wait(tile_bar.at[i])
    lse = plgpu.load(lse_smem, layout=_ROW)
    delta = plgpu.load(delta_smem, layout=_ROW)

    def step(j, dq):
        slot = _slot(j, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        s = _matmul(q_smem, k_smem.at[slot].transpose((1, 0)), (tile, block))
        s = _logits(s, at.start, block_of(j) * block, transposed=False, static=static)
        p = jnp.exp2(s - _rows(lse, s.shape))
        plgpu.barrier_wait(v_bar.at[slot])
        dp = _matmul(do_smem, v_smem.at[slot].transpose((1, 0)), (tile, block))
        ds = p * (dp - _rows(delta, dp.shape))
        dq = dq + _matmul(ds.astype(k_smem.dtype), k_smem.at[slot], (tile, head_dim), stage)
        refill(j, slot)
        return dq

    zeros = plgpu.layout_cast(jnp.zeros((tile, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dq = lax.fori_loop(0, count, step, zeros)
    q_smem[...] = (dq * static.sm_scale).astype(q_smem.dtype)  # q_smem now holds dq
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_gmem.at[q_tile])
    plgpu.wait_smem_to_gmem(0)


def _dkdv_kernel(cols_gmem, k_gmem, v_gmem, q_gmem, do_gmem, lse_gmem, delta_gmem, dk_gmem,
                 dv_gmem, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, tile_bar,
                 q_bar, do_bar, vec_bar, stage=None, *, static: _Static):
    block, tile, stages = static.config
    head_dim = k_smem.shape[-1]
    at = _place(static)  # `start` is the first key row; `entry` the layout column
    k_tile = (at.batch, pl.ds(at.start, tile), at.head)
    plgpu.copy_gmem_to_smem(k_gmem.at[k_tile], k_smem, tile_bar.at[0])
    plgpu.copy_gmem_to_smem(v_gmem.at[k_tile], v_smem, tile_bar.at[1])

    def copies(query_block, slot):
        queries = (at.batch, pl.ds(query_block * block, block), at.head)
        vec = (at.batch, at.head, pl.ds(query_block * block, block))
        plgpu.copy_gmem_to_smem(q_gmem.at[queries], q_smem.at[slot], q_bar.at[slot])
        plgpu.copy_gmem_to_smem(do_gmem.at[queries], do_smem.at[slot], do_bar.at[slot])
        plgpu.copy_gmem_to_smem(lse_gmem.at[vec], lse_smem.at[slot], vec_bar.at[2 * slot])
        plgpu.copy_gmem_to_smem(delta_gmem.at[vec], delta_smem.at[slot], vec_bar.at[2 * slot + 1])

    count, block_of, refill = _ring(cols_gmem, at, static, copies)
    plgpu.barrier_wait(tile_bar.at[0])
    plgpu.barrier_wait(tile_bar.at[1])

    def step(j, carry):
        dk, dv = carry
        slot = _slot(j, stages)
        plgpu.barrier_wait(q_bar.at[slot])
        plgpu.barrier_wait(vec_bar.at[2 * slot])
        plgpu.barrier_wait(vec_bar.at[2 * slot + 1])
        s_t = _matmul(k_smem, q_smem.at[slot].transpose((1, 0)), (tile, block))  # [keys, queries]
        s_t = _logits(s_t, block_of(j) * block, at.start, transposed=True, static=static)
        lse = plgpu.load(lse_smem.at[slot], layout=_COL)
        p_t = jnp.exp2(s_t - _cols(lse, s_t.shape))
        plgpu.barrier_wait(do_bar.at[slot])
        dv = dv + _matmul(p_t.astype(do_smem.dtype), do_smem.at[slot], (tile, head_dim),
                          stage)
        dp_t = _matmul(v_smem, do_smem.at[slot].transpose((1, 0)), (tile, block))
        delta = plgpu.load(delta_smem.at[slot], layout=_COL)
        ds_t = p_t * (dp_t - _cols(delta, dp_t.shape))
        dk = dk + _matmul(ds_t.astype(q_smem.dtype), q_smem.at[slot], (tile, head_dim),
                          stage)
        refill(j, slot)
        return dk, dv

    zeros = plgpu.layout_cast(jnp.zeros((tile, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dk, dv = lax.fori_loop(0, count, step, (zeros, zeros))
    k_smem[...] = (dk * static.sm_scale).astype(k_smem.dtype)  # k_smem, v_smem now hold dk, dv
    v_smem[...] = dv.astype(v_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_gmem.at[k_tile])
    plgpu.copy_smem_to_gmem(v_smem, dv_gmem.at[k_tile])
    plgpu.wait_smem_to_gmem(0)


# ---- launches -----------------------------------------------------------------------------------


def _launch(body, out_type, scratch, static: _Static, q, kernel: str):
    batch, seq_len, heads, _ = q.shape
    if static.interpret is not None:  # a buffer for the register operand of wgmma (_matmul)
        scratch = (*scratch, _smem((static.config.tile, static.config.block), q.dtype))
    return plgpu.kernel(
        functools.partial(body, static=static),
        out_type=out_type,
        scratch_types=scratch,
        grid=(seq_len // static.config.tile, heads, batch),
        grid_names=_GRID,
        compiler_params=plgpu.CompilerParams(),
        interpret=static.interpret,
        **({"cost_estimate": _cost(kernel, q, static)} if _TAKES_COST else {}),
    )


def _forward(q, k, v, rows, static: _Static):
    batch, seq_len, heads, head_dim = q.shape
    block, tile, stages = static.config
    scratch = (
        _smem((tile, head_dim), q.dtype),
        _smem((stages, block, head_dim), q.dtype),
        _smem((stages, block, head_dim), q.dtype),
        plgpu.SMEM((tile,), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
    )
    out_type = (out_like((q, k, v), q.shape, q.dtype),
                out_like((q, k, v), (batch, heads, seq_len), jnp.float32))  # lse, base 2
    return _launch(_forward_kernel, out_type, scratch, static, q, "forward")(rows, q, k, v)


def _backward(q, k, v, rows, cols, o, lse, do, static: _Static):
    _, _, _, head_dim = q.shape
    block, tile, stages = static.config
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    operand = functools.partial(_smem, dtype=q.dtype)
    dq_scratch = (
        operand((tile, head_dim)), operand((tile, head_dim)),
        plgpu.SMEM((tile,), jnp.float32), plgpu.SMEM((tile,), jnp.float32),
        operand((stages, block, head_dim)), operand((stages, block, head_dim)),
        plgpu.Barrier(num_barriers=4), plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
    )
    dq = _launch(_dq_kernel, out_like((q, k, v, do), q.shape, q.dtype), dq_scratch, static, q,
                 "dq")(rows, q, k, v, do, lse, delta)
    dkdv_scratch = (
        operand((tile, head_dim)), operand((tile, head_dim)),
        operand((stages, block, head_dim)), operand((stages, block, head_dim)),
        plgpu.SMEM((stages, block), jnp.float32), plgpu.SMEM((stages, block), jnp.float32),
        plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=2 * stages),
    )
    out = out_like((q, k, v, do), k.shape, k.dtype)
    dk, dv = _launch(_dkdv_kernel, (out, out), dkdv_scratch, static, q, "dkdv")(
        cols, k, v, q, do, lse, delta)
    return dq, dk, dv


_attention = differentiable(_forward, _backward)


def attention(q, k, v, blocks: np.ndarray, *, causal: bool, sm_scale: float, interpret=None,
              config: Config | None = None, smem_limit: int = HOPPER_SMEM_LIMIT):
    """Softmax attention restricted to a block layout, as Mosaic GPU kernels (differentiable).

    Args:
      q, k, v: `[batch, seq, heads, head_dim]`, one dtype (fp32, bf16 or fp16).
      blocks: bool `[layout_heads, nb, nb]` from `check_layout` (causal already applied),
        `layout_heads` 1 or `heads`; the block size is `seq // nb`.
      causal: also mask keys after the query inside the diagonal blocks.
      sm_scale: logit scale.
      interpret: None to compile for the GPU, or a `plgpu.InterpretGPUParams` to run in GPU
        interpret mode (on CPU).
      config: the tiling, for this layout's block; default `auto_config(block, head_dim,
        dtype)`.
      smem_limit: the target GPU's shared memory per block (opt-in), checked before launch.

    Returns:
      `[batch, seq, heads, head_dim]` in `q`'s dtype.

    Raises:
      ValueError: in one line, for shapes or dtypes outside `supports`, a config for another
        block or whose tile does not divide it, or one that needs more than `smem_limit` bytes
        of shared memory.
    """
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape or not q.dtype == k.dtype == v.dtype:
        raise ValueError(
            f"q, k and v must have one shape [batch, seq, heads, head_dim] and one dtype, got "
            f"q {q.shape} {q.dtype}, k {k.shape} {k.dtype}, v {v.shape} {v.dtype}"
        )
    _, seq_len, heads, head_dim = q.shape
    blocks = np.asarray(blocks, bool)
    if blocks.ndim != 3 or blocks.shape[0] not in (1, heads) or seq_len % blocks.shape[1]:
        raise ValueError(
            f"blocks must be bool [1 or {heads}, nb, nb] with seq_len {seq_len} a multiple of "
            f"nb, got shape {blocks.shape}"
        )
    block = seq_len // blocks.shape[1]
    if not supports(block, head_dim, q.dtype):
        raise ValueError(_unsupported(block, head_dim, q.dtype))
    config = auto_config(block, head_dim, q.dtype) if config is None else Config(*config)
    if config.block != block or config.tile % 64 or block % config.tile or config.stages < 1:
        raise ValueError(
            f"config must be for block {block} (seq_len {seq_len} / {blocks.shape[1]} blocks), "
            f"with a tile that is a multiple of 64 dividing it and stages >= 1, got {config}"
        )
    check_fits(config, head_dim, q.dtype, smem_limit)
    if blocks.shape[0] > 1 and (blocks == blocks[:1]).all():
        blocks = blocks[:1]
    set_blocks = int(blocks.sum()) * (heads if blocks.shape[0] == 1 else 1)
    static = _Static(config, bool(causal), float(sm_scale), blocks.shape[0] == 1,
                     interpret, set_blocks)
    rows, cols = (jnp.asarray(t) for t in layout_tables(blocks))
    dtype = _kernel_dtype(q.dtype)
    out = _attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), rows, cols, static)
    return out.astype(q.dtype)
