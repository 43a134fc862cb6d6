"""The scanned unit of a MoE GPT: dense blocks, then one with the mixture of experts.

`model.moe.every_n_layers = n` makes every n-th block a MoE block. Scanning needs identical
units, so a unit is `n` blocks (`BlockGroup`) and the model scans `n_layers / n` of them.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from jaxspeed.models.block import Block

Array = jax.Array


class BlockGroup(nn.Module):
    """`every` consecutive blocks, the last one with the MoE feed-forward: the scanned unit of
    a MoE GPT (`model.moe.every_n_layers`), so the scan stays over identical units."""

    every: int
    block: dict[str, Any]

    @nn.compact
    def __call__(self, x: Array, deterministic: bool = False, segment_ids: Array | None = None,
                 positions: Array | None = None) -> tuple[Array, None]:
        features = (segment_ids, positions)
        for i in range(self.every - 1):
            x, _ = Block(**{**self.block, "moe": None}, name=f"dense_{i}")(
                x, deterministic, *features)
        return Block(**self.block, name="moe_block")(x, deterministic, *features)
