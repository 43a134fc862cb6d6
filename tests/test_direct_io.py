"""`jaxspeed.checkpoint.direct_io`: files streamed through two staging buffers, lazy arrays in order."""

from pathlib import Path

import numpy as np
import pytest

from jaxspeed.checkpoint import direct_io
from jaxspeed.checkpoint.direct_io import LazyArray
from jaxspeed.checkpoint.hf import export_hf, import_hf

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llama"
SMALL = 2 * 4096  # staging buffers of two disk blocks: every file wraps around them


@pytest.fixture
def small_buffers(monkeypatch):
    monkeypatch.setattr(direct_io, "CHUNK", SMALL)


def _lazy(x: np.ndarray, calls: list | None = None, *, by_rows: bool = False) -> LazyArray:
    def fill(out):
        out[...] = x

    def fill_rows(out, start):
        calls.append((start, len(out)))
        out[...] = x[start:start + len(out)]

    return LazyArray(x.shape, x.dtype, fill, fill_rows if by_rows else None)


@pytest.mark.parametrize("workers", [1, 3])
def test_arrays_and_lazy_arrays_land_in_order(tmp_path, small_buffers, workers):
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(n).astype(np.float32) for n in (5, 3000, 1, 0, 7000, 17)]
    items = [_lazy(p) if i % 2 else p for i, p in enumerate(parts)]
    with direct_io.writer(tmp_path / "x.bin") as out:
        out.put(np.frombuffer(b"head", np.uint8))
        out.put_all(items, workers=workers)
    assert (tmp_path / "x.bin").read_bytes() == b"head" + b"".join(p.tobytes() for p in parts)


def test_a_large_lazy_array_fills_a_buffer_of_rows_at_a_time(tmp_path, small_buffers):
    x = np.arange(40 * 300, dtype=np.float32).reshape(40, 300)  # 1,200 bytes a row
    calls: list = []
    with direct_io.writer(tmp_path / "x.bin") as out:
        out.put_all([_lazy(x, calls, by_rows=True)])
    assert (tmp_path / "x.bin").read_bytes() == x.tobytes()
    assert calls == [(start, min(6, 40 - start)) for start in range(0, 40, 6)]  # 6 rows <= 8 KiB


def test_a_failing_fill_raises_and_syncs_nothing(tmp_path, small_buffers, monkeypatch):
    synced = []
    monkeypatch.setattr(direct_io.os, "fsync", synced.append)

    def broken(out):
        raise RuntimeError("bad tensor")

    items = [np.ones(5000, np.float32), LazyArray((10,), np.dtype(np.float32), broken)]
    with pytest.raises(RuntimeError, match="bad tensor"):
        with direct_io.writer(tmp_path / "x.bin") as out:
            out.put_all(items)
    assert synced == []


def test_import_and_export_through_small_buffers_are_byte_identical(tmp_path, small_buffers):
    """Every tensor crosses buffer boundaries, and the embedding is imported by rows."""
    ckpt = import_hf(FIXTURES / "gqa", tmp_path / "ckpt")
    out = export_hf(ckpt, tmp_path / "hf")
    for path in (FIXTURES / "gqa").glob("*.safetensors"):
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
