"""Params-only checkpoints: weights to start a run from (`checkpoint.load_from`).

`jaxspeed import-hf` writes one: a folder with one `.npy` file per array of the params tree
(`params/layers.attn.query.npy`: the path in the tree, `.`-joined) and a JSON record
(`jaxspeed_params.json`: the `model:` section that shapes them, each array's shape and dtype,
and where they came from). A run that loads it starts at step 0 with a fresh optimizer. Each
device reads only its own slices of each array, straight into the run's planned shardings
(`jax.make_array_from_callback` over memory-mapped files), so a model larger than one device
loads sharded, never gathered. `with_checkpoint_model` makes the checkpoint's architecture
the default of a run that loads it: the `model:` keys a config leaves out come from the
record, and a key it sets must agree.

Why `.npy` files and not Orbax, which writes the train checkpoints: these are the weights of a
whole model converted in one go. A converter writes each array block by block (one layer at a
time), straight to disk (`write_params`), so the model never has to exist in memory. Orbax's
TensorStore writer copies from arrays that must first exist in memory, two more passes over
the model (its save alone ran at 1.1-1.4 GB/s on the 2-core CI machine;
`benchmarks/import_export.py`). numpy has no bfloat16 of its own, so such arrays are stored
as their bits (`uint16`) and the record names the dtype.
"""

from __future__ import annotations

import functools
import io
import json
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes  # noqa: F401 - registers bfloat16 and the float8 dtypes by name with numpy
import numpy as np
from flax import traverse_util

from jaxspeed.checkpoint import direct_io
from jaxspeed.checkpoint.state import CheckpointError
from jaxspeed.config.loading import replace_sections, validate_section
from jaxspeed.config.model import CONTEXT, FUNCTION, SHAPES, ModelConfig, architecture_keys
from jaxspeed.config.schema import Config
from jaxspeed.errors import ConfigError

RECORD = "jaxspeed_params.json"
ARRAYS = "params"
FORMAT = "jaxspeed-params"
#: Joins a params path into one file name.
SEP = "."
#: `model:` keys that decide the params' shapes; a run must agree on each.
SHAPE_KEYS = architecture_keys(SHAPES)
#: `model:` keys that change the function but not the shapes: a difference is only warned about
#: (fine-tuning to a longer context may change rope on purpose).
_SOFT_KEYS = architecture_keys(FUNCTION)


def is_params_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / RECORD).is_file()


def _stored(dtype: np.dtype) -> np.dtype:
    """The dtype an array's file holds: its own where `.npy` can name it, else its bits."""
    dtype = np.dtype(dtype)
    return dtype if dtype.kind in "biuf" and dtype.type.__module__ == "numpy" else np.dtype(f"u{dtype.itemsize}")


#: One block of an array: `fill(out)` writes it into a C-contiguous `out`.
Fill = Callable[[np.ndarray], None] | direct_io.LazyArray


def write_params(
    directory: str | Path, shapes, blocks: Mapping[str, Sequence[Fill]], *,
    model: Mapping[str, Any], extra: Mapping | None = None,
) -> Path:
    """Writes a params checkpoint, each array from its blocks, a few blocks in memory at a time.

    Each `.npy` goes straight to disk (`jaxspeed.checkpoint.direct_io`): a converter never holds the
    model, and never fills the page cache with it. The folder is written beside its final
    name and renamed when complete, so a failure never leaves a half-written checkpoint
    there. `directory` must not exist yet, or be empty.

    Args:
      directory: the params checkpoint to write.
      shapes: a tree (nested dicts) of `jax.ShapeDtypeStruct`, the params' shapes and dtypes.
      blocks: `.`-joined tree path -> its fills: one for the whole array, or one per index
        of its leading axis (a layer of the stacked layers), in order. A fill may be a
        `jaxspeed.checkpoint.direct_io.LazyArray` of its block (one that can fill rows at a time).
      model: the `model:` section that shapes them.
      extra: more keys for the record (where the params came from).

    Returns:
      `directory`.
    """
    directory = Path(directory).absolute()
    if directory.exists() and any(directory.iterdir()):
        raise CheckpointError(f"{directory} already exists and is not empty; choose another --out")
    flat = {SEP.join(path): s for path, s in traverse_util.flatten_dict(shapes).items()}
    if set(blocks) != set(flat):
        raise ValueError(f"blocks name {sorted(blocks)}, the shapes {sorted(flat)}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    # a fresh folder beside `directory`, never another writer's: renamed into place when complete
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".partial"))
    tmp = staging / directory.name
    try:
        (tmp / ARRAYS).mkdir(parents=True)
        for name, s in flat.items():
            _write_npy(tmp / ARRAYS / f"{name}.npy", s, blocks[name])
        dtypes = sorted({str(np.dtype(s.dtype)) for s in flat.values()})
        record = {
            "format": FORMAT, "model": dict(model), "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
            "arrays": {k: {"shape": list(s.shape), "dtype": str(np.dtype(s.dtype))} for k, s in flat.items()},
            **dict(extra or {}),
        }
        (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        if directory.exists():
            directory.rmdir()
        tmp.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def _write_npy(path: Path, spec, fills: Sequence[Fill]) -> None:
    """One array as `.npy` (`numpy.lib.format`'s header), from one fill, or one per index of
    its leading axis."""
    shape = tuple(spec.shape)
    if len(fills) == 1:
        block = shape
    elif shape and len(fills) == shape[0]:
        block = shape[1:]
    else:
        raise ValueError(f"{path.name}: {len(fills)} blocks; shape {shape} takes 1 or {shape[:1]}")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {
        "descr": np.lib.format.dtype_to_descr(_stored(spec.dtype)), "fortran_order": False,
        "shape": shape})
    with direct_io.writer(path) as out:
        out.put(np.frombuffer(header.getvalue(), np.uint8))
        out.put_all(fill if isinstance(fill, direct_io.LazyArray)
                    else direct_io.LazyArray(block, np.dtype(spec.dtype), fill) for fill in fills)


def save_params(directory: str | Path, params, *, model: Mapping[str, Any], extra: Mapping | None = None) -> Path:
    """Writes `params` (numpy or jax arrays) and their `model:` section under `directory`
    (see `write_params`); returns `directory`."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    flat = {SEP.join(path): x for path, x in traverse_util.flatten_dict(params).items()}
    blocks = {name: [functools.partial(_copy_whole, x)] for name, x in flat.items()}
    return write_params(directory, shapes, blocks, model=model, extra=extra)


def _copy_whole(x, out: np.ndarray) -> None:
    out[...] = jax.device_get(x)


def read_record(directory: str | Path) -> dict[str, Any]:
    """The JSON record of a params checkpoint (`model`, `dtype`, `arrays`, and what its writer
    added)."""
    path = Path(directory) / RECORD
    if not Path(directory).exists():
        raise CheckpointError(f"{directory} does not exist")
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a params checkpoint (no {RECORD}); write one with "
            "`jaxspeed import-hf`"
        )
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if record.get("format") != FORMAT or not isinstance(record.get("model"), dict) \
            or not isinstance(record.get("arrays"), dict):
        raise CheckpointError(f"{path} is not a {FORMAT} record")
    return record


def saved_shapes(directory: str | Path) -> dict[str, Any]:
    """The saved params as a tree of `jax.ShapeDtypeStruct` (from the record; no array read)."""
    arrays = read_record(directory)["arrays"]
    return traverse_util.unflatten_dict({
        tuple(k.split(SEP)): jax.ShapeDtypeStruct(tuple(a["shape"]), np.dtype(a["dtype"]))
        for k, a in arrays.items()
    })


def open_params(directory: str | Path) -> dict[str, Any]:
    """The saved params as a tree of read-only memory-mapped arrays: a slice reads only its
    own bytes."""
    record = read_record(directory)

    def load(name: str, spec: Mapping[str, Any]) -> np.ndarray:
        path = Path(directory) / ARRAYS / f"{name}.npy"
        dtype = np.dtype(spec["dtype"])
        try:
            stored = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read {path}: {err}") from err
        if stored.shape != tuple(spec["shape"]) or stored.dtype != _stored(dtype):
            raise CheckpointError(
                f"{path} holds {stored.dtype}{list(stored.shape)}, the record says "
                f"{dtype}{spec['shape']}"
            )
        return stored.view(dtype)

    return traverse_util.unflatten_dict(
        {tuple(k.split(SEP)): load(k, spec) for k, spec in record["arrays"].items()}
    )


def restore_params(directory: str | Path, target):
    """Reads the params into `target`'s shapes, dtypes (cast) and shardings.

    Args:
      directory: a params checkpoint.
      target: a tree of `jax.ShapeDtypeStruct`, e.g. the plan's abstract params. Where a leaf
        has a sharding, each device reads only its slice; where it has none, the leaf comes
        back as one numpy array.
    """
    stored = {_name(p): x for p, x in jax.tree.flatten_with_path(open_params(directory))[0]}
    wanted = {_name(p): tuple(x.shape) for p, x in jax.tree.flatten_with_path(target)[0]}
    problems = [f"{k}: saved {stored[k].shape if k in stored else 'nothing'}, model needs {s}"
                for k, s in wanted.items() if k not in stored or stored[k].shape != s]
    problems += [f"{k}: saved but not in the model" for k in stored if k not in wanted]
    if problems:
        raise CheckpointError(f"params in {directory} do not fit this model: " + "; ".join(problems[:4]))

    def read(path, want: jax.ShapeDtypeStruct):
        array = stored[_name(path)]

        def part(index) -> np.ndarray:
            return np.array(array[index], dtype=want.dtype)

        if getattr(want, "sharding", None) is None:
            return part(...)
        return jax.make_array_from_callback(want.shape, want.sharding, part)

    return jax.tree.map_with_path(read, target)


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_model(saved: Mapping[str, Any], model: Any, *, source: str) -> None:
    """Refuses a run whose `model:` section shapes params differently from the checkpoint's.

    A differing function key (`rope_theta`, `rms_norm_eps`, ...) is warned about in one line:
    `with_checkpoint_model` refuses those before a run starts; this is for callers that did
    not use it.

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
                f"but {run.get(key)!r} in this run; training with this run's value (leave "
                f"model.{key} out of the config to take the checkpoint's)", stacklevel=2,
            )


def with_checkpoint_model(config: Config) -> Config:
    """`config` with the architecture keys its `model:` leaves out taken from the record of
    its `checkpoint.load_from` (the config unchanged when it loads nothing).

    A key the config sets ("set": in the YAML/JSON, the mapping or an override; pydantic's
    `model_fields_set`) must agree with the checkpoint, except `max_seq_len` of a rotary model
    (a longer or shorter context reuses the same params). When `data.seq_len` is not set
    either and is longer than the checkpoint's `max_seq_len`, it becomes that length. Call it
    before building anything: it reads only the record.

    Raises:
      CheckpointError: `checkpoint.load_from` does not exist or is not a params checkpoint.
      ConfigError: a key the config sets differs from the checkpoint's; every such key, both
        values and the checkpoint are named.
    """
    source = config.checkpoint.load_from
    if source is None:
        return config
    if not Path(source).exists():
        raise CheckpointError(
            f"checkpoint.load_from={source} does not exist; give a params checkpoint (a folder "
            "written by `jaxspeed import-hf`)"
        )
    record = read_record(source)
    saved = {k: v for k, v in record["model"].items() if k in architecture_keys()}
    theirs = validate_section(ModelConfig, saved, at=f"model (the record of {source})")
    model, given = config.model, config.model.model_fields_set

    def value(m, key: str) -> Any:
        v = (m.n_kv_heads or m.n_heads) if key == "n_kv_heads" else getattr(m, key)
        return v.model_dump() if hasattr(v, "model_dump") else v

    free = set(architecture_keys(CONTEXT)) if theirs.positions != "learned" else set()
    conflicts = [
        f"model.{key}: the config sets {value(model, key)!r}, the checkpoint has {value(theirs, key)!r}"
        for key in saved if key in given - free and value(model, key) != value(theirs, key)
    ]
    if conflicts:
        raise ConfigError(
            f"checkpoint.load_from={source} holds another model than the config's: "
            + "; ".join(conflicts) + " (leave these keys out of model: to train the checkpoint's)"
        )
    taken = {key: saved[key] for key in saved if key not in given}
    if not taken:
        return config
    why = f"the model of checkpoint.load_from={source}"
    new_model = validate_section(
        ModelConfig, {**model.model_dump(include=given), **taken}, at=f"model (with {why})")
    sections = {"model": new_model}
    if "seq_len" not in config.data.model_fields_set and config.data.seq_len > new_model.max_seq_len:
        sections["data"] = config.data.model_copy(update={"seq_len": new_model.max_seq_len})
    return replace_sections(config, why=why, **sections)


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
