"""Orbax checkpoints: atomic (async) saves, resume, and restore onto any mesh or ZeRO stage.

A checkpoint holds the whole `TrainState` (params, optimizer state with loss-scale state, step,
RNG) plus a JSON record (config, data position). Orbax writes each step to a temporary folder
and renames it when complete, so a crash mid-save leaves the previous checkpoints intact and
the partial one is ignored. Restoring reads into an abstract state that carries the *current*
engine's shardings, so a checkpoint saved on one mesh / ZeRO stage / TP degree restores onto
another in one call, with no conversion step.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxspeed.checkpoint.orbax_noise import (
    failed_write, orphaned_reads_quiet, quiet_storage_errors, storage_reason, torn_file)
from jaxspeed.errors import JaxspeedError


class CheckpointError(JaxspeedError):
    """A checkpoint is missing, corrupt, or does not fit the model being restored."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint step whose files cannot be read (truncated, corrupt, missing).

    Attributes:
      step: the step that cannot be read.
    """

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


class SaveFailedOnAProcess(CheckpointError):
    """A save failed on a process of a multi-process run, and every process stops.

    The processes whose own writes went through wait for the failed one at Orbax's barrier in
    a background thread, until Orbax's timeout (300 s). Python would join that thread before
    it exits, so the CLI ends such a process with `os._exit` once its line is printed
    (`exit_now`). Nothing is lost: the failed step was never committed, and older checkpoints
    are intact.
    """

    exit_now = True


#: TensorStore names the array it read as its key in the OCDBT database: `"params.x/0.1"`.
_ARRAY_KEY = re.compile(r'Error reading "([^"/]+)/')
_ARRAY_SPEC = re.compile(r"""['"]path['"]: ?['"]([^'"/]+)/['"]""")
#: Orbax appends the whole TensorStore spec (a JSON dump) to some messages.
_SPEC_SUFFIX = re.compile(r"\s*\[tensorstore_spec=.*$", re.DOTALL)


def _innermost(err: BaseException) -> BaseException:
    """The first exception of `err`'s chain: TensorStore's own, under Orbax's wrappers."""
    seen = {id(err)}
    while (inner := err.__cause__ or err.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        err = inner
    return err


def unreadable(directory: Path, step: int, err: BaseException) -> UnreadableCheckpoint:
    """One line for a step Orbax failed to read: the step, the array, TensorStore's reason.

    Orbax wraps TensorStore's error (which names the file and the byte range) in one that
    prints the array's whole TensorStore spec, about 60 lines; the line keeps the reason.
    """
    texts = []
    cause: BaseException | None = err
    while cause is not None and len(texts) < 8:
        texts.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    arrays = [m.group(1) for text in texts for m in (_ARRAY_KEY.search(text), _ARRAY_SPEC.search(text)) if m]
    root = _innermost(err)
    reason = " ".join(_SPEC_SUFFIX.sub("", str(root)).split())
    array = f" (array {arrays[0]})" if arrays else ""
    why = torn_file(reason)
    if why is None:
        why = f"{type(root).__name__}: " + (reason if len(reason) <= 400 else reason[:397] + "...")
    return UnreadableCheckpoint(f"checkpoint step {step} in {directory} cannot be read{array}: {why}",
                                step=step)


def _saveable(state):
    """Orbax stores plain arrays: the typed PRNG key goes in as its raw key data."""
    return state.replace(rng=jax.random.key_data(state.rng))


def _saveable_abstract(abstract_state):
    rng = abstract_state.rng
    data = jax.eval_shape(jax.random.key_data, rng)
    return abstract_state.replace(
        rng=jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=rng.sharding)
    )


def _dotted(path) -> str:
    """Orbax's leaf name for a key path: 'opt_state.0.mu.embedding'."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _target_shapes(tree) -> dict[str, tuple]:
    return {_dotted(path): tuple(leaf.shape) for path, leaf in jax.tree.flatten_with_path(tree)[0]}


def _saved_shapes(metadata_tree) -> dict[str, tuple]:
    leaves = jax.tree.leaves(metadata_tree, is_leaf=lambda m: hasattr(m, "shape"))
    return {m.name: tuple(m.shape) for m in leaves if hasattr(m, "shape")}


class Checkpointer:
    """Saves and restores train states under one directory (a thin shell over Orbax).

    Args:
      directory: where step folders go (created if missing).
      keep: how many complete checkpoints to keep (older ones are deleted).
      async_save: write in a background thread; `save` returns once arrays are copied off
        the devices.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._saving: int | None = None  # the step of the newest save started
        self._failed: BaseException | None = None  # its error, once its background part failed
        self._watcher: threading.Thread | None = None  # waits for it (`_watch`)
        self._abandoned = False  # a save failed elsewhere: stop waiting for ours
        self._logged = quiet_storage_errors()  # Orbax's failed writes logged before ours
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, state, *, meta: dict[str, Any] | None = None) -> int:
        """Saves `state` at `state.step` (asynchronously when enabled). Returns the step."""
        step = int(jax.device_get(state.step))
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(_saveable(state)),
                    meta=ocp.args.JsonSave(meta or {}),
                ),
                force=True,
            )
        except (OSError, ValueError) as err:  # disk full, read-only, a file for a folder
            if storage_reason(err) is None:
                raise
            # an async save of an earlier step may be the one that failed: Orbax raises its
            # error when the next save waits for it
            raise self._save_failed(step, err) from err
        self._saving, self._failed = step, None
        self._watcher = threading.Thread(target=self._watch, name="jaxspeed-save-watch", daemon=True)
        self._watcher.start()
        return step

    def _watch(self) -> None:
        """Waits for the save just started, in a daemon thread, and keeps its error: Orbax
        raises it only when the next save waits, steps later, and on that process alone."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - `failure` reports it, whatever it is
            self._failed = err

    @property
    def saving(self) -> int | None:
        """The step of the newest save this checkpointer started (it may still run)."""
        return self._saving

    @property
    def in_progress(self) -> bool:
        """Whether the newest save is still being written (here; it may have failed elsewhere)."""
        return self._watcher is not None and self._watcher.is_alive() and self.failure() is None

    def failure(self) -> BaseException | None:
        """The newest save's error if its background part failed (without waiting for it):
        a `CheckpointError` when the storage refused it, else Orbax's own error; None while it
        runs or once it succeeded. The loop checks it each step, so every process stops at
        the next step, not at the next save."""
        err = self._failed or failed_write(self.directory, since=self._logged)
        if err is None or isinstance(err, CheckpointError):
            return err
        self._failed = err
        if storage_reason(err) is not None:
            self._failed = self._save_failed(self._saving, err)
            self._failed.__cause__ = err
        return self._failed

    def abandon(self) -> None:
        """Stops waiting for background saves (`wait`, `close`): one failed on another process,
        and ours wait at Orbax's barrier for that one until Orbax's timeout."""
        self._abandoned = True

    def _save_failed(self, step: int, err: Exception) -> CheckpointError:
        """One line: the step not saved, why, and the newest checkpoint that is intact."""
        self._manager.reload()  # the failed step's partial folder is not a checkpoint
        saved = self.all_steps()
        if self._saving is not None and self._saving not in saved:
            step = self._saving  # the background save failed, not this one
        return CheckpointError(
            f"cannot save step {step} in {self.directory}: {storage_reason(err)} ({self.intact(step)})")

    def intact(self, failed: int) -> str:
        """Which checkpoint survives a failed save of step `failed`, in words."""
        done = [s for s in self.all_steps() if s != failed]
        return f"step {done[-1]} is the newest intact one" if done else "no checkpoint was saved before it"

    def restore(self, abstract_state, *, step: int | None = None):
        """Restores into `abstract_state`'s shapes and shardings (any mesh, any ZeRO stage).

        Args:
          abstract_state: a `TrainState` of `ShapeDtypeStruct`s with shardings, e.g.
            `engine.abstract_state()`.
          step: which step; default the newest complete one.

        Returns:
          `(state, meta)`.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step not in self.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; found {self.all_steps()}"
            )
        target = _saveable_abstract(abstract_state)
        self._check_shapes(step, target)
        try:
            with orphaned_reads_quiet():
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                    ),
                )
        except Exception as err:  # noqa: BLE001 - Orbax/TensorStore raise many kinds on bad files
            raise unreadable(self.directory, step, err) from err
        state = restored["state"]
        state = state.replace(rng=jax.random.wrap_key_data(state.rng))
        return state, dict(restored["meta"] or {})

    def set_aside(self, step: int, *, reason: str) -> Path:
        """Renames step `step`'s folder to `<step>.<reason>` (`.1`, `.2`, ... if taken), where
        Orbax no longer sees it, so a resumed run can save that step again. Returns the path.

        Only the first process renames; the others wait for it.
        """
        self._manager.wait_until_finished()
        source = self.directory / str(step)
        target = self.directory / f"{step}.{reason}"
        n = 0
        while target.exists():
            n += 1
            target = self.directory / f"{step}.{reason}.{n}"
        if jax.process_index() == 0:
            source.rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxspeed set aside {source}")
        self._manager.reload()
        return target

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON record saved beside a step (config, data position)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, FileNotFoundError, OSError) as err:
            raise unreadable(self.directory, step, err) from err
        return dict(restored["meta"] or {})

    def _check_shapes(self, step: int, target) -> None:
        """Names the leaves whose saved shape differs from the model's (or that are missing)."""
        try:
            with orphaned_reads_quiet():
                saved_tree = self._manager.item_metadata(step)["state"]
        except Exception as err:  # noqa: BLE001 - any unreadable metadata is a bad checkpoint
            raise unreadable(self.directory, step, err) from err
        if saved_tree is None:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} has no state")
        saved = _saved_shapes(saved_tree)
        wanted = _target_shapes(target)
        problems = [
            f"{key}: saved {saved.get(key, 'nothing')}, model needs {shape}"
            for key, shape in wanted.items()
            if saved.get(key) != shape
        ]
        problems += [f"{key}: saved but not in the model" for key in saved if key not in wanted]
        if problems:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} does not fit this model: "
                + "; ".join(problems[:8]) + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
            )

    def wait(self) -> None:
        """Blocks until any async save has finished (and is complete on disk).

        Raises:
          CheckpointError: the background save failed (disk full, ...).
        """
        if self._abandoned:
            return
        try:
            self._manager.wait_until_finished()
        except (OSError, ValueError) as err:
            if storage_reason(err) is None:
                raise
            raise self._save_failed(self._saving, err) from err

    def close(self) -> None:
        if self._abandoned:
            return
        self._manager.wait_until_finished()
        self._manager.close()
