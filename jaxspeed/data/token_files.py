"""Flat token files, memory-mapped: `.npy`, or raw `.bin` with a given dtype.

A token file is one long stream of token ids in which documents are joined by an EOS token.
Several files read as their concatenation, in the order given. `TokenRows` cuts that stream
into fixed windows and serves them by index, so Grain can shuffle and shard them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from jaxspeed.errors import ConfigError, JaxspeedError

DTYPES = ("uint16", "uint32")
SUFFIXES = (".npy", ".bin")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest file dtype that holds ids `[0, vocab_size)`: uint16 or uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def open_token_file(path: str, *, dtype: str | None = None) -> np.ndarray:
    """Memory-maps one token file.

    Args:
      path: a `.npy` file (1-D, unsigned ints) or a raw `.bin` file.
      dtype: for `.bin`, "uint16" or "uint32" (`data.dtype`); ignored for `.npy`.

    Returns:
      read-only `[num_tokens]` memmap.

    Raises:
      JaxspeedError: when the file is missing, or its size does not divide by the dtype.
      ConfigError: for a `.bin` without a valid dtype, or another suffix.
    """
    if not os.path.isfile(path):
        raise JaxspeedError(f"data.files: token file {path!r} does not exist")
    if path.endswith(".npy"):
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise JaxspeedError(
                f"token file {path!r}: expected a 1-D integer array, got {tokens.dtype} "
                f"{tokens.shape}"
            )
        return tokens
    if not path.endswith(".bin"):
        raise ConfigError(f"data.files: {path!r} is not a token file; accepted suffixes {list(SUFFIXES)}")
    if dtype not in DTYPES:
        raise ConfigError(f"data.dtype: got {dtype!r} for raw token file {path!r}; accepted {list(DTYPES)}")
    size = os.path.getsize(path)
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise JaxspeedError(
            f"token file {path!r}: {size} bytes is not a whole number of {dtype} tokens "
            f"({itemsize} bytes each); is data.dtype right?"
        )
    if size == 0:
        raise JaxspeedError(f"token file {path!r} is empty")
    return np.memmap(path, dtype=dtype, mode="r")


class TokenRows:
    """Windows of `seq_len + 1` tokens over concatenated token files (a Grain data source).

    Row `i` is tokens `[i * seq_len + offset, (i + 1) * seq_len + offset + 1)` of the stream:
    consecutive rows overlap by one token, so every token is a target exactly once.
    """

    def __init__(self, files: Sequence[np.ndarray], *, seq_len: int, start: int = 0, stop: int | None = None):
        """Rows over stream tokens `[start, stop)` (default: all)."""
        self._files = list(files)
        self._ends = np.cumsum([len(f) for f in self._files])
        total = int(self._ends[-1]) if len(self._ends) else 0
        self.seq_len = int(seq_len)
        self.start = int(start)
        self.stop = total if stop is None else int(stop)
        self._len = max(0, (self.stop - self.start - 1) // self.seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        """Row `index` as int32 `[seq_len + 1]`."""
        if not 0 <= index < self._len:
            raise IndexError(f"row {index} not in [0, {self._len})")
        lo = self.start + index * self.seq_len
        return self._read(lo, lo + self.seq_len + 1)

    def _read(self, lo: int, hi: int) -> np.ndarray:
        first = int(np.searchsorted(self._ends, lo, side="right"))
        parts = []
        for k in range(first, len(self._files)):
            begin = int(self._ends[k - 1]) if k else 0
            parts.append(self._files[k][max(lo - begin, 0) : hi - begin])
            if hi <= self._ends[k]:
                break
        return np.concatenate(parts).astype(np.int32)

    def __repr__(self) -> str:
        return f"TokenRows(rows={self._len}, seq_len={self.seq_len}, files={len(self._files)})"


def write_token_file(path: str, chunks, *, dtype: np.dtype) -> int:
    """Writes token-id chunks as one flat file (`.npy` or raw `.bin`), atomically.

    Args:
      path: output file; the suffix picks the format.
      chunks: iterable of 1-D integer arrays, written in order.
      dtype: file dtype (uint16 / uint32).

    Returns:
      the number of tokens written.
    """
    if not path.endswith(SUFFIXES):
        raise ConfigError(f"--out: {path!r} must end in one of {list(SUFFIXES)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    raw = f"{path}.{os.getpid()}.partial"
    total = 0
    try:
        with open(raw, "wb") as f:
            for chunk in chunks:  # the reader's errors (bad text, no text) arrive here too
                chunk = np.asarray(chunk)
                if chunk.size and int(chunk.max()) > np.iinfo(dtype).max:
                    raise JaxspeedError(f"token id {int(chunk.max())} does not fit {np.dtype(dtype).name}")
                f.write(chunk.astype(dtype).tobytes())
                total += chunk.size
    except BaseException:
        os.remove(raw)
        raise
    if path.endswith(".npy"):
        final = f"{path}.{os.getpid()}.npy.partial"
        out = np.lib.format.open_memmap(final, mode="w+", dtype=dtype, shape=(total,))
        out[:] = np.memmap(raw, dtype=dtype, mode="r") if total else out[:]
        out.flush()
        del out
        os.remove(raw)
        raw = final
    os.replace(raw, path)
    return total
