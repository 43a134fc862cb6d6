"""Params-only checkpoints: weights to start a run from (`checkpoint.load_from`).

`jaxspeed import-hf` writes one: a folder with the params in Orbax's format (`params/`) and a
JSON record (`jaxspeed_params.json`: the `model:` section that shapes them, and where they came
from). A run that loads it starts at step 0 with a fresh optimizer; Orbax reads each array
straight into the run's planned shardings, so a model larger than one device loads sharded,
never gathered.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxspeed.checkpoint import CheckpointError

RECORD = "jaxspeed_params.json"
FORMAT = "jaxspeed-params"
#: `model:` keys that decide the params' shapes; a run must agree on each.
SHAPE_KEYS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "norm", "mlp",
    "positions", "tie_embeddings",
)
#: `model:` keys that change the function but not the shapes: a difference is only warned about
#: (fine-tuning to a longer context may change rope on purpose).
_SOFT_KEYS = ("rope_theta", "rope_scaling", "rms_norm_eps")


def is_params_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / RECORD).is_file()


def save_params(directory: str | Path, params, *, model: Mapping[str, Any], extra: Mapping | None = None) -> Path:
    """Writes `params` (numpy or jax arrays) and their `model:` section under `directory`.

    The folder is written beside its final name and renamed when complete, so a crash never
    leaves a half-written checkpoint there. `directory` must not exist yet, or be empty.
    """
    directory = Path(directory).absolute()
    if directory.exists() and any(directory.iterdir()):
        raise CheckpointError(f"{directory} already exists and is not empty; choose another --out")
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp / "params", params)
    dtypes = sorted({str(np.dtype(x.dtype)) for x in jax.tree.leaves(params)})
    record = {"format": FORMAT, "model": dict(model), "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
              **dict(extra or {})}
    (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    if directory.exists():
        directory.rmdir()
    tmp.rename(directory)
    return directory


def read_record(directory: str | Path) -> dict[str, Any]:
    """The JSON record of a params checkpoint (`model`, `dtype`, and what its writer added)."""
    path = Path(directory) / RECORD
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a params checkpoint (no {RECORD}); write one with "
            "`jaxspeed import-hf`"
        )
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if record.get("format") != FORMAT or not isinstance(record.get("model"), dict):
        raise CheckpointError(f"{path} is not a {FORMAT} record")
    return record


def saved_shapes(directory: str | Path) -> dict[str, Any]:
    """The saved params as a tree of `jax.ShapeDtypeStruct` (no sharding, nothing read)."""
    try:
        with ocp.StandardCheckpointer() as ckpt:
            tree = ckpt.metadata(Path(directory).absolute() / "params").item_metadata.tree
    except Exception as err:  # noqa: BLE001 - Orbax raises many kinds on a bad folder
        raise CheckpointError(f"cannot read {directory}/params: {type(err).__name__}: {err}") from err
    return jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree,
        is_leaf=lambda m: hasattr(m, "shape"),
    )


def restore_params(directory: str | Path, target):
    """Reads the params into `target`'s shapes, dtypes (cast) and shardings.

    Args:
      directory: a params checkpoint.
      target: a tree of `jax.ShapeDtypeStruct` with shardings, e.g. the plan's abstract params.
    """
    saved = {_name(p): tuple(x.shape) for p, x in jax.tree.flatten_with_path(saved_shapes(directory))[0]}
    wanted = {_name(p): tuple(x.shape) for p, x in jax.tree.flatten_with_path(target)[0]}
    problems = [f"{k}: saved {saved.get(k, 'nothing')}, model needs {s}"
                for k, s in wanted.items() if saved.get(k) != s]
    problems += [f"{k}: saved but not in the model" for k in saved if k not in wanted]
    if problems:
        raise CheckpointError(f"params in {directory} do not fit this model: " + "; ".join(problems[:4]))
    try:
        with ocp.StandardCheckpointer() as ckpt:
            return ckpt.restore(Path(directory).absolute() / "params", target)
    except Exception as err:  # noqa: BLE001 - Orbax/TensorStore raise many kinds on bad files
        raise CheckpointError(f"cannot restore {directory}/params: {type(err).__name__}: {err}") from err


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_model(saved: Mapping[str, Any], model: Any, *, source: str) -> None:
    """Refuses a run whose `model:` section shapes params differently from the checkpoint's.

    Args:
      saved: the checkpoint's `model:` keys.
      model: the run's `model:` section (`jaxspeed.config.ModelConfig`).
      source: the checkpoint, named in the error.
    """
    run = model.model_dump(mode="json") if hasattr(model, "model_dump") else dict(model)
    for side in (run, saved := dict(saved)):
        side["n_kv_heads"] = side.get("n_kv_heads") or side.get("n_heads")
    diffs = [f"model.{k}: checkpoint has {saved[k]!r}, this run has {run.get(k)!r}"
             for k in SHAPE_KEYS if k in saved and saved[k] != run.get(k)]
    if diffs:
        raise CheckpointError(
            f"checkpoint.load_from={source} does not fit this run's model: " + "; ".join(diffs)
            + f" (set the run's model: section to the checkpoint's: {RECORD})"
        )
    for key in _SOFT_KEYS:
        if key in saved and saved[key] != run.get(key):
            warnings.warn(
                f"checkpoint.load_from={source}: model.{key} is {saved[key]!r} in the checkpoint "
                f"but {run.get(key)!r} in this run", stacklevel=2,
            )


def start_from(engine, directory: str | Path, rng: jax.Array):
    """A step-0 `TrainState` of `engine` whose params are read from a params checkpoint.

    The run's `model:` must shape the params as the checkpoint's does (`check_model`); the
    params are restored into `engine.plan.params` (each device reads only its shards) and the
    optimizer state is fresh.
    """
    record = read_record(directory)
    check_model(record["model"], engine.config.model, source=str(directory))
    target = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        engine.fns.abstract_params, engine.plan.params,
    )
    return engine.init(rng, params=restore_params(directory, target))
