"""`jaxspeed import-hf` and `jaxspeed export --format hf`: Llama folders in and out.

An import writes a params checkpoint (`jaxspeed.checkpoint.params`) that `train` starts from
with `checkpoint.load_from`, and records the folder's config and file layout; an export of
that checkpoint writes the same layout back, so an import followed by an export gives the
same `config.json`, safetensors files and index, byte for byte.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxspeed.checkpoint import params as params_checkpoint
from jaxspeed.checkpoint.state import CheckpointError
from jaxspeed.checkpoint.hf import files as hf_files
from jaxspeed.checkpoint.hf.config import check_exportable, hf_from_model, model_from_hf
from jaxspeed.checkpoint.hf.weights import check_names, hf_tensors, param_blocks, param_shapes

#: `--dtype` choices.
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}


def _dtype(name: str | None) -> np.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise CheckpointError(f"--dtype {name!r}: accepted values are {sorted(DTYPES)}")
    return DTYPES[name]


def import_hf(folder: str | Path, out: str | Path, *, dtype: str | None = None) -> Path:
    """Converts a Hugging Face Llama folder to a params checkpoint.

    Args:
      folder: `config.json` and `model.safetensors` (or shards with their index).
      out: the params checkpoint to write (must not exist, or be empty).
      dtype: cast the weights (`DTYPES`); default: keep the files' dtype.

    Returns:
      `out`.
    """
    folder, cast = Path(folder), _dtype(dtype)
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
    with hf_files.tensor_reader(files) as read:
        dtype = cast or read("model.norm.weight").dtype
        blocks = param_blocks(read, model, dtype=dtype, source=str(folder))
        params_checkpoint.write_params(out, param_shapes(model, dtype), blocks, model=model,
                                       extra={"source": str(folder), "hf": hf})
    return Path(out)


def _open_checkpoint(directory: Path, step: int | None) -> tuple[Any, dict[str, Any], dict | None]:
    """(params, `model:` keys, the import's HF record or None) of either kind of checkpoint.

    A params checkpoint's params are memory-mapped, read one layer at a time by the
    conversion; a train checkpoint's are restored onto this host (`export.load_trained`).
    """
    if params_checkpoint.is_params_checkpoint(directory):
        record = params_checkpoint.read_record(directory)
        check_exportable(record["model"])
        return params_checkpoint.open_params(directory), record["model"], record.get("hf")
    from jaxspeed.checkpoint.export import load_trained

    engine, state = load_trained(directory, step=step, devices=jax.devices()[:1])
    model = engine.config.to_dict()["model"]
    check_exportable(model)
    return jax.device_get(state.params), model, None


def export_hf(
    checkpoint: str | Path, out: str | Path, *, step: int | None = None, dtype: str | None = None
) -> Path:
    """Writes a checkpoint as a Hugging Face Llama folder (`config.json` + safetensors).

    Args:
      checkpoint: a params checkpoint (`import_hf`) or a `jaxspeed train` checkpoint directory.
      out: the folder to write (created; files of the same names are replaced).
      step: a train checkpoint's step; default the newest complete one.
      dtype: the saved dtype (`DTYPES`); default the checkpoint's.

    Returns:
      `out`.
    """
    checkpoint, out, cast = Path(checkpoint), Path(out), _dtype(dtype)
    if not checkpoint.is_dir():
        raise CheckpointError(f"checkpoint directory {checkpoint} does not exist")
    params, model, hf = _open_checkpoint(checkpoint, step)
    tensors = hf_tensors(params, model, dtype=cast)
    saved_dtype = {str(t.dtype) for t in tensors.values()}.pop()
    hf = hf if hf is not None and set(tensors) == {n for ns in hf["files"].values() for n in ns} else None
    out.mkdir(parents=True, exist_ok=True)
    if hf is not None and (hf["sharded"] or len(hf["files"]) > 1):
        hf_files.write_tensors(out, tensors, files=hf["files"], metadata=hf["file_metadata"],
                               index_metadata=hf["index_metadata"])
    else:
        metadata = next(iter(hf["file_metadata"].values())) if hf is not None else None
        hf_files.write_tensors(out, tensors, metadata={hf_files.SINGLE: metadata} if metadata else None)
    config = hf_from_model(model, dtype=saved_dtype, base=hf["config"] if hf is not None else None)
    hf_files.write_json(out / hf_files.CONFIG, config)
    if hf is not None and hf.get("generation_config") is not None:
        hf_files.write_json(out / hf_files.GENERATION_CONFIG, hf["generation_config"])
    return out
