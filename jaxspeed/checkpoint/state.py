"""Orbax checkpoints: atomic (async) saves, resume, and restore onto any mesh or ZeRO stage.

A checkpoint holds the whole `TrainState` (params, optimizer state with loss-scale state, step,
RNG) plus a JSON record (config, data position). Orbax writes each step to a temporary folder
and renames it when complete, so a crash mid-save leaves the previous checkpoints intact and
the partial one is ignored. Restoring reads into an abstract state that carries the *current*
engine's shardings, so a checkpoint saved on one mesh / ZeRO stage / TP degree restores onto
another in one call, with no conversion step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxspeed.errors import JaxspeedError
from jaxspeed.tree_paths import key_names


class CheckpointError(JaxspeedError):
    """A checkpoint is missing, corrupt, or does not fit the model being restored."""


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
    return ".".join(key_names(path))


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
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_saveable(state)),
                meta=ocp.args.JsonSave(meta or {}),
            ),
            force=True,
        )
        return step

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
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as err:  # noqa: BLE001 - Orbax/TensorStore raise many kinds on bad files
            raise CheckpointError(
                f"cannot restore {self.directory / str(step)}: {type(err).__name__}: {err}"
            ) from err
        state = restored["state"]
        state = state.replace(rng=jax.random.wrap_key_data(state.rng))
        return state, dict(restored["meta"] or {})

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON record saved beside a step (config, data position)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, FileNotFoundError, OSError) as err:
            raise CheckpointError(f"cannot read {self.directory / str(step)}: {err}") from err
        return dict(restored["meta"] or {})

    def _check_shapes(self, step: int, target) -> None:
        """Names the leaves whose saved shape differs from the model's (or that are missing)."""
        try:
            saved_tree = self._manager.item_metadata(step)["state"]
        except Exception as err:  # noqa: BLE001 - any unreadable metadata is a bad checkpoint
            raise CheckpointError(
                f"cannot read checkpoint {self.directory / str(step)}: {type(err).__name__}: {err}"
            ) from err
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
        """Blocks until any async save has finished (and is complete on disk)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
