"""Block-sparse flash attention in Pallas: forward, dq and dk/dv kernels over a block layout.

A layout `[layout_heads, nb, nb]` of 0/1 says which `block x block` tiles of the attention
matrix are computed (DeepSpeed Sparse Attention, Child et al. 2019). It is compressed once, on
the host, into index tables:
  - rows `[layout_heads, nb, 1 + max_row]`: per query block, its key-block count, then the key
    blocks in ascending order (padded by repeating the last one);
  - cols `[layout_heads, nb, 1 + max_col]`: the transposed layout, per key block the query
    blocks that attend to it.
The forward kernel runs FlashAttention-2's online softmax (Dao 2023, Alg. 1) over a query
block's row; the backward recomputes the probabilities from the saved log-sum-exp, dq over the
rows and dk/dv over the columns, so no kernel ever touches a zero block. The kernels follow
jax's `jax.experimental.pallas.ops.gpu.attention` and use only what the Triton lowering
supports (whole-block loads, `pl.ds` slices, scalar table loads, `lax.fori_loop` with a dynamic
trip count), so the same source runs with `interpret=True` on CPU and compiles for NVIDIA GPUs.
On Hopper (sm_90) and newer, `block_sparse_attention` runs the Mosaic GPU kernels of
`block_sparse_attention_mgpu` instead (TMA, a pipelined ring of key blocks, wgmma): JAX
deprecates its Triton backend, which jaxspeed keeps for older GPUs (A100) while JAX has it.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as _backend
from pallas_kernels._shapes import out_like
from pallas_kernels._sparse_shared import MASK_VALUE, differentiable, layout_tables

_LOG2E = math.log2(math.e)


def check_layout(layout, *, num_heads: int, seq_len: int, causal: bool) -> np.ndarray:
    """Validates a block layout against `q` and returns the blocks that are computed.

    Args:
      layout: 0/1 array `[layout_heads, nb, nb]`, `layout_heads` 1 (shared) or `num_heads`.
        Must be concrete (numpy or a non-traced jax array): the tables are built on the host.
      num_heads: heads of `q`.
      seq_len: sequence length of `q`; the block size is `seq_len // nb`.
      causal: whether the causal mask applies; blocks above the diagonal are then dropped.

    Returns:
      bool `[layout_heads, nb, nb]`, with the blocks above the diagonal cleared when `causal`.

    Raises:
      ValueError: naming the problem: a traced layout, wrong rank or shape, a head count that
        is neither 1 nor `num_heads`, a `seq_len` not divisible into `nb` blocks, values other
        than 0/1, or a query block with no key blocks.
    """
    if isinstance(layout, jax.core.Tracer):
        raise ValueError(
            "layout must be a concrete array (numpy, or a jax array outside jit), got a traced "
            "value: build the layout once, outside the jitted function, and close over it"
        )
    layout = np.asarray(layout)
    if layout.ndim != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(
            f"layout must have shape [heads, nb, nb] (square in its last two dims), got shape "
            f"{layout.shape}"
        )
    heads, nb, _ = layout.shape
    if heads not in (1, num_heads):
        raise ValueError(
            f"layout has {heads} heads but q has {num_heads}: the layout's head count must be "
            f"1 (one layout for every head) or {num_heads}"
        )
    if nb == 0 or seq_len % nb:
        raise ValueError(
            f"seq_len {seq_len} is not divisible into the layout's {nb} blocks: the block size "
            f"is seq_len / nb, so seq_len must be a multiple of nb"
        )
    if not np.isin(layout, (0, 1)).all():
        raise ValueError(
            f"layout must hold only 0 and 1, got values {np.unique(layout)[:8].tolist()}"
        )
    blocks = layout.astype(bool)
    if causal:
        blocks = blocks & np.tril(np.ones((nb, nb), bool))
    empty = np.argwhere(~blocks.any(axis=-1))
    if empty.size:
        head, row = (int(x) for x in empty[0])
        why = " on or below the diagonal (causal=True drops the others)" if causal else ""
        raise ValueError(
            f"layout head {head}, query block {row} has no key blocks{why}: every query "
            f"block needs at least one key block ({len(empty)} empty rows in all)"
        )
    return blocks


class _Static(NamedTuple):
    """The hashable, trace-time settings of one call."""

    block: int
    causal: bool
    sm_scale: float
    shared_layout: bool  # one layout for every head
    interpret: bool


def _dot(a, b, *, contract: tuple[int, int]):
    """2-D matmul in fp32 contracting `a`'s dim `contract[0]` with `b`'s `contract[1]`."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _logits(q, k, q_start, k_start, static: _Static):
    """Scaled logits in the base-2 domain, `[block_q, block_k]`, causally masked."""
    s = _dot(q, k, contract=(1, 1)) * (static.sm_scale * _LOG2E)
    if static.causal:
        # Only the diagonal block is partly masked; the mask is all-true below it.
        span_q = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
        span_k = k_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(span_q >= span_k, s, MASK_VALUE)
    return s


def _forward_kernel(rows_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, static: _Static):
    block = static.block
    q_start = pl.program_id(0) * block
    q = q_ref[...]
    m = jnp.full((block,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block,), jnp.float32)
    acc = jnp.zeros(q.shape, jnp.float32)

    def body(j, carry):
        acc, m, l = carry
        k_start = rows_ref[j + 1] * block
        k = k_ref[pl.ds(k_start, block), :]
        v = v_ref[pl.ds(k_start, block), :]
        s = _logits(q, k, q_start, k_start, static)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp2(m - m_next)
        p = jnp.exp2(s - m_next[:, None])
        l = correction * l + jnp.sum(p, axis=1)
        acc = correction[:, None] * acc + _dot(p.astype(v.dtype), v, contract=(1, 0))
        return acc, m_next, l

    acc, m, l = lax.fori_loop(0, rows_ref[0], body, (acc, m, l))
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _dq_kernel(rows_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               static: _Static):
    block = static.block
    q_start = pl.program_id(0) * block
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(j, dq):
        k_start = rows_ref[j + 1] * block
        k = k_ref[pl.ds(k_start, block), :]
        v = v_ref[pl.ds(k_start, block), :]
        p = jnp.exp2(_logits(q, k, q_start, k_start, static) - lse[:, None])
        ds = p * (_dot(do, v, contract=(1, 1)) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k, contract=(1, 0))

    dq = lax.fori_loop(0, rows_ref[0], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * static.sm_scale).astype(dq_ref.dtype)


def _dkdv_kernel(cols_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                 static: _Static):
    block = static.block
    k_start = pl.program_id(0) * block
    k, v = k_ref[...], v_ref[...]

    def body(j, carry):
        dk, dv = carry
        q_start = cols_ref[j + 1] * block
        rows = pl.ds(q_start, block)
        q, do = q_ref[rows, :], do_ref[rows, :]
        lse, delta = lse_ref[rows], delta_ref[rows]
        p = jnp.exp2(_logits(q, k, q_start, k_start, static) - lse[:, None])
        dv = dv + _dot(p.astype(do.dtype), do, contract=(0, 0))
        ds = p * (_dot(do, v, contract=(1, 1)) - delta[:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, contract=(0, 0))
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, cols_ref[0], body, (zeros, zeros))
    dk_ref[...] = (dk * static.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(static: _Static, seq_len: int, head_dim: int):
    """BlockSpecs over the grid `(block index, batch, head)` for `[batch, seq, heads, dim]`."""
    block = static.block
    tile = pl.BlockSpec((None, block, None, head_dim), lambda i, b, h: (b, i, h, 0))
    full = pl.BlockSpec((None, seq_len, None, head_dim), lambda i, b, h: (b, 0, h, 0))
    vec_tile = pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i))
    vec_full = pl.BlockSpec((None, None, seq_len), lambda i, b, h: (b, h, 0))

    def table(width):
        if static.shared_layout:
            return pl.BlockSpec((None, None, width), lambda i, b, h: (0, i, 0))
        return pl.BlockSpec((None, None, width), lambda i, b, h: (h, i, 0))

    return tile, full, vec_tile, vec_full, table


def _compiler_params(head_dim: int, block: int):
    warps = 4 if head_dim <= 64 and block <= 64 else 8
    return plgpu.CompilerParams(num_warps=warps, num_stages=2)


def _forward(q, k, v, rows, static: _Static):
    batch, seq_len, heads, head_dim = q.shape
    tile, full, vec_tile, _, table = _specs(static, seq_len, head_dim)
    return pl.pallas_call(
        functools.partial(_forward_kernel, static=static),
        grid=(seq_len // static.block, batch, heads),
        in_specs=[table(rows.shape[-1]), tile, full, full],
        out_specs=[tile, vec_tile],
        out_shape=[
            out_like((q, k, v), q.shape, q.dtype),
            out_like((q, k, v), (batch, heads, seq_len), jnp.float32),  # lse, base 2
        ],
        compiler_params=_compiler_params(head_dim, static.block),
        interpret=static.interpret,
        name="block_sparse_attention_fwd",
    )(rows, q, k, v)


def _backward(q, k, v, rows, cols, o, lse, do, static: _Static):
    batch, seq_len, heads, head_dim = q.shape
    tile, full, vec_tile, vec_full, table = _specs(static, seq_len, head_dim)
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    grid = (seq_len // static.block, batch, heads)
    params = _compiler_params(head_dim, static.block)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, static=static),
        grid=grid,
        in_specs=[table(rows.shape[-1]), tile, full, full, tile, vec_tile, vec_tile],
        out_specs=tile,
        out_shape=out_like((q, k, v, do), q.shape, q.dtype),
        compiler_params=params,
        interpret=static.interpret,
        name="block_sparse_attention_dq",
    )(rows, q, k, v, do, lse, delta)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, static=static),
        grid=grid,
        in_specs=[table(cols.shape[-1]), tile, tile, full, full, vec_full, vec_full],
        out_specs=[tile, tile],
        out_shape=[out_like((q, k, v, do), k.shape, k.dtype),
                   out_like((q, k, v, do), v.shape, v.dtype)],
        compiler_params=params,
        interpret=static.interpret,
        name="block_sparse_attention_dkdv",
    )(cols, k, v, q, do, lse, delta)
    return dq, dk, dv


_attention = differentiable(_forward, _backward)


def block_sparse_attention(q, k, v, layout, *, causal: bool = False,
                           sm_scale: float | None = None, interpret=None,
                           backend: str | None = None):
    """Softmax attention restricted to a block layout, as Pallas kernels (differentiable).

    Args:
      q, k, v: `[batch, seq, heads, head_dim]`, one dtype (fp32, bf16 or fp16).
      layout: 0/1 `[layout_heads, nb, nb]` with `layout_heads` 1 or `heads`, concrete (it is
        compressed into index tables on the host); the block size is `seq // nb`.
      causal: also mask keys after the query (inside the diagonal blocks; blocks above the
        diagonal are skipped).
      sm_scale: logit scale; default `1 / sqrt(head_dim)`.
      interpret: run the kernels interpreted; default: when not compiling for a GPU (see
        `_backend.resolve`; an `InterpretGPUParams` runs the Mosaic GPU kernels interpreted).
      backend: "mosaic_gpu" or "triton"; default: from the device compiled for (Mosaic GPU
        on sm_90 and newer, `block_sparse_attention_mgpu`, which takes blocks and head dims of
        64 or 128 and refuses others in one line; Triton on older GPUs; the Triton-form
        kernels interpreted on CPU). `backend="triton"` still runs the Triton kernel on sm_90
        while JAX has it; `jaxspeed.attention`'s `impl="auto"` takes its XLA path there for
        the sizes the Mosaic kernel does not take.

    Returns:
      `[batch, seq, heads, head_dim]` in `q`'s dtype; fp32 accumulation inside.

    Raises:
      ValueError: bad shapes or layout, or (Mosaic GPU) a block / head dim it does not take,
        or a tiling over the GPU's shared memory.
    """
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k and v must have one shape [batch, seq, heads, head_dim], got q {q.shape}, "
            f"k {k.shape}, v {v.shape}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _, seq_len, heads, head_dim = q.shape
    blocks = check_layout(layout, num_heads=heads, seq_len=seq_len, causal=causal)
    if blocks.shape[0] > 1 and (blocks == blocks[:1]).all():
        blocks = blocks[:1]
    block = seq_len // blocks.shape[1]
    scale = float(1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale)
    family, interpret = _backend.resolve(backend, interpret)
    if family == _backend.MOSAIC_GPU:
        from pallas_kernels import block_sparse_attention_mgpu

        return block_sparse_attention_mgpu.attention(q, k, v, blocks, causal=causal,
                                                     sm_scale=scale, interpret=interpret)
    if not interpret and (block < 16 or block & (block - 1)):
        raise ValueError(
            f"the compiled (Triton) kernel needs a block size that is a power of 2 and >= 16, "
            f"got seq_len {seq_len} / {blocks.shape[1]} blocks = {block}"
        )
    static = _Static(block, bool(causal), scale, blocks.shape[0] == 1, bool(interpret))
    rows, cols = (jnp.asarray(t) for t in layout_tables(blocks))
    # Triton tiles need power-of-2 sizes of at least 16; zero columns change nothing.
    padded = max(16, pl.next_power_of_2(head_dim))
    if padded != head_dim:
        pad = ((0, 0),) * 3 + ((0, padded - head_dim),)
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    out = _attention(q, k, v, rows, cols, static)
    return out[..., :head_dim]
