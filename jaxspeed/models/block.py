"""The GPT's pre-norm decoder block: attention, then a feed-forward (dense or MoE)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspeed.models.attention import Attention
from jaxspeed.models.layers import NORM_EPS, Mlp, Norm
from jaxspeed.moe.layer import MoE
from jaxspeed.ops.fp8 import Fp8Recipe

Array = jax.Array
Dtype = Any


class Block(nn.Module):
    """Pre-norm decoder block; `(carry, deterministic)` signature so it can be scanned.

    `attention` holds the `Attention` attributes besides the shared `out_std`, `param_dtype`
    and `dtype`. With `moe` (keyword arguments of `jaxspeed.moe.MoE`) the feed-forward is a
    mixture of experts, which records its aux loss for the engine. `fp8` runs the projections,
    the MLP and the experts' matmuls in FP8 (`jaxspeed.ops.fp8`).
    """

    d_ff: int
    norm: str
    mlp: str
    out_std: float
    attention: dict[str, Any]
    param_dtype: Dtype = jnp.float32
    dtype: Dtype | None = None
    norm_eps: float = NORM_EPS
    moe: tuple[tuple[str, Any], ...] | None = None
    fp8: Fp8Recipe | None = None

    @nn.compact
    def __call__(self, x: Array, deterministic: bool = False, segment_ids: Array | None = None,
                 positions: Array | None = None) -> tuple[Array, None]:
        """`x: [batch, length, embed]` residual stream → (new residual stream, None);
        `segment_ids` / `positions` of packed documents go to the attention."""
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = Norm(self.norm, self.param_dtype, self.norm_eps, name="attn_norm")(x)
        h = Attention(
            **self.attention, out_std=self.out_std, param_dtype=self.param_dtype,
            dtype=self.dtype, fp8=self.fp8, name="attn",
        )(h, segment_ids, positions)
        x = x + h.astype(x.dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = Norm(self.norm, self.param_dtype, self.norm_eps, name="mlp_norm")(x)
        if self.moe is None:
            h = Mlp(self.d_ff, self.mlp, self.out_std, self.param_dtype, self.dtype, self.fp8,
                    name="mlp")(h)
        else:
            experts = self.fp8 is not None and self.fp8.applies("experts")
            moe = MoE(**dict(self.moe), param_dtype=self.param_dtype, dtype=self.dtype,
                      fp8=self.fp8.recipe if experts else None, name="moe")
            h = moe(h, deterministic=deterministic)
        x = x + h.astype(x.dtype)
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), None
