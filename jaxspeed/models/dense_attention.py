"""Dense causal attention, and the choice of how to compute it (`model.attention.impl`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxspeed.attention.block_sparse import CAUSAL_BLOCKS
from jaxspeed.attention.block_sparse import causal_attention as kernel_causal_attention
from jaxspeed.attention.blocked import blocked_attention
from jaxspeed.errors import ConfigError
from jaxspeed.ops import matmul
from pallas_kernels.backend import on_gpu

Array = jax.Array


def causal_attention(q: Array, k: Array, v: Array, segment_ids: Array | None = None, *,
                     q_positions: Array | None = None, window: int | None = None) -> Array:
    """Causal softmax attention with a float32 softmax, optionally over a sliding window.

    Args:
      q: `[batch, q_len, heads, head_dim]`; k, v: `[batch, kv_len, heads, head_dim]`, key `j`
        at position `j`.
      segment_ids: int `[batch, length]`: a query sees only keys of its own segment (packed
        documents); None: one segment.
      q_positions: int `[q_len]`, the queries' positions (a decoding step's, after a cache of
        keys); default `0, 1, ...`: query `i` sees keys `0..i`.
      window: Mistral's sliding window `w`: query `i` sees keys `i-w+1..i` only; None: all
        keys up to `i`.

    Returns:
      `[batch, q_len, heads, head_dim]` in `v`'s dtype.
    """
    head_dim = q.shape[-1]
    scores = matmul.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) / math.sqrt(head_dim)
    if q_positions is None:
        q_positions = jnp.arange(q.shape[1])
    keep = jnp.arange(k.shape[1])[None, :] <= q_positions[:, None]
    if window is not None:
        keep = keep & (jnp.arange(k.shape[1])[None, :] > q_positions[:, None] - window)
    if segment_ids is not None:
        keep = keep & same_segment(segment_ids)
    scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return matmul.einsum("bhqk,bkhd->bqhd", probs, v)


def max_logits(q: Array, k: Array, order: Array | None = None,
               segment_ids: Array | None = None, *, window: int | None = None,
               block: int = 512) -> Array:
    """Each head's largest attention logit `q·k/√head_dim` over the keys its queries see
    (QK-clip's statistic), without gradient, `block` queries at a time.

    Args:
      q, k: `[batch, length, heads, head_dim]` (grouped key heads already shared).
      order: int `[length]`, each row's place in the sequence (a load-balanced sequence
        split's layout); None: `0, 1, ...`.
      segment_ids, window: as `causal_attention`'s.
      block: queries per block of scores (`[batch, heads, block, length]` float32 at a time).

    Returns:
      float32 `[heads]`.
    """
    q, k = jax.lax.stop_gradient((q, k))
    batch, length = q.shape[:2]
    order = jnp.arange(length) if order is None else order
    segments = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids
    blocks = length // block if length > block and length % block == 0 else 1

    def one(args):
        q_block, q_order, q_segments = args
        scores = matmul.einsum("bqhd,bkhd->bhqk", q_block, k,
                               preferred_element_type=jnp.float32)
        scores = scores.astype(jnp.float32) / math.sqrt(q.shape[-1])
        keep = order[None, :] <= q_order[:, None]
        if window is not None:
            keep = keep & (order[None, :] > q_order[:, None] - window)
        keep = keep[None, None] & (q_segments[:, None, :, None] == segments[:, None, None, :])
        return jnp.max(jnp.where(keep, scores, -jnp.inf), axis=(0, 2, 3))

    split = lambda x, axis: jnp.moveaxis(  # noqa: E731
        x.reshape(*x.shape[:axis], blocks, length // blocks, *x.shape[axis + 1:]), axis, 0)
    return jnp.max(jax.lax.map(one, (split(q, 1), split(order, 0), split(segments, 1))), axis=0)


def same_segment(segment_ids: Array) -> Array:
    """bool `[batch, 1, length, length]`: query and key in the same segment."""
    return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def attend(q: Array, k: Array, v: Array, *, impl: str, block_q: int, block_kv: int,
           segment_ids: Array | None = None, window: int | None = None) -> Array:
    """Dense causal softmax attention, computed as `impl` says.

    Args:
      q, k, v: `[batch, length, heads, head_dim]`.
      impl: `reference` (`causal_attention`: `[batch, heads, length, length]` fp32 scores),
        `blocked` (`jaxspeed.attention.blocked_attention`, O(length * block) memory), `fused`
        (`jax.nn.dot_product_attention` with its default implementation: XLA's dense attention
        in jax 0.11-0.12, which materialises the scores; not cuDNN's kernel), `cudnn` (the same
        call with cuDNN's fused flash attention: NVIDIA GPUs only, bf16/fp16), `pallas`
        (`jaxspeed.attention.block_sparse.causal_attention`: our Pallas FlashAttention kernel
        over the causal block layout on a GPU, its XLA path elsewhere) or `auto`: `fused` on a GPU; elsewhere `blocked` when the sequence is longer than a
        block, else `reference` (one block holds the whole `[length, length]` tile anyway,
        and the reference computes it without the loops).
      block_q, block_kv: the blocks of `blocked`.
      segment_ids: int `[batch, length]` of packed documents (attention stays within one),
        or None.
      window: a sliding window (see `causal_attention`), or None. The blocked kernel has
        none: `auto` then computes `reference` off a GPU, and `blocked` is refused.

    Returns:
      `[batch, length, heads, head_dim]` in `v`'s dtype.
    """
    if impl == "auto":
        longer = window is None and (q.shape[1] > block_q or k.shape[1] > block_kv)
        impl = "fused" if on_gpu() else "blocked" if longer else "reference"
    if impl == "cudnn" and not on_gpu():
        raise ConfigError(
            "model.attention.impl: cudnn is cuDNN's fused attention, which runs on NVIDIA GPUs "
            f"only (JAX's default backend here is {jax.default_backend()!r}); use auto, fused, "
            "blocked or reference")
    if impl in ("fused", "cudnn"):
        mask = None if segment_ids is None else same_segment(segment_ids)
        y = jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True,
            implementation="cudnn" if impl == "cudnn" else None,
            local_window_size=None if window is None else (window - 1, 0))
        return y.astype(v.dtype)
    if impl == "pallas":
        if window is not None or segment_ids is not None:
            what = "model.sliding_window" if window is not None else "packed documents (segment ids)"
            raise ConfigError(
                f"{what} cannot run with model.attention.impl: pallas (the kernel takes a plain "
                "causal mask); set model.attention.impl: auto, fused or reference")
        if q.shape[1] % CAUSAL_BLOCKS[-1]:
            raise ConfigError(
                f"model.attention.impl: pallas needs data.seq_len a multiple of "
                f"{CAUSAL_BLOCKS[-1]}, got {q.shape[1]}")
        return kernel_causal_attention(q, k, v)
    if impl == "blocked":
        if window is not None:
            raise ConfigError(
                f"model.sliding_window={window} cannot run with model.attention.impl: blocked "
                "(the blocked kernel has no window); set model.attention.impl: auto, fused or "
                "reference")
        return blocked_attention(q, k, v, causal=True, block_q=block_q, block_kv=block_kv,
                                 segment_ids=segment_ids)
    return causal_attention(q, k, v, segment_ids, window=window)




def share_kv_heads(k: Array, v: Array, n_heads: int) -> tuple[Array, Array]:
    """Grouped-query attention: each group of query heads reads one key/value head.

    Args:
      k, v: `[batch, length, kv_heads, head_dim]`, `kv_heads` dividing `n_heads`.

    Returns:
      `k`, `v` as `[batch, length, n_heads, head_dim]`.
    """
    group = n_heads // k.shape[2]
    return (k, v) if group == 1 else tuple(jnp.repeat(t, group, axis=2) for t in (k, v))
