"""The `optimizer:` and `scheduler:` sections: one typed model per `type`, with DeepSpeed's names.

Each section is a union tagged by `type` (`OptimizerConfig`, `SchedulerConfig`): the type picks
the model, and the model checks its `params`, so every misspelt or mistyped param is reported
with the rest of the config's errors, as `optimizer.params.KEY`. A type is case-insensitive
(DeepSpeed lowercases names) and is stored in its canonical spelling. `jaxspeed.optim` turns
these models into optax objects.

Counts accept integral floats (`freeze_step: 1e5`, as DeepSpeed's JSON configs write them);
floats accept ints; bools are strict.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, create_model, model_validator

from jaxspeed.config.fields import Bool, Section, whole_number

#: The lr of an optimizer whose `params.lr` is not given.
DEFAULT_LR = 1e-3

_Float = Annotated[float, Field(strict=True)]
_Betas = tuple[_Float, _Float]
_Count = Annotated[int, Field(strict=True), BeforeValidator(whole_number)]


def _freeze_step_not_negative(value: int) -> int:
    if value < 0:
        raise ValueError(f"freeze_step must be >= 0, got {value}")
    return value


def _typed(section: str, type_name: str, params: type[Section]) -> type[Section]:
    """The model of `{section}: {type: type_name, params: {...}}`.

    A missing `params` block is validated as `{}`, so a required param is reported by name.
    """
    return create_model(
        f"{type_name[0].upper()}{type_name[1:]}Config",
        __base__=Section,
        __doc__=f"`{section}: {{type: {type_name}, params: ...}}` ({params.__name__}).",
        type=(Literal[type_name], type_name),
        params=(params, Field(default_factory=dict, validate_default=True)),
    )


# ---------------------------------------------------------------------------------- optimizers


class _OptimizerParams(Section):
    """What every optimizer takes: the peak lr (which a scheduler scales) and weight decay."""

    moved_keys: ClassVar[Mapping[str, str]] = types.MappingProxyType(
        {"max_grad_norm": "the top-level gradient_clipping"}
    )

    lr: _Float = DEFAULT_LR
    weight_decay: _Float = 0.0


class AdamParams(_OptimizerParams):
    """DeepSpeed's Adam is FusedAdam with adam_w_mode=True: decoupled weight decay."""

    betas: _Betas = (0.9, 0.999)
    eps: _Float = 1e-8
    adam_w_mode: Bool = True


class AdamWParams(_OptimizerParams):
    """DeepSpeed's AdamW is FusedAdam(adam_w_mode=True), whose weight_decay default is 0.0
    (torch.optim.AdamW's 0.01 only applies with DeepSpeed's torch_adam)."""

    betas: _Betas = (0.9, 0.999)
    eps: _Float = 1e-8


class SGDParams(_OptimizerParams):
    """torch.optim.SGD (DeepSpeed falls back to torch.optim for this name), dampening 0."""

    momentum: _Float = 0.0
    nesterov: Bool = False


class LionParams(_OptimizerParams):
    """DeepSpeed's FusedLion."""

    betas: _Betas = (0.9, 0.99)


class AdafactorParams(_OptimizerParams):
    """optax.adafactor's own names and meanings (DeepSpeed has no built-in Adafactor)."""

    decay_rate: _Float = 0.8
    eps: _Float = 1e-30
    #: 0 = no update clipping
    clipping_threshold: _Float = 1.0
    multiply_by_parameter_scale: Bool = True
    min_dim_size_to_factor: Annotated[_Count, Field(ge=0)] = 128


class OneBitAdamParams(_OptimizerParams):
    """DeepSpeed's OnebitAdam; cuda_aware and comm_backend_name are accepted and ignored (the
    compressed all-reduce is an XLA collective)."""

    betas: _Betas = (0.9, 0.999)
    eps: _Float = 1e-8
    #: plain Adam steps before the compressed phase starts
    freeze_step: Annotated[_Count, AfterValidator(_freeze_step_not_negative)] = 100000
    bias_correction: Bool = True
    cuda_aware: Bool = False
    comm_backend_name: Annotated[str, Field(strict=True)] = "nccl"


class LambParams(_OptimizerParams):
    """DeepSpeed's FusedLamb: Adam's direction plus decoupled weight decay, times the trust
    ratio `||p|| / ||u||` clamped to `[min_coeff, max_coeff]` (per leaf)."""

    betas: _Betas = (0.9, 0.999)
    eps: _Float = 1e-8
    max_coeff: _Float = 10.0
    min_coeff: _Float = 0.01

    @model_validator(mode="after")
    def _coeffs_ordered(self):
        if not 0 <= self.min_coeff <= self.max_coeff:
            raise ValueError(f"need 0 <= min_coeff <= max_coeff, got min_coeff {self.min_coeff}, "
                             f"max_coeff {self.max_coeff}")
        return self


class OneBitLambParams(LambParams):
    """DeepSpeed's OnebitLamb (`jaxspeed.optim.onebit_lamb`); cuda_aware and comm_backend_name
    are accepted and ignored, as for OneBitAdam."""

    #: plain LAMB steps before the compressed phase starts
    freeze_step: Annotated[_Count, AfterValidator(_freeze_step_not_negative)] = 100000
    coeff_beta: _Float = 0.9
    factor_max: _Float = 4.0
    factor_min: _Float = 0.5
    factor_threshold: _Float = 0.1
    cuda_aware: Bool = False
    comm_backend_name: Annotated[str, Field(strict=True)] = "nccl"

    @model_validator(mode="after")
    def _factors(self):
        if not 0 < self.factor_min <= 1 <= self.factor_max:
            raise ValueError(f"need 0 < factor_min <= 1 <= factor_max, got factor_min "
                             f"{self.factor_min}, factor_max {self.factor_max}")
        if not 0 <= self.coeff_beta < 1:
            raise ValueError(f"coeff_beta must be in [0, 1), got {self.coeff_beta}")
        return self


class ZeroOneAdamParams(_OptimizerParams):
    """DeepSpeed's ZeroOneAdam (`jaxspeed.optim.zero_one_adam`); cuda_aware and
    comm_backend_name are accepted and ignored, as for OneBitAdam."""

    betas: _Betas = (0.9, 0.999)
    eps: _Float = 1e-8
    #: the last step that may update the variance (adaptive freezing until then)
    var_freeze_step: Annotated[_Count, Field(ge=0)] = 100000
    #: variance updates per interval before the interval doubles
    var_update_scaler: Annotated[_Count, Field(ge=1)] = 16
    #: steps per sync interval before the interval doubles (after the freeze)
    local_step_scaler: Annotated[_Count, Field(ge=1)] = 32678
    #: the largest sync interval
    local_step_clipper: Annotated[_Count, Field(ge=1)] = 16
    bias_correction: Bool = True
    cuda_aware: Bool = False
    comm_backend_name: Annotated[str, Field(strict=True)] = "nccl"


#: Path globs of the params Muon leaves to AdamW: embeddings, the LM head, norms, biases.
MUON_ADAMW_PARAMS = ("*embed*", "*head", "*norm*", "*bias")


class MuonParams(_OptimizerParams):
    """Muon on the weight matrices, AdamW on the rest (`jaxspeed.optim.muon`). `lr` and
    `weight_decay` are both parts'; with `rms_scale` 0.2 AdamW's values carry over."""

    momentum: Annotated[_Float, Field(ge=0, lt=1)] = 0.95
    nesterov: Bool = True
    ns_steps: Annotated[_Count, Field(ge=1)] = 5
    #: the Muon update's RMS (Moonlight: 0.2, AdamW's)
    rms_scale: Annotated[_Float, Field(gt=0)] = 0.2
    #: each attention head's projection is its own matrix
    split_heads: Bool = False
    #: globs of `/`-joined param paths AdamW updates (leaves that are not matrices always do)
    adamw_params: tuple[Annotated[str, Field(strict=True)], ...] = MUON_ADAMW_PARAMS
    #: null: `lr`
    adamw_lr: _Float | None = None
    #: null: `weight_decay`
    adamw_weight_decay: _Float | None = None
    betas: _Betas = (0.9, 0.999)
    eps: _Float = 1e-8
    #: where each matrix's Newton–Schulz runs: on its owners (`owner`), where its momentum
    #: lives (`sharded`), or per pool of matrices whichever `cluster`'s rates price cheaper
    #: (`auto`; without a cluster, `owner` unless padding doubles the pool)
    placement: Literal["auto", "owner", "sharded"] = "auto"
    #: a cluster preset or file (`jaxspeed plan --cluster`'s) whose matmul rate and links price
    #: `placement: auto` (`jaxspeed.optim.muon_price`); null: the padding rule
    cluster: Annotated[str, Field(strict=True, min_length=1)] | None = None
    #: MuonClip (Kimi K2): after each update, scale back the query/key projections of the
    #: attention heads whose largest logit passed this threshold (null: off)
    qk_clip: Annotated[_Float, Field(gt=0)] | None = None
    #: the query's share of QK-clip's scaling (the key takes the rest)
    qk_clip_alpha: Annotated[_Float, Field(ge=0, le=1)] = 0.5


def clips_logits(optimizer) -> bool:
    """Whether `optimizer` (an optimizer section) clips attention logits (Muon's `qk_clip`),
    so that the model records them."""
    return getattr(optimizer.params, "qk_clip", None) is not None


AdamConfig = _typed("optimizer", "Adam", AdamParams)
AdamWConfig = _typed("optimizer", "AdamW", AdamWParams)  # the default optimizer
SGDConfig = _typed("optimizer", "SGD", SGDParams)
LionConfig = _typed("optimizer", "Lion", LionParams)
AdafactorConfig = _typed("optimizer", "Adafactor", AdafactorParams)
OneBitAdamConfig = _typed("optimizer", "OneBitAdam", OneBitAdamParams)
LambConfig = _typed("optimizer", "Lamb", LambParams)
OneBitLambConfig = _typed("optimizer", "OneBitLamb", OneBitLambParams)
ZeroOneAdamConfig = _typed("optimizer", "ZeroOneAdam", ZeroOneAdamParams)
MuonConfig = _typed("optimizer", "Muon", MuonParams)
#: The optimizers whose workers keep gradients local and exchange 1-bit compressed momentum.
ONEBIT_TYPES = ("OneBitAdam", "OneBitLamb", "ZeroOneAdam")


# ---------------------------------------------------------------------------------- schedulers

_Steps = Annotated[_Count, Field(ge=1)]


class ConstantParams(Section):
    """A constant lr takes no params: it is the optimizer's `params.lr`."""


class WarmupLRParams(Section):
    """DeepSpeed's WarmupLR: from `warmup_min_lr` up to `warmup_max_lr`, then constant."""

    warmup_min_lr: _Float = 0.0
    #: null: the optimizer's lr
    warmup_max_lr: _Float | None = None
    warmup_num_steps: _Steps = 1000
    warmup_type: Literal["log", "linear"] = "log"


class WarmupDecayLRParams(WarmupLRParams):
    """DeepSpeed's WarmupDecayLR: WarmupLR, then a linear decay to `warmup_min_lr` at
    `total_num_steps`."""

    total_num_steps: _Steps


class WarmupCosineParams(Section):
    """DeepSpeed's WarmupCosineLR: ratios of the optimizer's lr, warm-up then cosine decay."""

    total_num_steps: _Steps
    warmup_min_ratio: _Float = 0.0
    warmup_num_steps: _Steps = 1000
    cos_min_ratio: _Float = 1e-4
    warmup_type: Literal["log", "linear"] = "log"


ConstantConfig = _typed("scheduler", "constant", ConstantParams)  # the default schedule
WarmupLRConfig = _typed("scheduler", "WarmupLR", WarmupLRParams)
WarmupDecayLRConfig = _typed("scheduler", "WarmupDecayLR", WarmupDecayLRParams)
WarmupCosineConfig = _typed("scheduler", "WarmupCosine", WarmupCosineParams)


# -------------------------------------------------------------------------------- the unions

_Optimizers = (
    AdamConfig | AdamWConfig | SGDConfig | LionConfig | AdafactorConfig | OneBitAdamConfig
    | LambConfig | OneBitLambConfig | ZeroOneAdamConfig | MuonConfig
)
_Schedulers = ConstantConfig | WarmupLRConfig | WarmupDecayLRConfig | WarmupCosineConfig


def _tags(union: Any) -> tuple[str, ...]:
    return tuple(member.model_fields["type"].default for member in typing.get_args(union))


OPTIMIZER_TYPES: tuple[str, ...] = _tags(_Optimizers)
SCHEDULER_TYPES: tuple[str, ...] = _tags(_Schedulers)
#: Other spellings of scheduler types (lower case) → canonical type.
SCHEDULER_ALIASES: Mapping[str, str] = types.MappingProxyType({"warmupcosinelr": "WarmupCosine"})


def _canonical_type(
    accepted: tuple[str, ...], *, default: str, aliases: Mapping[str, str] | None = None
) -> Callable[[Any], Any]:
    """A before-validator that fills in `default` and spells `type` canonically.

    An unknown type is left as it is, for the union to report with the accepted types.
    """
    by_lower = {name.lower(): name for name in accepted} | dict(aliases or {})

    def canonical(value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        name = value.get("type", default)
        if isinstance(name, str):
            name = by_lower.get(name.lower(), name)
        return {**value, "type": name}

    return canonical


#: `optimizer:`, one of the models above, picked by its `type`.
OptimizerConfig = Annotated[
    _Optimizers,
    Field(discriminator="type"),
    BeforeValidator(_canonical_type(OPTIMIZER_TYPES, default="AdamW")),
]
#: `scheduler:`, one of the models above, picked by its `type`.
SchedulerConfig = Annotated[
    _Schedulers,
    Field(discriminator="type"),
    BeforeValidator(
        _canonical_type(SCHEDULER_TYPES, default="constant", aliases=SCHEDULER_ALIASES)
    ),
]
