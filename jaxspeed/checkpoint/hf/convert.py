"""`jaxspeed import-hf` and `jaxspeed export --format hf`: Llama, Mistral and Qwen2 folders in
and out (`hf.config.FAMILIES`).

An import writes a params checkpoint (`jaxspeed.checkpoint.params`) that `train` starts from
with `checkpoint.load_from`, and records the folder's config and file layout; an export of
that checkpoint writes the same layout back, so an import followed by an export gives the
same `config.json`, safetensors files and index, byte for byte. A run trained from an import
(`checkpoint.load_from`) exports with the import's record too: its token ids, other config keys
and `generation_config.json` are kept.

Both write into a fresh temporary folder beside the output and rename it when complete: a
failure leaves nothing under the output's name, and nothing of anyone else's is touched. Both
refuse an output folder that is not empty (old shards or an old index beside the new files
would be read instead of them).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxspeed.checkpoint import params as params_checkpoint
from jaxspeed.checkpoint.state import CheckpointError
from jaxspeed.checkpoint.hf import files as hf_files
from jaxspeed.checkpoint.hf.config import check_exportable, hf_from_model, model_from_hf
from jaxspeed.checkpoint.hf.weights import check_names, hf_shapes, hf_tensors, param_blocks, param_shapes
from jaxspeed.runtime.progress import Progress

#: `--dtype` choices.
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}


def _dtype(name: str | None) -> np.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise CheckpointError(f"--dtype {name!r}: accepted values are {sorted(DTYPES)}")
    return DTYPES[name]


def _check_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out} already exists and is not empty; choose another --out")


@contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """Yields a path to write `out`'s folder at, inside a fresh folder beside `out`; on success
    it is renamed to `out`; the fresh folder is removed either way (`out` must not exist, or
    be an empty folder)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    try:
        yield staging / out.name
        _check_empty(out)
        if out.exists():
            out.rmdir()
        (staging / out.name).rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _counting(read: Callable[[str], Any], progress: Progress) -> Callable[[str], Any]:
    """`read`, counting each tensor the first time it is read."""
    seen: set[str] = set()
    lock = threading.Lock()  # `read` may be called from several threads at once

    def counted(name: str):
        with lock:
            if name not in seen:
                seen.add(name)
                progress.update(1)
        return read(name)

    return counted


def import_hf(folder: str | Path, out: str | Path, *, dtype: str | None = None) -> Path:
    """Converts a Hugging Face Llama folder to a params checkpoint.

    Args:
      folder: `config.json` and `model.safetensors` (or shards with their index).
      out: the params checkpoint to write (must not exist, or be empty).
      dtype: cast the weights (`DTYPES`); default: keep the files' dtype.

    Returns:
      `out`.
    """
    folder, cast, given = Path(folder), _dtype(dtype), Path(out)
    out = given.absolute()
    _check_empty(out)
    config = hf_files.read_json(folder / hf_files.CONFIG)
    model = model_from_hf(config, source=str(folder / hf_files.CONFIG))
    files, index_metadata = hf_files.tensor_files(folder)
    check_names(set(files), model, source=str(folder))
    layout: dict[str, list[str]] = {}
    for name, path in files.items():
        layout.setdefault(path.name, []).append(name)
    generation = folder / hf_files.GENERATION_CONFIG
    hf = {
        "config": config,
        "generation_config": hf_files.read_json(generation) if generation.is_file() else None,
        "files": {file: sorted(names) for file, names in layout.items()},
        "file_metadata": {file: hf_files.file_metadata(folder / file) for file in layout},
        "index_metadata": index_metadata,
        "sharded": (folder / hf_files.INDEX).is_file(),
    }
    if cast is not None:
        hf["config"] = {**config, "dtype" if "dtype" in config else "torch_dtype": str(cast)}
    counter = Progress(len(hf_shapes(model)), desc=f"import-hf {folder.name}", unit="tensor", quiet=True)
    with hf_files.tensor_reader(files) as read, _staging(out) as staging, counter as progress:
        dtype = cast or read("model.norm.weight").dtype
        blocks = param_blocks(_counting(read, progress), model, dtype=dtype, source=str(folder))
        params_checkpoint.write_params(staging, param_shapes(model, dtype), blocks, model=model,
                                       extra={"source": str(folder.absolute()), "hf": hf})
    return given


def _open_checkpoint(checkpoint: Path, step: int | None) -> tuple[Any, dict[str, Any], dict | None]:
    """(params, `model:` keys, the import's HF record or None) of either kind of checkpoint.

    A params checkpoint's params are memory-mapped, read one layer at a time by the
    conversion; a train checkpoint's are read onto this host (`export.read_params`), and the
    HF record is that of the import it started from (`checkpoint.load_from`), if any.
    """
    from jaxspeed.checkpoint.export import read_params

    params, model, record = read_params(checkpoint, step=step, check=check_exportable)
    if "config" in record:  # a train checkpoint's meta
        record = _load_from_record(record["config"])
    return params, model, record.get("hf")


def _load_from_record(config: dict[str, Any]) -> dict[str, Any]:
    """The record of the params checkpoint a run started from, or {} (none, or gone)."""
    load_from = (config.get("checkpoint") or {}).get("load_from")
    if load_from is None or not params_checkpoint.is_params_checkpoint(load_from):
        return {}
    return params_checkpoint.read_record(load_from)


def export_hf(
    checkpoint: str | Path, out: str | Path, *, step: int | None = None, dtype: str | None = None
) -> Path:
    """Writes a checkpoint as a Hugging Face Llama folder (`config.json` + safetensors).

    Args:
      checkpoint: a params checkpoint (`import_hf`), a `jaxspeed train` checkpoint directory,
        or a run's folder.
      out: the folder to write; it must not exist, or be empty (written beside it, then
        renamed).
      step: a train checkpoint's step; default the newest complete one.
      dtype: the saved dtype (`DTYPES`); default the checkpoint's.

    Returns:
      `out`.
    """
    checkpoint, given, cast = Path(checkpoint), Path(out), _dtype(dtype)
    out = given.absolute()
    _check_empty(out)
    params, model, hf = _open_checkpoint(checkpoint, step)
    tensors = hf_tensors(params, model, dtype=cast)
    saved_dtype = {str(t.dtype) for t in tensors.values()}.pop()
    names = set(tensors)
    layout = hf if hf is not None and names == {n for ns in hf["files"].values() for n in ns} else None
    with _staging(out) as staging, \
            Progress(len(tensors), desc=f"export {out.name}", unit="tensor", quiet=True) as progress:
        staging.mkdir()
        if layout is not None and (layout["sharded"] or len(layout["files"]) > 1):
            hf_files.write_tensors(staging, tensors, files=layout["files"],
                                   metadata=layout["file_metadata"],
                                   index_metadata=layout["index_metadata"], progress=progress)
        else:
            metadata = next(iter(layout["file_metadata"].values())) if layout is not None else None
            hf_files.write_tensors(staging, tensors, progress=progress,
                                   metadata={hf_files.SINGLE: metadata} if metadata else None)
        config = hf_from_model(model, dtype=saved_dtype, base=hf["config"] if hf is not None else None)
        hf_files.write_json(staging / hf_files.CONFIG, config)
        if hf is not None and hf.get("generation_config") is not None:
            hf_files.write_json(staging / hf_files.GENERATION_CONFIG, hf["generation_config"])
    return given
