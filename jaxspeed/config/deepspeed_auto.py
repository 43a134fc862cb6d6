"""DeepSpeed ``"auto"`` values (Hugging Face Trainer configs): filled in from the rest of the config.

The Hugging Face Trainer fills each ``"auto"`` of a ``ds_config.json`` from its own training
arguments (`HfTrainerDeepSpeedConfig.trainer_config_process` / `trainer_config_finalize`);
jaxspeed fills the same keys from the rest of the config and from its own defaults:

* the batch sizes: left out, so `resolve_batch` derives them from the others and the
  data-parallel size (micro batch 1 and accumulation 1 when nothing is given);
* `gradient_clipping`: 1.0, the Trainer's default `max_grad_norm` (jaxspeed's own default is
  no clipping, but a Trainer config ran with 1.0);
* `bf16.enabled`, `fp16.enabled`, `scheduler.params.warmup_min_lr` and the optimizer's
  `betas`, `eps`, `weight_decay`: jaxspeed's defaults (float32, 0, the optimizer type's
  defaults), which are the Trainer's too;
* `optimizer.params.lr`: the scheduler's `warmup_max_lr` when that is a number, else the
  default lr; `scheduler.params.warmup_max_lr`: the optimizer's lr;
* `scheduler.params.total_num_steps`: the run's `steps`; `warmup_num_steps`: 1, the shortest
  warmup jaxspeed's schedules take, for the Trainer's default of none (`warmup_steps=0`;
  DeepSpeed's own WarmupLR raises 0 to 2);
* any other ``"auto"`` among the optimizer's or scheduler's params: that param's default.

An ``"auto"`` that is none of these (a param the type does not take, another key) is left for
validation to report with the config's other errors.

ZeRO's auto sizes (`reduce_bucket_size`, `stage3_prefetch_bucket_size`,
`stage3_param_persistence_threshold`) are dropped with the other bucket knobs
(`DEEPSPEED_IGNORED`). `describe_auto` says, in one line, what each ``"auto"`` became.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxspeed.config.key_paths import _MISSING, _insert, _lookup, _remove
from jaxspeed.config.optimizer import (
    SCHEDULER_ALIASES,
    OptimizerConfig,
    SchedulerConfig,
)

AUTO = "auto"


class DeepSpeedAutoWarning(UserWarning):
    """DeepSpeed "auto" values were filled in; the message says with what (one line)."""


#: The batch-size keys (jaxspeed's names; DeepSpeed's per-GPU name is renamed before this).
_BATCH = ("train_batch_size", "train_micro_batch_size_per_device", "gradient_accumulation_steps")
_DEFAULT_STEPS = 1000
_TRAINER_MAX_GRAD_NORM = 1.0  # transformers.TrainingArguments.max_grad_norm


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _lr(tree: dict[str, Any]) -> Any:
    peak = _lookup(tree, "scheduler.params.warmup_max_lr")
    return peak if _number(peak) else _MISSING


def _total_steps(tree: dict[str, Any]) -> Any:
    steps = tree.get("steps", _DEFAULT_STEPS)
    return steps if _number(steps) else _MISSING


#: Keys whose "auto" is filled from the rest of the config: key → the value (given the tree
#: with the other "auto" keys already filled), or `_MISSING` for the default.
_FILLED: Mapping[str, Callable[[dict[str, Any]], Any]] = types.MappingProxyType({
    "scheduler.params.total_num_steps": _total_steps,
    "scheduler.params.warmup_num_steps": lambda tree: 1,
    "optimizer.params.lr": _lr,
    "gradient_clipping": lambda tree: _TRAINER_MAX_GRAD_NORM,
})
#: Keys whose "auto" means jaxspeed's default (for the batch sizes: "derive it").
DEEPSPEED_AUTO_MEANS_UNSET: tuple[str, ...] = (
    *_BATCH, "bf16.enabled", "fp16.enabled")
def _placeholders(params: Any) -> frozenset[str]:
    """The params of a params model whose "auto" is DeepSpeed's: all but those that take
    "auto" as a value of their own (Muon's `placement`)."""
    return frozenset(name for name, field in params.model_fields.items()
                     if AUTO not in typing.get_args(field.annotation))


#: Sections whose every "auto" param means the param's default (but those in `_FILLED`):
#: section → (its default type, {lower-case type: the names of its params}).
_PARAMS: Mapping[str, tuple[str, dict[str, frozenset[str]]]] = types.MappingProxyType({
    f"{section}.params": (default, {
        member.model_fields["type"].default.lower():
            _placeholders(member.model_fields["params"].annotation)
        for member in typing.get_args(typing.get_args(union)[0])
    })
    for section, default, union in (
        ("optimizer", "adamw", OptimizerConfig), ("scheduler", "constant", SchedulerConfig))
})


def _params_taken(tree: dict[str, Any], section: str) -> frozenset[str] | None:
    """The params the section's type takes; None when the type is not known (validation
    names it)."""
    default, by_type = _PARAMS[section]
    kind = _lookup(tree, section.removesuffix(".params") + ".type")
    kind = default if kind is _MISSING else str(kind).lower()
    return by_type.get(SCHEDULER_ALIASES.get(kind, kind).lower())


def resolve_auto(tree: dict[str, Any]) -> list[str]:
    """Fills in every DeepSpeed ``"auto"`` of `tree` in place (see the module docstring).

    Args:
      tree: a config dict with jaxspeed's key names (after `from_deepspeed`'s renames).

    Returns:
      the keys that were ``"auto"``, for `describe_auto`. An ``"auto"`` anywhere else is left
      for validation to report.
    """
    autos = [key for key in (*DEEPSPEED_AUTO_MEANS_UNSET, "gradient_clipping")
             if _lookup(tree, key) == AUTO]
    for section in _PARAMS:
        params, taken = _lookup(tree, section), _params_taken(tree, section)
        if isinstance(params, dict) and taken is not None:  # else validation says what is wrong
            autos += [f"{section}.{key}" for key, value in params.items()
                      if value == AUTO and key in taken]
    for key in autos:  # the defaults first: the filled keys read the others' values
        if key not in _FILLED:
            _remove(tree, key)
    for key, fill in _FILLED.items():
        if key in autos:
            value = fill(tree)
            if value is _MISSING:
                _remove(tree, key)
            else:
                _insert(tree, key.split("."), value, what=key)
    return autos


def describe_auto(config: Any, autos: Sequence[str]) -> str:
    """One line saying what each ``"auto"`` became in the validated `config`."""
    batch = _batch_text(config)
    parts = []
    for key in autos:
        if key in batch:
            value = batch[key]
        else:
            value = config
            for part in key.split("."):
                value = getattr(value, part, None)
            if key == "scheduler.params.warmup_max_lr" and value is None:
                value = f"{config.optimizer.params.lr!r} (the optimizer's lr)"
        value = list(value) if isinstance(value, tuple) else value
        parts.append(f"{key}={value}")
    return 'DeepSpeed "auto" values filled in: ' + ", ".join(parts)


def _batch_text(config: Any) -> dict[str, str]:
    """The batch sizes as `resolve_batch` will derive them, with the data-parallel size as a
    word (it is only known once the mesh is)."""
    total = config.train_batch_size
    micro = config.train_micro_batch_size_per_device
    accum = config.gradient_accumulation_steps
    if config.mesh.pipe > 1:
        accum = config.pipeline.num_microbatches
    dp = "data-parallel size"
    if total is None:
        micro, accum = micro or 1, accum or 1
        total = f"{micro * accum} x {dp}"
    elif micro is None and accum is None:
        micro, accum = f"{total} / {dp}", 1
    elif micro is None:
        micro = f"{total} / ({accum} x {dp})"
    elif accum is None:
        accum = f"{total} / ({micro} x {dp})"
    return {"train_batch_size": str(total), "train_micro_batch_size_per_device": str(micro),
            "gradient_accumulation_steps": str(accum)}
