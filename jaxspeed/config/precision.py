"""The precision sections: `bf16`, `fp16` (DeepSpeed's loss scaling) and `fp8` (FP8 matmuls)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from jaxspeed.config.fields import Bool as _Bool
from jaxspeed.config.fields import NonNegativeInt as _NonNegativeInt
from jaxspeed.config.fields import PositiveInt as _PositiveInt
from jaxspeed.config.fields import Section as _Section
from jaxspeed.options.fp8 import HISTORY, PROJECTIONS, RECIPES


class Bf16Config(_Section):
    """bfloat16 compute with float32 master weights."""

    enabled: _Bool = False


class Fp16Config(_Section):
    """float16 compute with dynamic loss scaling (DeepSpeed's names and defaults)."""

    enabled: _Bool = False
    initial_scale_power: _NonNegativeInt = 16
    loss_scale_window: _PositiveInt = 1000
    hysteresis: _PositiveInt = 2
    min_loss_scale: Annotated[float, Field(strict=True, gt=0)] = 1.0
    consecutive_hysteresis: _Bool = False


class Fp8Config(_Section):
    """FP8 matmuls in the transformer blocks' projections, MLPs and experts (`jaxspeed.ops.fp8`):
    e4m3 operands forward, e5m2 gradients. The embedding, the LM head, the norms and attention
    stay in the compute dtype."""

    enabled: _Bool = False
    #: `tensorwise` (current scaling, a scale per tensor), `rowwise` (current scaling, a scale
    #: per row of each GEMM operand), `delayed` (Transformer Engine's amax history)
    recipe: Literal[RECIPES] = "tensorwise"
    #: `delayed`: steps of amax history each scale is taken from (the history's max)
    amax_history_length: _PositiveInt = HISTORY
    #: projections that stay in the compute dtype, by name
    skip: list[Literal[PROJECTIONS]] = Field(default_factory=list)
