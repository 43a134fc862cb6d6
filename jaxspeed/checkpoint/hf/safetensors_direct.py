"""A safetensors file written straight to disk (`O_DIRECT`), tensor by tensor.

`safetensors.numpy.save_file` writes through the page cache, from tensors that must all be in
memory at once. Both cost fresh memory pages: the export's converted tensors and the cache's
copy of the file, which on these VMs cost more than the copy itself (`jaxspeed.checkpoint.direct_io`).

`write_file` produces the bytes `safetensors.numpy.save_file` does, through
`jaxspeed.checkpoint.direct_io.writer`: tensors may be lazy (`LazyArray`), converted a few at a time, on
every core, into reused scratch arrays, and the file is durable when `write_file` returns.

It writes the files the export produces: one dtype per file, at most one metadata key
(Hugging Face's `{"format": "pt"}`). `supported` says whether a file is such; the others go
through `safetensors` itself, whose tensor order across dtypes and metadata order this module
does not restate.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from jaxspeed.checkpoint import direct_io
from jaxspeed.checkpoint.direct_io import LazyArray

#: safetensors' dtype names, by numpy dtype name.
_DTYPE_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64",
                "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}


def supported(tensors: Mapping[str, np.ndarray | LazyArray], metadata: Mapping[str, str] | None) -> bool:
    """Whether `write_file` writes these as `safetensors` would (else use `safetensors`)."""
    dtypes = {np.dtype(t.dtype).name for t in tensors.values()}
    return len(dtypes) <= 1 and dtypes <= _DTYPE_NAMES.keys() and len(metadata or {}) <= 1


def header(tensors: Mapping[str, np.ndarray | LazyArray], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces to a multiple of 8 bytes.

    The layout `safetensors` writes: tensors by name (one dtype), in data order, compact JSON.
    """
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        size = t.nbytes
        entries[name] = {"dtype": _DTYPE_NAMES[np.dtype(t.dtype).name], "shape": list(t.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_file(path: Path, tensors: Mapping[str, np.ndarray | LazyArray],
               metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` to `path` as `safetensors.numpy.save_file` would (see `supported`)."""
    if not supported(tensors, metadata):
        raise ValueError("write_file takes one dtype per file and at most one metadata key")
    with direct_io.writer(path) as out:
        out.put(np.frombuffer(header(tensors, metadata), np.uint8))
        out.put_all(tensors[name] for name in sorted(tensors))
