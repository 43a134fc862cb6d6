"""Whether `jaxspeed train` may resume the checkpoints it finds: same run, and steps left to do.

A run resumes the newest checkpoint in its checkpoint directory only when that checkpoint was
saved with the same config, apart from the keys a resume may change (`RESUMABLE`): how long
to train, logging, checkpoint cadence, and where the state lives and how the step is laid out
(mesh, ZeRO stage, pipeline, remat, attention kernel), since a checkpoint restores onto any
mesh or ZeRO stage. The global batch may be split otherwise (micro batch × accumulation) as
long as its size is the same. `checkpoint.resume: force` resumes whenever the shapes fit.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxspeed.config import Config, load_config
from jaxspeed.errors import ConfigError, JaxspeedError

#: Config keys (and key prefixes, ending in ".") a resumed run may change.
RESUMABLE: tuple[str, ...] = (
    "steps", "logging.", "checkpoint.", "hardware.", "mesh.", "zero_optimization.", "pipeline.",
    "activation_checkpointing.", "model.attention.", "model.sequence_parallel.",
    "data.workers", "data.cache_dir",
)
#: How the global batch is given; compared as the resolved size when the checkpoint has it.
BATCH_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_device", "gradient_accumulation_steps")
#: Differences named in the refusal before "and N more".
SHOWN = 4


class ResumeRefused(JaxspeedError):
    """The checkpoints in the run's directory belong to a run with another config."""


class NothingToTrain(JaxspeedError):
    """The checkpoint is already past the requested number of steps."""


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """`{"optimizer.params.lr": 0.001, ...}`: the leaves of nested dicts by dotted key path."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out.update(_flat(value, path) if isinstance(value, Mapping) and value else {path: value})
    return out


def _resumable(path: str, ignored: tuple[str, ...]) -> bool:
    return any(path == key or (key.endswith(".") and path.startswith(key)) for key in ignored)


def _normalized(saved: Mapping[str, Any]) -> Mapping[str, Any]:
    """The saved config with today's defaults filled in (keys added since it was saved)."""
    try:
        return load_config(dict(saved)).to_dict()
    except ConfigError:  # saved by a version with keys this one does not know: compare as is
        return saved


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any], *,
                   ignored: tuple[str, ...] = RESUMABLE) -> list[tuple[str, Any, Any]]:
    """`(key path, saved value, current value)` for each key that differs, outside `ignored`."""
    old, new = _flat(_normalized(saved)), _flat(current)
    missing = "(missing)"
    return [
        (path, old.get(path, missing), new.get(path, missing))
        for path in sorted(old.keys() | new.keys())
        if not _resumable(path, ignored) and old.get(path, missing) != new.get(path, missing)
    ]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."


def check_config(config: Config, meta: Mapping[str, Any], *, global_batch: int,
                 directory: Path, step: int, warn: bool = True) -> None:
    """Refuses to resume a checkpoint saved with another config (unless `checkpoint.resume`
    is `force`); a checkpoint without a saved config resumes with a warning.

    Args:
      config: this run's config.
      meta: the checkpoint's JSON record (`config`, and `global_batch` when saved by a loop
        that records it).
      global_batch: this run's resolved global batch size.
      directory, step: the checkpoint, for the message.
      warn: print the warning (the main process only).

    Raises:
      ResumeRefused: one line naming the differing keys and how to start afresh or force it.
    """
    if config.checkpoint.resume == "force":
        return
    saved = meta.get("config")
    if not isinstance(saved, Mapping):
        if warn:
            print(f"jaxspeed train: warning: checkpoint {directory / str(step)} has no saved "
                  f"config; resuming without checking that it is from the same run",
                  file=sys.stderr)
        return
    ignored = RESUMABLE
    changes = []
    if "global_batch" in meta:
        ignored += BATCH_KEYS
        if meta["global_batch"] != global_batch:
            changes.append(("train_batch_size", meta["global_batch"], global_batch))
    changes += config_changes(saved, config.to_dict(), ignored=ignored)
    if not changes:
        return
    named = ", ".join(f"{k} {_short(a)} -> {_short(b)}" for k, a, b in changes[:SHOWN])
    more = f" and {len(changes) - SHOWN} more" if len(changes) > SHOWN else ""
    raise ResumeRefused(
        f"checkpoint {directory / str(step)} was saved by a run with another config ({named}"
        f"{more}); to start afresh use another --output (or delete {directory}), or to resume "
        f"it anyway --set checkpoint.resume=force"
    )


def check_steps(step: int, steps: int, *, directory: Path) -> bool:
    """Whether any step is left to train after the checkpoint at `step`.

    Returns False when the checkpoint is exactly at `steps` (the run is complete: running it
    again, e.g. a requeued job, is not an error).

    Raises:
      NothingToTrain: the checkpoint is past `steps` (the request cannot be what was meant).
    """
    if step > steps:
        raise NothingToTrain(
            f"checkpoint {directory / str(step)} is at step {step}, past steps={steps}; nothing "
            f"to train (set --steps above {step} to continue it, or use another --output to "
            f"start afresh)"
        )
    return step < steps
