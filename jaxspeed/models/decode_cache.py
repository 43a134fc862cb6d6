"""The key/value cache of autoregressive decoding (`GPT(decode=True)`).

An attention layer keeps, in the `cache` collection, the keys and values of every token decoded
so far (`cache_len` positions) and their count (`index`). Each call's tokens follow the cached
ones: they attend over the cache and themselves, then join it.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspeed.models.dense_attention import causal_attention, share_kv_heads

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
    if not ready:
        return causal_attention(q, *share_kv_heads(k, v, n_heads))
    start = index.value
    keys.value = jax.lax.dynamic_update_slice(keys.value, k, (0, start, 0, 0))
    values.value = jax.lax.dynamic_update_slice(values.value, v, (0, start, 0, 0))
    index.value = start + q.shape[1]
    return causal_attention(q, *share_kv_heads(keys.value, values.value, n_heads),
                            q_positions=positions)
