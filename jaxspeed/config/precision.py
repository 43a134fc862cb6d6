"""The precision sections: `bf16`, `fp16` (DeepSpeed's loss scaling) and `fp8` (FP8 matmuls)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from jaxspeed.config.fields import Bool as _Bool
from jaxspeed.config.fields import NonNegativeInt as _NonNegativeInt
from jaxspeed.config.fields import PositiveInt as _PositiveInt
from jaxspeed.config.fields import Section as _Section
from jaxspeed.config.optimizer import ONEBIT_TYPES
from jaxspeed.ops.fp8 import HISTORY, PROJECTIONS, RECIPES


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


def check_fp8(config) -> None:
    """The FP8 combinations that do not work together, each naming both keys."""
    fp8, zero, moe = config.fp8, config.zero_optimization, config.model.moe
    if zero.fp8_all_gather and not (fp8.enabled and fp8.recipe == "tensorwise"
                                    and zero.stage == 3):
        raise ValueError(
            "zero_optimization.fp8_all_gather gathers the weights cast to FP8 with one scale "
            "per tensor: it needs fp8.enabled with fp8.recipe=tensorwise and "
            f"zero_optimization.stage=3 (got fp8.enabled={fp8.enabled}, "
            f"fp8.recipe={fp8.recipe}, stage {zero.stage})")
    if not fp8.enabled:
        return
    experts = moe is not None and "experts" not in fp8.skip
    if experts and not moe.drop_tokens:
        raise ValueError(
            "fp8.enabled with model.moe.drop_tokens=false: the dropless experts' grouped "
            "matmuls have no FP8 path; add 'experts' to fp8.skip or drop tokens")
    if fp8.recipe != "delayed":
        return
    for key, used in (("model.moe", experts), ("mesh.pipe", config.mesh.pipe > 1),
                      (f"optimizer.type={config.optimizer.type}",
                       config.optimizer.type in ONEBIT_TYPES)):
        if used:
            raise ValueError(
                f"fp8.recipe=delayed keeps amax histories as train state, which {key} "
                f"does not carry yet; use fp8.recipe=tensorwise or rowwise"
                + (" (or add 'experts' to fp8.skip)" if key == "model.moe" else ""))
