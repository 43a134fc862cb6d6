"""`jaxspeed.checkpoint.hf.safetensors_direct` writes the bytes `safetensors.numpy.save_file` writes."""

import os
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from jaxspeed.checkpoint.hf import files as hf_files
from jaxspeed.checkpoint import direct_io
from jaxspeed.checkpoint.hf import safetensors_direct
from jaxspeed.checkpoint.direct_io import LazyArray
from jaxspeed.checkpoint.hf.safetensors_direct import write_file


def _tensors(dtype, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {f"layer.{i}.w": (rng.random((int(rng.integers(1, 200)), int(rng.integers(1, 700)))) * 100
                            ).astype(dtype) for i in range(6)}
    out["é_unicode"] = np.arange(3).astype(dtype)
    out["empty"] = np.zeros((0, 4), dtype)
    # Bigger than the staging buffer: the stream wraps around both buffers several times.
    out["big"] = (rng.random((direct_io.CHUNK // 1000 + 7, 1000)) * 100).astype(dtype)
    return out


def _lazy(array: np.ndarray) -> LazyArray:
    return LazyArray(array.shape, array.dtype, lambda out: np.copyto(out, array))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int64, np.uint8, np.bool_])
@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_same_bytes_as_safetensors(tmp_path, dtype, metadata):
    tensors = _tensors(dtype)
    mixed = {k: _lazy(v) if i % 2 else v for i, (k, v) in enumerate(tensors.items())}
    write_file(tmp_path / "ours.safetensors", mixed, metadata)
    safetensors.numpy.save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata=metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_without_direct_io_the_same_bytes(monkeypatch):
    """tmpfs refuses O_DIRECT: the same stream goes through ordinary writes."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    tensors = _tensors(np.float32, seed=1)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        write_file(Path(folder) / "ours.safetensors", tensors, {"format": "pt"})
        ours = (Path(folder) / "ours.safetensors").read_bytes()
    assert ours == safetensors.numpy.save(tensors, metadata={"format": "pt"})


def test_unsupported_files_go_through_safetensors(tmp_path):
    """Two dtypes in one file, or two metadata keys: `write_tensors` hands them to the package."""
    two_dtypes = {"a": np.ones((3, 5), np.float32), "b": _lazy(np.ones((7,), ml_dtypes.bfloat16))}
    assert not safetensors_direct.supported(two_dtypes, None)
    assert not safetensors_direct.supported({"a": np.ones(2)}, {"format": "pt", "x": "y"})
    with pytest.raises(ValueError, match="one dtype per file"):
        write_file(tmp_path / "x.safetensors", two_dtypes)
    hf_files.write_tensors(tmp_path, two_dtypes)
    loaded = safetensors.numpy.load_file(str(tmp_path / hf_files.SINGLE))
    np.testing.assert_array_equal(loaded["b"], np.ones((7,), ml_dtypes.bfloat16))
    assert loaded["a"].dtype == np.float32


def test_a_failed_conversion_leaves_no_file(tmp_path):
    """An error while a lazy tensor converts: `write_tensors` never renames the partial file."""

    def broken(out):
        raise RuntimeError("conversion failed")

    tensors = {"a": np.ones((4,), np.float32), "b": LazyArray((4,), np.dtype(np.float32), broken)}
    with pytest.raises(RuntimeError, match="conversion failed"):
        hf_files.write_tensors(tmp_path, tensors)
    assert list(tmp_path.iterdir()) == []


def test_the_file_is_durable_on_return(tmp_path, monkeypatch):
    """`write_file` syncs the file before it returns (the data went to disk, not the cache)."""
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    write_file(tmp_path / "x.safetensors", {"a": np.ones((10,), np.float32)})
    assert synced
