"""Whether `jaxspeed train` may resume the checkpoints it finds: same run, and steps left to do.

A run resumes the newest checkpoint in its checkpoint directory only when that checkpoint was
saved with the same config, apart from the keys a resume may change (`RESUMABLE`): how long
to train, logging, checkpoint cadence, and where the state lives and how the step is laid out
(mesh, ZeRO stage, pipeline, remat, attention kernel), since a checkpoint restores onto any
mesh or ZeRO stage. The global batch may be split otherwise (micro batch × accumulation) as
long as its size is the same. `checkpoint.resume: force` resumes whenever the shapes fit.

A newest checkpoint that cannot be read (a truncated file) is set aside and the run resumes
the one before it, with a warning line; `--resume-step N` picks a checkpoint by hand. A resume
on another number of processes or devices (elastic: a lost node, a node back) says what
changed in one line (`say_elastic`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jaxspeed.checkpoint.state import Checkpointer, CheckpointError, UnreadableCheckpoint
from jaxspeed.config import BatchSizes, Config, load_config
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


def resume_point(directory: Path, ckpt_of: Callable[[Path], Checkpointer], *,
                 resume_step: int | None) -> int | None:
    """The step a run resumes: `resume_step` (`--resume-step`), else the newest complete one.

    Args:
      directory: the run's checkpoint directory (it is not created when missing).
      ckpt_of: opens the `Checkpointer` of `directory`.
      resume_step: a step picked by hand, or None.

    Raises:
      CheckpointError: no checkpoint at `resume_step`, naming the steps there are.
    """
    if not directory.exists():
        if resume_step is not None:
            raise CheckpointError(f"--resume-step {resume_step}: no checkpoints in {directory}")
        return None
    ckpt = ckpt_of(directory)
    if resume_step is None:
        return ckpt.latest_step()
    if resume_step not in ckpt.all_steps():
        raise CheckpointError(f"--resume-step {resume_step}: no checkpoint at that step in "
                              f"{ckpt.directory}; found steps {ckpt.all_steps()}")
    return resume_step


def readable_meta(ckpt: Checkpointer, step: int) -> dict[str, Any] | None:
    """The JSON record of `step`, or None when it cannot be read (`restore_readable` then falls
    back and says so)."""
    try:
        return ckpt.read_meta(step)
    except UnreadableCheckpoint:
        return None


def restore_readable(ckpt: Checkpointer, abstract_state, *, step: int, by_hand: bool,
                     check: Callable[[int, Mapping[str, Any]], None], warn: bool):
    """Restores `step`, or, when it cannot be read and was not picked by hand, the newest older
    checkpoint that can: each unreadable one is set aside as `<step>.corrupt` with a one-line
    warning. Checkpoints after the restored step are set aside too (`<step>.superseded`, when
    `--resume-step` picked an older one), so the resumed run can save those steps again.

    Args:
      ckpt: the run's checkpoints.
      abstract_state: the engine's abstract `TrainState` (its shardings).
      step: the step to resume (`resume_point`).
      by_hand: `step` came from `--resume-step`: no fallback.
      check: called with each fallback step and its record before it is restored (refuses a
        checkpoint of another run: `check_config`).
      warn: print the warnings (the main process only).

    Returns:
      `(state, meta)` of the restored step.

    Raises:
      UnreadableCheckpoint: `step` picked by hand cannot be read.
      CheckpointError: no checkpoint at or before `step` can be read (one line naming them).
    """
    candidates = [step] if by_hand else [s for s in reversed(ckpt.all_steps()) if s <= step]
    bad: list[UnreadableCheckpoint] = []
    for candidate in candidates:
        try:
            if candidate != step:
                check(candidate, ckpt.read_meta(candidate))
            state, meta = ckpt.restore(abstract_state, step=candidate)
        except UnreadableCheckpoint as err:
            if by_hand:
                raise
            bad.append(err)
            continue
        _set_aside_later(ckpt, candidate, bad, warn=warn)
        return state, meta
    steps = " and ".join(f"step {err.step}" for err in bad)
    raise CheckpointError(f"no readable checkpoint in {ckpt.directory}: {steps} cannot be read "
                          f"(use another --output to start afresh); {bad[-1]}")


def _set_aside_later(ckpt: Checkpointer, restored: int, bad: list[UnreadableCheckpoint], *,
                     warn: bool) -> None:
    """Sets aside the unreadable checkpoints and any after `restored`, one warning line each."""
    unreadable = {err.step: err for err in bad}
    for later in [s for s in ckpt.all_steps() if s > restored]:
        reason = "corrupt" if later in unreadable else "superseded"
        path = ckpt.set_aside(later, reason=reason)
        if not warn:
            continue
        if later in unreadable:
            line = f"{unreadable[later]}; set aside as {path}; resuming step {restored}"
        else:
            line = (f"resuming step {restored} (--resume-step): the later checkpoint of step "
                    f"{later} is set aside as {path}")
        print(f"jaxspeed train: warning: {line}", file=sys.stderr)


def say_elastic(meta: Mapping[str, Any], *, step: int, processes: int, devices: int,
                sizes: BatchSizes) -> None:
    """One line on stderr when a run resumes the checkpoint `meta` on another number of
    processes or devices than saved it: the global batch kept, and how it is split now.

    Args:
      meta: the checkpoint's JSON record (`processes`, `devices`, `micro_batch_per_device`,
        `accumulation_steps`: a checkpoint saved before they were recorded says nothing).
      step: the resumed step.
      processes, devices, sizes: this run's process and device counts and batch sizes.
    """
    if "devices" not in meta or (meta["processes"], meta["devices"]) == (processes, devices):
        return
    print(f"jaxspeed train: elastic resume of step {step}: {meta['processes']} processes, "
          f"{meta['devices']} devices -> {processes} processes, {devices} devices; global batch "
          f"{sizes.train_batch_size} kept (micro batch per device x accumulation: "
          f"{meta['micro_batch_per_device']} x {meta['accumulation_steps']} -> "
          f"{sizes.micro_batch_per_device} x {sizes.accumulation_steps}); the data order "
          f"continues", file=sys.stderr)
