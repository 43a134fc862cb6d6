"""Byte sizes in config values: `parse_bytes("80GiB")`."""

from __future__ import annotations

import re
import types
from collections.abc import Mapping

from jaxspeed.errors import ConfigError

_BYTE_UNITS: Mapping[str, int] = types.MappingProxyType(
    {
        "": 1, "b": 1,
        "k": 2**10, "kib": 2**10, "kb": 10**3,
        "m": 2**20, "mib": 2**20, "mb": 10**6,
        "g": 2**30, "gib": 2**30, "gb": 10**9,
        "t": 2**40, "tib": 2**40, "tb": 10**12,
    }
)  # fmt: skip
_BYTES_PATTERN = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(value: str | int) -> int:
    """Parses a byte size: an int, or a string such as `"80GiB"`, `"16 GB"`, `"1.5G"`.

    `KiB/MiB/GiB/TiB` and bare `K/M/G/T` are powers of 1024; `KB/MB/GB/TB` are powers of 1000
    (units are case-insensitive).

    Returns:
      the size in bytes, >= 1.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"expected a byte size such as 80GiB or an int, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _BYTES_PATTERN.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if unit not in _BYTE_UNITS:
            raise ConfigError(
                f"cannot parse byte size {value!r}; expected a number with an optional unit "
                f"(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, K, M, G, T), e.g. '80GiB'"
            )
        size = round(float(match.group(1)) * _BYTE_UNITS[unit])
    if size < 1:
        raise ConfigError(f"byte size must be positive, got {value!r}")
    return size
