"""Reading and writing a Hugging Face model folder: `config.json` and safetensors files.

A folder holds either one `model.safetensors` or shards listed by
`model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {name: file}}`). JSON is
written as transformers writes it (sorted keys, indent 2, a final newline). Safetensors files
are read through the `safetensors` package, and written as it writes them (tensors ordered by
dtype and name: the same tensors with the same metadata give the same bytes): straight to disk
by `jaxspeed.checkpoint.hf.safetensors_direct` where a file has one dtype, else by the package itself.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors
import safetensors.numpy

from jaxspeed.checkpoint.state import CheckpointError
from jaxspeed.checkpoint.direct_io import LazyArray
from jaxspeed.checkpoint.hf import safetensors_direct

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: HF's metadata on every file it saves from PyTorch (`from_pretrained` checks `format`).
FILE_METADATA = {"format": "pt"}
# safetensors dtypes its numpy backend reads (BF16 as `ml_dtypes.bfloat16`, which jax registers);
# the others (F8_*) are read through its Flax backend.
_NUMPY_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def tensor_files(folder: Path) -> tuple[dict[str, Path], dict[str, Any] | None]:
    """`({tensor name: file}, index metadata or None)` of a folder, from its index if any."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a directory")
    if (folder / INDEX).is_file():
        index = read_json(folder / INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{folder / INDEX}: no weight_map")
        return {name: folder / file for name, file in weight_map.items()}, index.get("metadata")
    files = [folder / SINGLE] if (folder / SINGLE).is_file() else sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise CheckpointError(
            f"{folder}: expected {SINGLE}, or shards listed in {INDEX}; found "
            f"{[f.name for f in files] or 'no .safetensors file'}"
        )
    with _open(files[0]) as f:
        return {name: files[0] for name in f.offset_keys()}, None


def _open(path: Path, framework: str = "np"):
    try:
        return safetensors.safe_open(str(path), framework=framework)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError: a bad file either way
        raise CheckpointError(f"{path} is not a valid safetensors file: {err}") from err


class Tensor:
    """One tensor of a safetensors file, read only where indexed: `t[a:b]` reads those rows,
    `np.asarray(t)` all of it."""

    def __init__(self, path: Path, name: str, handle, whole: Callable[[], np.ndarray] | None):
        self.path, self.name, self._slice, self._whole = path, name, handle.get_slice(name), whole
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index) -> np.ndarray:
        try:
            return self._whole()[index] if self._whole is not None else self._slice[index]
        except Exception as err:  # noqa: BLE001 - truncated or malformed tensor data
            raise CheckpointError(f"{self.path}: cannot read tensor {self.name}: {err}") from err

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[...] if self.shape else self[()]
        return whole if dtype is None else whole.astype(dtype)

    @property
    def dtype(self) -> np.dtype:
        return self[:0].dtype if self.shape else np.asarray(self).dtype


@contextmanager
def tensor_reader(files: Mapping[str, Path]) -> Iterator[Callable[[str], Tensor]]:
    """A function `name -> Tensor` over the folder's files, each opened once; it may be called
    from several threads at once.

    bfloat16 comes through safetensors' numpy backend as `ml_dtypes.bfloat16`; fp8, which that
    backend lacks, through its Flax backend onto the host CPU (read whole).
    """
    with ExitStack() as stack:
        handles: dict[Any, Any] = {}
        cpu = jax.local_devices(backend="cpu")[0]
        opening = threading.Lock()

        def handle(path: Path, framework: str = "np"):
            with opening:
                if (path, framework) not in handles:
                    handles[path, framework] = stack.enter_context(_open(path, framework))
                return handles[path, framework]

        def through_flax(path: Path, name: str) -> np.ndarray:
            with jax.default_device(cpu):
                return np.asarray(handle(path, "flax").get_tensor(name))

        def read(name: str) -> Tensor:
            path = files[name]
            f = handle(path)
            try:
                numpy_reads = f.get_slice(name).get_dtype() in _NUMPY_DTYPES
            except Exception as err:  # noqa: BLE001 - a malformed header entry
                raise CheckpointError(f"{path}: cannot read tensor {name}: {err}") from err
            return Tensor(path, name, f, None if numpy_reads else partial(through_flax, path, name))

        yield read


def file_metadata(path: Path) -> dict[str, str] | None:
    with _open(path) as f:
        return f.metadata()


def _counted(tensor, progress, lock: threading.Lock):
    """A `LazyArray` that counts itself on `progress` the first time it is converted (from
    any of the writer's threads; `lock` guards the count)."""
    if progress is None or not isinstance(tensor, LazyArray):
        return tensor
    started = []

    def first(fn):
        def call(*args):
            with lock:
                if not started:
                    started.append(True)
                    progress.update(1)
            return fn(*args)
        return call

    rows = None if tensor.fill_rows is None else first(tensor.fill_rows)
    return dataclasses.replace(tensor, fill=first(tensor.fill), fill_rows=rows)


def write_tensors(
    folder: Path,
    tensors: Mapping[str, np.ndarray | LazyArray],
    *,
    files: Mapping[str, list[str]] | None = None,
    metadata: Mapping[str, Mapping[str, str] | None] | None = None,
    index_metadata: Mapping[str, Any] | None = None,
    progress=None,
) -> list[Path]:
    """Writes tensors as one `model.safetensors`, or as the shards `files` lists (with index).

    Args:
      folder: where to write (exists).
      tensors: name -> numpy array, or a `LazyArray` converted as it is written.
      files: file name -> tensor names (a layout read by an import); default one file.
      metadata: file name -> its safetensors metadata; default `FILE_METADATA`.
      index_metadata: the index's `metadata` keys to keep; `total_size` and
        `total_parameters` are recomputed.
      progress: a `jaxspeed.runtime.progress.Progress` counting tensors, or None.

    Returns:
      The files written.
    """
    files = dict(files or {SINGLE: sorted(tensors)})
    metadata = metadata or {}
    written, lock = [], threading.Lock()
    for file, names in files.items():
        path = folder / file
        tmp = path.with_name(path.name + ".tmp")
        chunk = {name: _counted(tensors[name], progress, lock) for name in names}
        meta = dict(metadata.get(file, FILE_METADATA) or {}) or None
        try:
            if safetensors_direct.supported(chunk, meta):
                safetensors_direct.write_file(tmp, chunk, meta)
            else:
                safetensors.numpy.save_file(
                    {k: v.materialize() if isinstance(v, LazyArray) else v for k, v in chunk.items()},
                    str(tmp), metadata=meta)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(path)
        if progress is not None:  # the plain copies, counted once their file is written
            progress.update(sum(not isinstance(tensors[name], LazyArray) for name in names))
        written.append(path)
    if len(files) > 1 or files.keys() != {SINGLE}:
        index = {k: v for k, v in (index_metadata or {}).items()}
        index["total_size"] = int(sum(t.nbytes for t in tensors.values()))
        if "total_parameters" in index or index_metadata is None:
            index["total_parameters"] = int(sum(t.size for t in tensors.values()))
        weight_map = {name: file for file, names in files.items() for name in names}
        write_json(folder / INDEX, {"metadata": index, "weight_map": dict(sorted(weight_map.items()))})
        written.append(folder / INDEX)
    return written
