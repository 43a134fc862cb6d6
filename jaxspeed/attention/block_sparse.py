"""Block-sparse attention: one entry point over the Pallas kernel and a gather-based XLA path.

The XLA path (`impl="xla"`) compresses the layout on the host, once per layout, into rows: a
row is one query block of one head with the list of its key blocks. Rows are sorted by their
key-block count and split into a few groups (at most `_MAX_GROUPS`); each group gathers its
rows' key and value blocks, padded to the group's longest row and masked, and runs a plain
masked softmax over them. Grouping keeps the padding small where rows differ a lot in length:
a unidirectional Fixed layout's longest row is about twice its mean, and one group padded to it
ran about twice as slow. Gradients are plain autodiff (the gathers transpose to scatter-adds).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspeed.attention.blocked import blocked_attention
from jaxspeed.options.attention import SPARSE_IMPLS as IMPLS
from pallas_kernels.backend import MOSAIC_GPU, kernel_backend, on_gpu
from pallas_kernels.block_sparse_attention import block_sparse_attention as _pallas_attention
from pallas_kernels.block_sparse_attention import check_layout

_MAX_GROUPS = 8  # measured on CPU at seq 2048-8192: 1 -> 8 groups halved the step time
_GROUP_COST = 2**14  # logits per batch and head that one more group must save


def block_sparse_attention(q, k, v, layout, *, causal: bool = False,
                           sm_scale: float | None = None, impl: str = "auto"):
    """Softmax attention restricted to a block layout (plus the causal mask), differentiable.

    Args:
      q, k, v: `[batch, seq, heads, head_dim]` (the layout of `jax.nn.dot_product_attention`).
      layout: 0/1 `[layout_heads, nb, nb]`, `layout_heads` 1 (shared) or `heads`, concrete:
        build it once (e.g. `FixedSparsityConfig(...).make_layout(seq)`) outside `jit`.
        Block `(i, j)` set means query block `i` attends to key block `j`; block = seq // nb.
      causal: also mask keys after the query.
      sm_scale: logit scale; default `1 / sqrt(head_dim)`.
      impl: `"pallas"` (the kernel; interpreted off GPU), `"xla"` (gather-based: every set
        block at once, memory growing with their count), `"blocked"` (the set blocks one at a
        time with an online softmax, `jaxspeed.attention.blocked_attention`: O(seq * block)
        memory; one layout shared by all heads) or `"auto"` (pallas when compiling for a GPU
        whose kernel takes the shape, xla otherwise).

    Returns:
      `[batch, seq, heads, head_dim]` in `q`'s dtype.

    Raises:
      ValueError: a bad `impl`, mismatched q/k/v, or a bad layout (see `check_layout`).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "pallas" if on_gpu() and _kernel_takes(q, layout) else "xla"
    if impl == "pallas":
        return _pallas_attention(q, k, v, layout, causal=causal, sm_scale=sm_scale)
    _check_qkv(q, k, v)
    _, seq_len, heads, head_dim = q.shape
    blocks = check_layout(layout, num_heads=heads, seq_len=seq_len, causal=causal)
    if impl == "blocked":
        if not (blocks == blocks[:1]).all():
            raise ValueError(
                "impl='blocked' needs one layout shared by every head "
                "(different_layout_per_head: false); use impl='xla'")
        block = seq_len // blocks.shape[1]
        return blocked_attention(q, k, v, causal=causal, sm_scale=sm_scale, block_q=block,
                                 block_kv=block, layout=blocks[0])
    scale = float(1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale)
    plan = _plan(blocks.tobytes(), blocks.shape, bool(causal), seq_len // blocks.shape[1])
    return _xla_attention(q, k, v, plan, scale)


#: Layout blocks `causal_attention` takes, largest first (the Mosaic GPU kernel's: 128, 64).
CAUSAL_BLOCKS = (128, 64)


def causal_attention(q, k, v, *, impl: str = "auto"):
    """Dense causal attention as block-sparse attention over the lower-triangular layout of
    the largest block in `CAUSAL_BLOCKS` dividing the sequence: on a GPU the Pallas kernel
    (FlashAttention-2; the blocks above the diagonal skipped, the diagonal ones masked),
    elsewhere (or for a shape the kernel does not take) the XLA path, as `impl` says.

    Raises:
      ValueError: a sequence that no block in `CAUSAL_BLOCKS` divides.
    """
    seq_len = q.shape[1]
    block = next((b for b in CAUSAL_BLOCKS if seq_len % b == 0), None)
    if block is None:
        raise ValueError(f"sequence length {seq_len} is not a multiple of any of {CAUSAL_BLOCKS}")
    blocks = seq_len // block
    layout = np.tril(np.ones((1, blocks, blocks), np.int32))
    return block_sparse_attention(q, k, v, layout, causal=True, impl=impl)


def _kernel_takes(q, layout) -> bool:
    """Whether the kernel for the device compiled for takes this call: on sm_90 and newer the
    Mosaic GPU kernel takes blocks and head dims of 64 or 128 in 16-bit dtypes (it would round
    fp32 to bf16; the XLA path keeps fp32); the Triton one takes any."""
    if kernel_backend() != MOSAIC_GPU:
        return True
    from pallas_kernels.block_sparse_attention_mgpu import supports

    _, seq_len, _, head_dim = q.shape
    nb = np.shape(layout)[-1]
    sixteen_bit = jnp.dtype(q.dtype).itemsize == 2
    return sixteen_bit and nb > 0 and seq_len % nb == 0 and supports(seq_len // nb, head_dim, q.dtype)


def dense_reference(q, k, v, layout, *, causal: bool = False, sm_scale: float | None = None):
    """The same attention written plainly: a dense masked softmax over the expanded layout.

    Args:
      q, k, v: `[batch, seq, heads, head_dim]`.
      layout: 0/1 `[layout_heads, nb, nb]`, `layout_heads` 1 or `heads`.
      causal: also mask keys after the query.
      sm_scale: logit scale; default `1 / sqrt(head_dim)`.

    Returns:
      `[batch, seq, heads, head_dim]` in `q`'s dtype (computed in fp32).
    """
    _check_qkv(q, k, v)
    _, seq_len, heads, head_dim = q.shape
    mask = expand_layout(layout, seq_len=seq_len, causal=causal)  # [layout_heads, seq, seq]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    f32 = jnp.float32
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(f32), k.astype(f32)) * scale
    logits = jnp.where(mask[None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(f32)).astype(q.dtype)


def expand_layout(layout, *, seq_len: int, causal: bool = False) -> np.ndarray:
    """The token mask of a block layout: bool `[layout_heads, seq_len, seq_len]`."""
    layout = np.asarray(layout).astype(bool)
    block = seq_len // layout.shape[-1]
    mask = np.repeat(np.repeat(layout, block, axis=1), block, axis=2)
    return mask & np.tril(np.ones((seq_len, seq_len), bool)) if causal else mask


def _check_qkv(q, k, v) -> None:
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k and v must have one shape [batch, seq, heads, head_dim], got q {q.shape}, "
            f"k {k.shape}, v {v.shape}"
        )


# ---- the XLA path -----------------------------------------------------------------------------


class _Plan(NamedTuple):
    """Host-side tables of one layout: rows grouped by key count (all numpy).

    Attributes:
      layout_heads: 1 when every head shares the layout (heads then act as batch), else heads.
      num_blocks: `nb`.
      causal: whether the diagonal blocks are causally masked.
      order: `[rows]` the rows (layout head * nb + query block) in group order.
      inverse: `[rows]` each row's position in `order`.
      keys: per group `[n, width]` int32, the rows' key rows; padding repeats the last key, so
        the gather stays in range and the mask hides it.
      valid: per group `[n, width]` bool, not padding.
      diagonal: per group `[n, width]` bool, the key block is the row's own (causal mask).
    """

    layout_heads: int
    num_blocks: int
    causal: bool
    order: np.ndarray
    inverse: np.ndarray
    keys: tuple[np.ndarray, ...]
    valid: tuple[np.ndarray, ...]
    diagonal: tuple[np.ndarray, ...]


@functools.lru_cache(maxsize=64)
def _plan(layout_bytes: bytes, shape: tuple[int, int, int], causal: bool, block: int) -> _Plan:
    """Groups the rows of a validated bool layout; cached by value (models call it per trace)."""
    blocks = np.frombuffer(layout_bytes, dtype=bool).reshape(shape)
    heads, nb, _ = shape
    if heads > 1 and (blocks == blocks[:1]).all():
        heads, blocks = 1, blocks[:1]
    flat = blocks.reshape(heads * nb, nb)
    counts = flat.sum(axis=1)
    order = np.argsort(counts, kind="stable")
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    keys, valid, diagonal, start = [], [], [], 0
    for stop in _split_points(counts[order], block=block):
        rows = order[start:stop]
        width = int(counts[rows].max())
        index = np.zeros((rows.size, width), np.int32)
        for n, row in enumerate(rows):
            cols = np.flatnonzero(flat[row]) + row // nb * nb  # head h's rows read head h's keys
            index[n] = cols[-1]
            index[n, : cols.size] = cols
        keys.append(index)
        valid.append(np.arange(width) < counts[rows][:, None])
        diagonal.append(valid[-1] & (index == rows[:, None]))
        start = stop
    return _Plan(heads, nb, causal, order.astype(np.int32), inverse.astype(np.int32),
                 tuple(keys), tuple(valid), tuple(diagonal))


def _split_points(sorted_counts: np.ndarray, *, block: int) -> list[int]:
    """Ends of up to `_MAX_GROUPS` runs of sorted row counts, trading padding against groups.

    The padded work of a run is its length times its largest count. Each run also costs a
    gather, two matmuls and a softmax of its own, to compile and to run: here as much as
    `_GROUP_COST` logits or 1% of the work of a single run, whichever is more. Dynamic
    programming over the distinct counts finds the cheapest split.
    """
    values, repeats = np.unique(sorted_counts, return_counts=True)
    ends = np.concatenate([[0], np.cumsum(repeats)])  # ends[j]: rows with count <= values[j-1]
    u = len(values)
    best = np.full((_MAX_GROUPS + 1, u + 1), np.inf)
    best[0, 0] = 0.0
    back = np.zeros((_MAX_GROUPS + 1, u + 1), np.int64)
    for g in range(1, _MAX_GROUPS + 1):  # best[g, j]: g runs covering the first j counts
        for j in range(1, u + 1):
            cost = best[g - 1, :j] + (ends[j] - ends[:j]) * values[j - 1]
            back[g, j] = int(np.argmin(cost))
            best[g, j] = cost[back[g, j]]
    group_cost = max(0.01 * best[1, u], _GROUP_COST / block**2)  # in blocks
    g = 1 + int(np.argmin(best[1:, u] + group_cost * np.arange(1, _MAX_GROUPS + 1)))
    cuts, j = [], u
    while j > 0:
        cuts.append(int(ends[j]))
        j, g = int(back[g, j]), g - 1
    return cuts[::-1]


def _to_rows(x, plan: _Plan):
    """`[batch, seq, heads, d]` -> `[batch * heads / layout_heads, layout_heads * nb, block, d]`."""
    b, s, h, d = x.shape
    nb = plan.num_blocks
    x = x.reshape(b, nb, s // nb, h, d).transpose(0, 3, 1, 2, 4)
    return x.reshape(b * h // plan.layout_heads, plan.layout_heads * nb, s // nb, d)


def _from_rows(x, shape):
    """Inverse of `_to_rows`."""
    b, s, h, d = shape
    block = x.shape[2]
    x = x.reshape(b, h, s // block, block, d).transpose(0, 2, 3, 1, 4)
    return x.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _permute_rows(x, perm: np.ndarray, inverse: np.ndarray):
    """`x[:, perm]` for a permutation `perm` of axis 1; transposed by a gather, not a scatter."""
    return jnp.take(x, perm, axis=1)


def _permute_rows_fwd(x, perm, inverse):
    return _permute_rows(x, perm, inverse), None


def _permute_rows_bwd(perm, inverse, _, g):
    return (jnp.take(g, inverse, axis=1),)


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _group_attention(q, k, v, valid: np.ndarray, diagonal: np.ndarray, *, causal: bool,
                     scale: float):
    """One row group's attention, `[B, n, block, d]`.

    Args:
      q: `[B, n, block, d]`, the group's query blocks.
      k, v: `[B, n, width, block, d]`, their gathered key and value blocks.
      valid, diagonal: `[n, width]` (see `_Plan`).
      causal: mask keys after the query inside the diagonal blocks.
      scale: logit scale.
    """
    f32 = jnp.float32
    s = jnp.einsum("bnqd,bnwkd->bnqwk", q, k, preferred_element_type=f32) * scale
    block = q.shape[2]
    mask = jnp.asarray(valid)[:, None, :, None]
    if causal:
        tril = jnp.tril(jnp.ones((block, block), bool))[None, :, None, :]
        mask = mask & (~jnp.asarray(diagonal)[:, None, :, None] | tril)
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=(3, 4))
    return jnp.einsum("bnqwk,bnwkd->bnqd", p.astype(v.dtype), v, preferred_element_type=f32)


def _xla_attention(q, k, v, plan: _Plan, scale: float):
    q_rows, k_rows, v_rows = (_to_rows(x, plan) for x in (q, k, v))
    sizes = np.cumsum([len(index) for index in plan.keys])[:-1]
    q_groups = jnp.split(_permute_rows(q_rows, plan.order, plan.inverse), sizes, axis=1)
    outs = [
        _group_attention(q_group, jnp.take(k_rows, index, axis=1),
                         jnp.take(v_rows, index, axis=1), valid, diagonal,
                         causal=plan.causal, scale=scale)
        for q_group, index, valid, diagonal in zip(q_groups, plan.keys, plan.valid, plan.diagonal)
    ]
    out = jnp.concatenate(outs, axis=1).astype(q.dtype)
    return _from_rows(_permute_rows(out, plan.inverse, plan.order), q.shape)
