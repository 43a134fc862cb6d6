"""Exact softmax attention block by block, in O(length * block) memory, in plain JAX.

FlashAttention's algorithm (Dao et al. 2022; the loop order of FlashAttention-2, Dao 2023):
the forward pass runs over query blocks, and for each over the key/value blocks with an online
softmax (a running row max `m`, row sum `l` and fp32 accumulator, rescaled as the max grows),
so no `[length, length]` score matrix exists. It keeps only the output and each row's
logsumexp. The backward pass (`jax.custom_vjp`) recomputes each block's probabilities from the
logsumexp: an outer loop over key/value blocks accumulates that block's dk and dv, an inner
loop over query blocks adds into dq. Under the causal mask, blocks above the diagonal are
skipped (the inner loops' bounds depend on the outer index).

Lengths that are not a multiple of the block are padded; padded keys are masked, padded query
rows are dropped. Blocks larger than the sequence shrink to it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspeed.sharding.vma import vary_alike

Array = jax.Array
_F32 = jnp.float32


def blocked_attention(
    q: Array, k: Array, v: Array, *, causal: bool = False, sm_scale: float | None = None,
    block_q: int = 512, block_kv: int = 512, segment_ids: Array | None = None,
    layout: np.ndarray | None = None,
) -> Array:
    """Softmax attention computed block by block (FlashAttention), differentiable.

    Args:
      q: `[batch, q_len, heads, head_dim]` (the layout of `jax.nn.dot_product_attention`).
      k, v: `[batch, kv_len, heads, head_dim]`.
      causal: mask keys after the query (query row i sees keys 0..i).
      sm_scale: logit scale; default `1 / sqrt(head_dim)`.
      block_q, block_kv: rows of q and of k/v per block (shrunk to the lengths when larger).
      segment_ids: int `[batch, length]` (self-attention, q_len == kv_len): a query sees
        only keys of its own segment (packed documents); None: one segment.
      layout: 0/1 `[num_q_blocks, num_kv_blocks]` (concrete): block-sparse attention, only
        the set blocks computed (and stored: memory stays O(length * block)); the blocks are
        then exactly `block_q` x `block_kv`, which must tile the lengths.

    Returns:
      `[batch, q_len, heads, head_dim]` in `v`'s dtype; softmax and sums in float32.

    Raises:
      ValueError: mismatched shapes or a non-positive block.
    """
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"expected q [batch, q_len, heads, head_dim] and k, v [batch, kv_len, heads, "
            f"head_dim]; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    for name, block in (("block_q", block_q), ("block_kv", block_kv)):
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"{name} must be a positive integer, got {block!r}")
    scale = float(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale)
    spec = _spec(q, k, causal=causal, scale=scale, block_q=block_q, block_kv=block_kv)
    if layout is not None:
        spec = spec._replace(sparse=_Layout.of(layout, spec))
    segments = None
    if segment_ids is not None:
        if q.shape[1] != k.shape[1] or segment_ids.shape != q.shape[:2]:
            raise ValueError(
                f"segment_ids must be [batch, length] {q.shape[:2]} for self-attention; got "
                f"{segment_ids.shape} with q {q.shape}, k {k.shape}")
        segments = _segment_blocks(segment_ids, spec)
    # Inside `shard_map` the loop carries (made `*_like` the inputs) and the cotangents must
    # have the inputs' varying axes: give all three the same ones.
    q, k, v = vary_alike(q, k, v)
    return _attention(spec, q, k, v, segments)


def _segment_blocks(segment_ids: Array, spec: _Spec) -> tuple[Array, Array]:
    """Segment ids blocked for queries `[num_q, batch, block_q]` and keys `[num_kv, batch,
    block_kv]`; padding gets ids no real row or key has (-1 and -2)."""
    def blocks(count, block, pad):
        b, length = segment_ids.shape
        x = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, count * block - length)),
                    constant_values=pad)
        return x.reshape(b, count, block).transpose(1, 0, 2)

    return (blocks(spec.num_q, spec.block_q, -1), blocks(spec.num_kv, spec.block_kv, -2))


def flash_forward(
    q: Array, k: Array, v: Array, *, causal: bool, scale: float, block_q: int, block_kv: int
) -> tuple[Array, Array]:
    """One block pair's part of an attention split over key shards (ring attention).

    Same arguments as `blocked_attention`, on arrays whose varying axes already agree.

    Returns:
      The output normalised over these keys only, `[batch, q_len, heads, head_dim]` float32,
      and each row's logsumexp `[batch, q_len, heads]` float32 (`-inf`: no key seen), from
      which parts over other keys merge exactly (`merge_parts`).
    """
    spec = _spec(q, k, causal=causal, scale=scale, block_q=block_q, block_kv=block_kv)
    out, lse = _forward(spec, q, k, v, out_dtype=_F32)
    rows = _lse_rows(lse, spec.q_len)
    return out, jnp.where(jnp.isfinite(rows), rows, -jnp.inf)


def flash_backward(
    q: Array, k: Array, v: Array, out: Array, lse: Array, d_out: Array, *, causal: bool,
    scale: float, block_q: int, block_kv: int,
) -> tuple[Array, Array, Array]:
    """float32 `dq, dk, dv` of one block pair, given the whole attention's `out` and row
    logsumexp `lse [batch, q_len, heads]` (over all keys; finite) and `d_out`."""
    spec = _spec(q, k, causal=causal, scale=scale, block_q=block_q, block_kv=block_kv)
    return _backward(spec, q, k, v, out, _lse_blocks(lse, spec), d_out)


def merge_parts(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Two parts of one softmax attention over disjoint key sets → the part over both.

    `out_*` are float32 `[batch, q_len, heads, head_dim]`, `lse_*` `[batch, q_len, heads]`
    with `-inf` for rows that saw no key.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight_a = jnp.exp(lse_a - safe)[..., None]
    weight_b = jnp.exp(lse_b - safe)[..., None]
    return weight_a * out_a + weight_b * out_b, lse


def _spec(q, k, *, causal, scale, block_q, block_kv) -> _Spec:
    return _Spec(
        q_len=q.shape[1], kv_len=k.shape[1], block_q=min(block_q, q.shape[1]),
        block_kv=min(block_kv, k.shape[1]), causal=bool(causal), scale=float(scale),
    )


def _lse_rows(lse: Array, q_len: int) -> Array:
    """Blocked logsumexp `[num_q, batch, heads, block_q]` → `[batch, q_len, heads]`."""
    num_q, b, h, block = lse.shape
    return lse.transpose(1, 0, 3, 2).reshape(b, num_q * block, h)[:, :q_len]


def _lse_blocks(rows: Array, spec: _Spec) -> Array:
    """`[batch, q_len, heads]` → blocked `[num_q, batch, heads, block_q]` (padding: +inf)."""
    b, length, h = rows.shape
    pad = spec.num_q * spec.block_q - length
    rows = jnp.pad(rows, ((0, 0), (0, pad), (0, 0)), constant_values=jnp.inf)
    return rows.reshape(b, spec.num_q, spec.block_q, h).transpose(1, 0, 3, 2)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A block-sparse layout (the causal mask applied), hashable: the bool mask's bytes."""

    mask: bytes
    shape: tuple[int, int]

    @staticmethod
    def of(layout: np.ndarray, spec: _Spec) -> _Layout:
        layout = np.asarray(layout).astype(bool)
        if layout.shape != (spec.num_q, spec.num_kv) or spec.q_len % spec.block_q or (
                spec.kv_len % spec.block_kv):
            raise ValueError(
                f"layout {layout.shape} must be [q_len / block_q, kv_len / block_kv] = "
                f"[{spec.q_len} / {spec.block_q}, {spec.kv_len} / {spec.block_kv}], the blocks "
                f"tiling the lengths")
        if spec.causal:
            q_last = (np.arange(spec.num_q) + 1) * spec.block_q - 1
            layout = layout & (np.arange(spec.num_kv)[None] * spec.block_kv <= q_last[:, None])
        return _Layout(layout.tobytes(), layout.shape)

    def table(self, which: str) -> tuple[Array, Array]:
        """`(counts [n], entries [n, max])` int32: for each query block (`rows`) its key
        blocks, or for each key block (`columns`) its query blocks, padded with 0."""
        counts, entries = _loop_table(self.mask, self.shape, which == "columns")
        return jnp.asarray(counts), jnp.asarray(entries)


@functools.lru_cache(maxsize=16)
def _loop_table(mask: bytes, shape: tuple[int, int], transpose: bool):
    layout = np.frombuffer(mask, bool).reshape(shape)
    layout = layout.T if transpose else layout
    counts = layout.sum(axis=1).astype(np.int32)
    # stable sort puts each row's set blocks first, in order
    entries = np.argsort(~layout, axis=1, kind="stable")[:, :max(1, int(counts.max()))]
    return counts, np.where(np.arange(entries.shape[1]) < counts[:, None], entries, 0).astype(
        np.int32)


class _Spec(NamedTuple):
    """The static facts of one call (hashable, for `nondiff_argnums`)."""

    q_len: int
    kv_len: int
    block_q: int
    block_kv: int
    causal: bool
    scale: float
    sparse: _Layout | None = None

    def kv_loop(self, i: Array):
        """Query block `i`'s key blocks: `(count, t -> j)` for a loop over `t < count`."""
        if self.sparse is not None:
            counts, entries = self.sparse.table("rows")
            return counts[i], lambda t: entries[i, t]
        return self.kv_blocks_for(i), lambda t: t

    def q_loop(self, j: Array):
        """Key block `j`'s query blocks: `(start, stop, t -> i)` for a loop over `t`."""
        if self.sparse is not None:
            counts, entries = self.sparse.table("columns")
            return jnp.int32(0), counts[j], lambda t: entries[j, t]
        return self.first_q_block_for(j), self.num_q, lambda t: t

    @property
    def num_q(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def num_kv(self) -> int:
        return -(-self.kv_len // self.block_kv)

    def kv_blocks_for(self, i: Array) -> Array:
        """Key blocks query block `i` sees: all, or (causal) up to the one holding its last row."""
        if not self.causal:
            return jnp.int32(self.num_kv)
        last_row = (i + 1) * self.block_q - 1
        return jnp.minimum(last_row // self.block_kv + 1, self.num_kv)

    def first_q_block_for(self, j: Array) -> Array:
        """First query block that sees key block `j`: 0, or (causal) the one holding its row."""
        return jnp.int32(0) if not self.causal else (j * self.block_kv) // self.block_q

    def mask(self, i: Array, j: Array) -> Array:
        """`[block_q, block_kv]` bool: which (row, key) pairs of blocks `(i, j)` are scored."""
        rows = i * self.block_q + jnp.arange(self.block_q)[:, None]
        cols = j * self.block_kv + jnp.arange(self.block_kv)[None, :]
        keep = cols < self.kv_len
        return keep & (cols <= rows) if self.causal else keep


def _to_blocks(x: Array, block: int, count: int) -> Array:
    """`[batch, len, heads, dim]` → zero-padded `[count, batch, heads, block, dim]`."""
    b, length, h, d = x.shape
    x = jnp.pad(x, ((0, 0), (0, count * block - length), (0, 0), (0, 0)))
    return x.reshape(b, count, block, h, d).transpose(1, 0, 3, 2, 4)


def _from_blocks(x: Array, length: int) -> Array:
    """`[count, batch, heads, block, dim]` → `[batch, length, heads, dim]` (padding dropped)."""
    count, b, h, block, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, count * block, h, d)[:, :length]


def _scores(spec: _Spec, q_i: Array, k_j: Array, i: Array, j: Array,
            segments=None) -> tuple[Array, Array]:
    """Scaled fp32 logits `[batch, heads, block_q, block_kv]` and their mask (broadcastable)."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_j, preferred_element_type=_F32)
    keep = spec.mask(i, j)
    if segments is not None:
        seg_q, seg_kv = segments
        keep = keep & (seg_q[i][:, None, :, None] == seg_kv[j][:, None, None, :])
    return s.astype(_F32) * spec.scale, keep


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec: _Spec, q: Array, k: Array, v: Array, segments) -> Array:
    return _forward(spec, q, k, v, segments)[0]


def _forward(spec: _Spec, q: Array, k: Array, v: Array, segments=None,
             out_dtype=None) -> tuple[Array, Array]:
    """Output `[batch, q_len, heads, dim]` (in `out_dtype`, default `v`'s) and row logsumexp
    `[num_q, batch, heads, block_q]` (+inf for a row that saw no key)."""
    qb = _to_blocks(q, spec.block_q, spec.num_q)
    kb = _to_blocks(k, spec.block_kv, spec.num_kv)
    vb = _to_blocks(v, spec.block_kv, spec.num_kv)

    def q_block(_, xs):
        q_i, i = xs

        count, kv_at = spec.kv_loop(i)

        def kv_block(t, carry):
            m, l, acc = carry
            j = kv_at(t)
            s, keep = _scores(spec, q_i, kb[j], i, j, segments)
            m_new = jnp.maximum(m, jnp.max(jnp.where(keep, s, -jnp.inf), axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet
            p = jnp.where(keep, jnp.exp(s - m_safe[..., None]), 0.0)
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), vb[j],
                            preferred_element_type=_F32)
            return m_new, l, alpha[..., None] * acc + pv.astype(_F32)

        row = q_i[..., 0]
        init = (jnp.full_like(row, -jnp.inf, _F32), jnp.zeros_like(row, _F32),
                jnp.zeros_like(q_i, _F32))
        m, l, acc = jax.lax.fori_loop(0, count, kv_block, init)
        out = (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(out_dtype or v.dtype)
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
        return None, (out, lse)

    _, (out, lse) = jax.lax.scan(q_block, None, (qb, jnp.arange(spec.num_q)))
    return _from_blocks(out, spec.q_len), lse


def _attention_fwd(spec, q, k, v, segments):
    out, lse = _forward(spec, q, k, v, segments)
    return out, (q, k, v, out, lse, segments)


def _attention_bwd(spec, residuals, d_out):
    q, k, v, out, lse, segments = residuals
    dq, dk, dv = _backward(spec, q, k, v, out, lse, d_out, segments)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


def _backward(spec: _Spec, q, k, v, out, lse, d_out, segments=None) -> tuple[Array, Array, Array]:
    """float32 `dq, dk, dv` from the output, its row logsumexp (blocked) and `d_out`."""
    qb = _to_blocks(q, spec.block_q, spec.num_q)
    dob = _to_blocks(d_out, spec.block_q, spec.num_q)
    # D_i = rowsum(dO * O): the softmax backward's per-row term (FlashAttention-2, Alg. 2).
    delta = jnp.sum(dob.astype(_F32) * _to_blocks(out, spec.block_q, spec.num_q).astype(_F32),
                    axis=-1)
    kb = _to_blocks(k, spec.block_kv, spec.num_kv)
    vb = _to_blocks(v, spec.block_kv, spec.num_kv)

    def kv_block(dq, xs):
        k_j, v_j, j = xs
        start, stop, q_at = spec.q_loop(j)

        def q_block(t, carry):
            dk, dv, dq = carry
            i = q_at(t)
            q_i, do_i = qb[i], dob[i]
            s, keep = _scores(spec, q_i, k_j, i, j, segments)
            p = jnp.where(keep, jnp.exp(s - lse[i][..., None]), 0.0)
            dv = dv + jnp.einsum("bhqk,bhqd->bhkd", p.astype(do_i.dtype), do_i,
                                 preferred_element_type=_F32).astype(_F32)
            dp = jnp.einsum("bhqd,bhkd->bhqk", do_i, v_j, preferred_element_type=_F32)
            ds = p * (dp.astype(_F32) - delta[i][..., None]) * spec.scale
            dk = dk + jnp.einsum("bhqk,bhqd->bhkd", ds, q_i.astype(_F32))
            dq = dq.at[i].add(jnp.einsum("bhqk,bhkd->bhqd", ds, k_j.astype(_F32)))
            return dk, dv, dq

        zeros = jnp.zeros_like(k_j, _F32)
        dk, dv, dq = jax.lax.fori_loop(start, stop, q_block, (zeros, zeros, dq))
        return dq, (dk, dv)

    dq0 = jnp.zeros_like(qb, _F32)
    dq, (dk, dv) = jax.lax.scan(kv_block, dq0, (kb, vb, jnp.arange(spec.num_kv)))
    return _from_blocks(dq, spec.q_len), _from_blocks(dk, spec.kv_len), _from_blocks(dv, spec.kv_len)


_attention.defvjp(_attention_fwd, _attention_bwd)
