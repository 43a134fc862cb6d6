"""The key/value cache of autoregressive decoding (`GPT(decode=True)`).

An attention layer keeps, in the `cache` collection, the keys and values of every token decoded
so far (`cache_len` positions) and their count (`index`). Each call's tokens follow the cached
ones: they attend over the cache and themselves, then join it. A layer trained with a
block-sparse layout (its `sparse` config) decodes with that layout, built for `cache_len`
tokens: token `i` sees token `j <= i` where `layout[head, i // block, j // block]`, as a forward
pass over the whole `cache_len` sequence would.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxspeed.models.dense_attention import causal_attention, share_kv_heads
from jaxspeed.ops import matmul

Array = jax.Array


def cache_index(module: nn.Module) -> nn.Variable:
    """The number of tokens already in `module`'s cache (created as 0)."""
    return module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))


def attend_cached(module: nn.Module, q: Array, k: Array, v: Array, index: nn.Variable,
                  positions: Array, *, cache_len: int, n_heads: int) -> Array:
    """This call's queries attend over the cached keys and values and their own, which join
    the cache at `index`.

    Args:
      module: the attention layer whose `cache` collection holds the keys and values.
      q: `[batch, length, n_heads, head_dim]`; k, v: `[batch, length, kv_heads, head_dim]`,
        rotated already.
      index: `cache_index(module)`.
      positions: int `[length]`, the queries' positions (`index + 0, 1, ...`).
      cache_len: positions the cache holds.
      n_heads: query heads (grouped-query attention shares each key/value head).

    Returns:
      `[batch, length, n_heads, head_dim]`.
    """
    shape = (k.shape[0], cache_len, *k.shape[2:])
    ready = module.has_variable("cache", "key")  # False while `init` creates the cache
    keys = module.variable("cache", "key", jnp.zeros, shape, k.dtype)
    values = module.variable("cache", "value", jnp.zeros, shape, v.dtype)
    window = getattr(module, "sliding_window", None)  # Mistral: the cache keeps every key
    if not ready:
        return causal_attention(q, *share_kv_heads(k, v, n_heads), window=window)
    start = index.value
    keys.value = jax.lax.dynamic_update_slice(keys.value, k, (0, start, 0, 0))
    values.value = jax.lax.dynamic_update_slice(values.value, v, (0, start, 0, 0))
    index.value = start + q.shape[1]
    k, v = share_kv_heads(keys.value, values.value, n_heads)
    sparse = getattr(module, "sparse", None)  # the layer's block-sparse layout config, if any
    if sparse is None:
        return causal_attention(q, k, v, q_positions=positions, window=window)
    return _masked_attention(q, k, v, sparse_keep(sparse, positions, cache_len))


def sparse_keep(sparse, positions: Array, cache_len: int) -> Array:
    """bool `[heads, q_len, cache_len]`: which cached keys each query sees under `sparse`'s
    layout at `cache_len` tokens (a multiple of its block), causal.

    Args:
      sparse: a `jaxspeed.attention.SparsityConfig` (`make_layout`, `block`).
      positions: int `[q_len]`, the queries' positions.
      cache_len: positions the cache holds.
    """
    layout = jnp.asarray(np.asarray(sparse.make_layout(cache_len)) != 0)  # [heads, nb, nb]
    key_blocks = np.arange(cache_len) // sparse.block
    blocks = layout[:, positions // sparse.block][:, :, key_blocks]
    return blocks & (jnp.arange(cache_len)[None, :] <= positions[:, None])[None]


def _masked_attention(q: Array, k: Array, v: Array, keep: Array) -> Array:
    """Softmax attention (float32) of q `[batch, q_len, heads, dim]` over k, v
    `[batch, kv_len, heads, dim]` where `keep` (bool `[heads, q_len, kv_len]`) allows."""
    scores = matmul.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) / np.sqrt(q.shape[-1])
    scores = jnp.where(keep[None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return matmul.einsum("bhqk,bkhd->bqhd", probs, v)
