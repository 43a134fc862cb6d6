"""`jaxspeed export`: consolidated full-precision params from a checkpoint, for one device.

The equivalent of DeepSpeed's `zero_to_fp32`, without the offline conversion: the params alone
are read out of the checkpoint (Orbax gathers the shards onto this host; the optimizer state
is never read) and written with Flax's msgpack serialization, loadable with
`flax.serialization.msgpack_restore`. `read_params` gives the same params, in their stored
dtype, to `export --format hf` and `sample`, from either kind of checkpoint.

A checkpoint is named by its directory (`runs/x/checkpoints`), by the run's folder (`runs/x`,
whose `checkpoints/` is meant), or by a params checkpoint (`jaxspeed import-hf`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import serialization

from jaxspeed.checkpoint import params as params_checkpoint
from jaxspeed.checkpoint.orbax_noise import orphaned_reads_quiet
from jaxspeed.checkpoint.state import Checkpointer, CheckpointError, unreadable
from jaxspeed.runtime.progress import phase

#: Where `jaxspeed train` writes a run's checkpoints, inside its output folder.
RUN_CHECKPOINTS = "checkpoints"


def checkpoint_directory(path: str | Path) -> Path:
    """The checkpoint `path` names: itself, or, for a run's folder, its `checkpoints/`.

    Raises:
      CheckpointError: `path` is not a directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if params_checkpoint.is_params_checkpoint(path) or _has_steps(path):
        return path
    inner = path / RUN_CHECKPOINTS
    return inner if inner.is_dir() else path


def _has_steps(directory: Path) -> bool:
    """Whether `directory` holds Orbax step folders (named by their step)."""
    return any(p.is_dir() and p.name.isdigit() for p in directory.iterdir())


def train_checkpoint(directory: Path) -> Checkpointer:
    """The `Checkpointer` of a train-state checkpoint directory that holds a complete step.

    Raises:
      CheckpointError: it holds none.
    """
    ckpt = Checkpointer(directory)
    if not ckpt.all_steps():
        raise CheckpointError(
            f"no complete checkpoint in {ckpt.directory} (give a run's folder, its "
            f"{RUN_CHECKPOINTS}/ folder, or an import-hf folder)")
    return ckpt


def export_params(checkpoint_dir: str | Path, out: str | Path, *, step: int | None = None) -> Path:
    """Writes the params of a `jaxspeed train` checkpoint as one msgpack file.

    Args:
      checkpoint_dir: the run's checkpoint directory (`OUTPUT/checkpoints`), or the run's
        folder (`OUTPUT`).
      out: the file to write (`.msgpack`); its folder is created.
      step: which checkpoint; default the newest complete one.

    Returns:
      The path written.
    """
    out = Path(out)
    if out.suffix != ".msgpack":
        raise CheckpointError(f"--out {out}: only .msgpack (Flax serialization) is supported")
    directory = checkpoint_directory(checkpoint_dir)
    if params_checkpoint.is_params_checkpoint(directory):
        raise CheckpointError(
            f"{directory} is an import-hf checkpoint; export it with --format hf")
    params, _, _ = read_params(directory, step=step)
    out.parent.mkdir(parents=True, exist_ok=True)
    with phase(f"export: writing {out}", quiet=True):
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", delete=False) as f:
            tmp = Path(f.name)
            try:
                f.write(serialization.msgpack_serialize(params))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        tmp.replace(out)  # never leave a half-written file under the final name
    return out


def read_params(checkpoint: str | Path, *, step: int | None = None,
                check: Callable[[dict[str, Any]], None] | None = None,
                ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The params of either kind of checkpoint, on this host in their stored dtype.

    Only the params are read: no optimizer state, no training engine.

    Args:
      checkpoint: a params checkpoint (`import-hf`), a train checkpoint directory, or a run's
        folder (see `checkpoint_directory`).
      step: a train checkpoint's step; default the newest complete one.
      check: called with the `model:` section before any array is read (it may refuse it).

    Returns:
      `(params, model, record)`: a tree of numpy arrays (memory-mapped for a params
      checkpoint), the `model:` section that shapes them, and the checkpoint's JSON record (a
      params checkpoint's, or a train checkpoint's meta, whose `config` is the run's config).
    """
    directory = checkpoint_directory(checkpoint)
    if params_checkpoint.is_params_checkpoint(directory):
        record = params_checkpoint.read_record(directory)
        if check is not None:
            check(record["model"])
        return params_checkpoint.open_params(directory), record["model"], record
    ckpt = train_checkpoint(directory)
    step = ckpt.latest_step() if step is None else step
    if step not in ckpt.all_steps():
        raise CheckpointError(
            f"--step {step}: no such checkpoint in {ckpt.directory}; found {ckpt.all_steps()}")
    meta = ckpt.read_meta(step)
    if "config" not in meta:
        raise CheckpointError(
            f"checkpoint in {ckpt.directory} has no saved config; restore it with the engine "
            "that wrote it (engine.restore)")
    if check is not None:
        check(meta["config"]["model"])
    with phase(f"reading the params of {ckpt.directory / str(step)}", quiet=True):
        params = _restore_params(ckpt.directory / str(step) / "state")
    return params, meta["config"]["model"], meta


def _restore_params(state_dir: Path) -> Any:
    """The `params` subtree of a saved `TrainState`, as numpy arrays (Orbax partial restore)."""
    reader = ocp.PyTreeCheckpointer()
    try:
        with orphaned_reads_quiet():
            saved = ocp.PyTreeCheckpointHandler().metadata(state_dir).tree["params"]
            is_leaf = lambda m: hasattr(m, "shape")  # noqa: E731
            item = {"params": jax.tree.map(lambda m: 0, saved, is_leaf=is_leaf)}
            args = {"params": jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray),
                                           saved, is_leaf=is_leaf)}
            restored = reader.restore(state_dir, args=ocp.args.PyTreeRestore(
                item=item, restore_args=args, partial_restore=True))
    except Exception as err:  # noqa: BLE001 - Orbax/TensorStore raise many kinds on bad files
        step_dir = state_dir.parent
        raise unreadable(step_dir.parent, int(step_dir.name), err) from err
    return restored["params"]

