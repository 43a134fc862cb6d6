"""Rotary position embeddings (RoFormer; Llama 3's frequency scaling)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

ROTARY_BASE = 10_000.0


@dataclasses.dataclass(frozen=True)
class Rotary:
    """Rotary embedding settings: the base `theta` and Llama 3's frequency scaling.

    `scaling` is None or `(factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings)` (Hugging Face's `rope_type: llama3`).
    """

    theta: float = ROTARY_BASE
    scaling: tuple[float, float, float, int] | None = None

    def frequencies(self, head_dim: int) -> np.ndarray:
        """float32 `[head_dim // 2]` inverse frequencies, computed as Hugging Face does."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
        inv_freq = (1.0 / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.scaling is None:
            return inv_freq
        factor, low, high, original = self.scaling
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary_embedding(
    x: Array, positions: Array | None = None, rotary: Rotary = Rotary()
) -> Array:
    """Rotary position embedding (RoFormer, Su et al. 2021), rotate-half form (Llama's).

    Args:
      x: `[batch, length, heads, head_dim]`, head_dim even.
      positions: int `[length]` or `[batch, length]`, each row's position; default row i is
        position i.
      rotary: the base and scaling of the frequencies.

    Returns:
      `x` rotated by position-dependent angles, same shape and dtype (sin/cos in float32).
    """
    length, head_dim = x.shape[1], x.shape[-1]
    inv_freq = jnp.asarray(rotary.frequencies(head_dim))
    if positions is None:
        positions = jnp.arange(length)
    positions = jnp.broadcast_to(positions, x.shape[:2])  # per row: packed documents restart
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, length, half]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
