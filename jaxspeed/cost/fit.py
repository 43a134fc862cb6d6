"""Will it fit? A verdict from the compiled step, and the cheapest change that makes it fit.

The verdict compares the compiled step's per-device *device* bytes (`memory_report`) with the
device memory (`hardware.device_memory`, `--device-memory`, or what the accelerator reports).
A plan that does not fit gets a suggestion: config changes tried cheapest first (a higher ZeRO
stage costs only communication; rematerialisation costs compute; offload costs host transfers;
a smaller micro-batch costs throughput), each checked by compiling it. `check_fit` is given the compile: for an engine,
`jaxspeed.train.fit_check.engine_verdict` builds each candidate through `initialize`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxspeed.config import BatchSizes, Config, load_config
from jaxspeed.errors import JaxspeedError
from jaxspeed.sharding.explain import format_bytes
from pallas_kernels.backend import is_cpu

#: Activation-checkpointing policies from least to most recompute.
_REMAT_ORDER = ("none", "dots_saveable", "dots_with_no_batch_dims_saveable", "full")


class DoesNotFit(JaxspeedError):
    """`jaxspeed train` refused a plan that the compiled analysis says will not fit."""


@dataclasses.dataclass(frozen=True)
class Fit:
    """Device bytes of one compiled plan against a budget."""

    device_bytes: int
    budget: int
    overrides: tuple[str, ...] = ()
    #: Where `device_bytes` comes from: `memory_report`'s `sources["device"]` ("compiled", or
    #: "model" where XLA counts host and device memory together and offload is on).
    source: str = "compiled"

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.budget

    def describe(self) -> str:
        need, have = format_bytes(self.device_bytes), format_bytes(self.budget)
        if self.fits:
            return f"fits: {need} of {have} per device ({self.device_bytes / self.budget:.0%})"
        over = format_bytes(self.device_bytes - self.budget)
        return f"does not fit: needs {need} per device, {have} available (over by {over})"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The plan's fit, and for a plan that does not fit, the cheapest change that does."""

    fit: Fit
    suggestion: Fit | None = None
    tried: int = 0

    def message(self) -> str:
        lines = [self.fit.describe()]
        if self.fit.fits:
            return lines[0]
        if self.suggestion is None:
            lines.append(
                f"no single change or combination tried ({self.tried} compiled) fits; use more "
                f"devices, a smaller model or a shorter sequence"
            )
        else:
            sets = " ".join(f"--set {o}" for o in self.suggestion.overrides)
            lines.append(
                f"suggestion (checked by compiling; device bytes: {self.suggestion.source}; "
                f"{self.suggestion.describe()}): {sets}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        fit = dataclasses.asdict(self.fit) | {"fits": self.fit.fits}
        suggestion = None
        if self.suggestion is not None:
            suggestion = dataclasses.asdict(self.suggestion) | {"fits": self.suggestion.fits}
        return {"fit": fit, "suggestion": suggestion, "message": self.message()}


def device_memory(config: Config) -> int | None:
    """The per-device budget: `hardware.device_memory`, else what the accelerator reports.

    CPU devices report no limit, so on CPU only the config gives one.
    """
    configured = config.hardware.device_memory_bytes
    if configured is not None:
        return configured
    device = jax.local_devices()[0]
    if is_cpu(device):
        return None
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")


def candidate_changes(config: Config, batch: BatchSizes) -> list[list[str]]:
    """Single config changes that lower device memory, cheapest first."""
    zero = config.zero_optimization
    changes = [[f"zero_optimization.stage={s}"] for s in range(zero.stage + 1, 4)]
    if zero.max_live_parameters > 0:  # stage 3 gathering layer by layer, never all at once
        changes.append([*([] if zero.stage == 3 else ["zero_optimization.stage=3"]),
                        "zero_optimization.max_live_parameters=0"])
    policy = config.activation_checkpointing.policy
    if policy in _REMAT_ORDER:
        later = _REMAT_ORDER[_REMAT_ORDER.index(policy) + 1 :]
        changes += [[f"activation_checkpointing.policy={p}"] for p in later]
    if zero.offload_optimizer.device == "none":
        changes.append(["zero_optimization.offload_optimizer.device=cpu"])
    if zero.offload_optimizer.update_on != "host":
        changes.append([
            "zero_optimization.offload_optimizer.device=cpu",
            "zero_optimization.offload_optimizer.update_on=host",
        ])
    if zero.offload_param.device == "none":
        changes.append([
            *(["zero_optimization.stage=3"] if zero.stage != 3 else []),
            "zero_optimization.offload_optimizer.device=cpu",
            "zero_optimization.offload_param.device=cpu",
        ])
    changes += _smaller_micro_batches(batch)
    return changes


def _smaller_micro_batches(batch: BatchSizes) -> list[list[str]]:
    micro, accum = batch.micro_batch_per_device, batch.accumulation_steps
    out, factor = [], 2
    while micro % factor == 0:
        out.append([
            f"train_micro_batch_size_per_device={micro // factor}",
            f"gradient_accumulation_steps={accum * factor}",
        ])
        factor *= 2
    return out


def _merge(changes: Sequence[Sequence[str]]) -> list[str]:
    """Later values win, per key, keeping first-seen key order."""
    merged: dict[str, str] = {}
    for change in changes:
        for override in change:
            key, _, value = override.partition("=")
            merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]


def check_fit(
    config: Config,
    budget: int,
    *,
    batch: BatchSizes,
    device_bytes: Callable[[Config], tuple[int, str]],
    suggest: bool = True,
) -> Verdict:
    """The verdict for `config`, with a compiled suggestion when it does not fit.

    Args:
      config: the plan's config.
      budget: device memory per device, in bytes.
      batch: the plan's resolved batch sizes.
      device_bytes: compiles a config and returns its per-device device bytes and their
        source ("compiled" or "model").
      suggest: look for a change that fits when the plan does not.

    Tries each single change of `candidate_changes` in order, then the changes stacked up in
    that order, and returns the first that fits.
    """
    used, source = _bytes_source(device_bytes(config))
    fit = Fit(used, budget, source=source)
    if fit.fits or not suggest:
        return Verdict(fit)
    singles = candidate_changes(config, batch)
    stacked = [_merge(singles[: i + 1]) for i in range(1, len(singles))]
    tried = 0
    for overrides in [*singles, *stacked]:
        try:
            candidate = load_config(config, overrides=overrides)
        except JaxspeedError:  # e.g. a micro-batch the batch triple cannot take
            continue
        tried += 1
        used, source = _bytes_source(device_bytes(candidate))
        trial = Fit(used, budget, tuple(overrides), source)
        if trial.fits:
            return Verdict(fit, trial, tried)
    return Verdict(fit, None, tried)


def _bytes_source(value: tuple[int, str]) -> tuple[int, str]:
    used, source = value
    return int(used), str(source)

