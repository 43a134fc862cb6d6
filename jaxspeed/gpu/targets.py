"""The GPUs jaxspeed compiles for without one: `targets/NAME.textproto`, with their sources.

Each file is XLA:GPU's `GpuTargetConfigProto` in text form (what a real GPU's topology reports
as its `target_config`), with a comment giving the published source of every value.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from jaxspeed.errors import JaxspeedError

TARGETS_DIR = Path(__file__).resolve().parent / "targets"


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU model: its target config text and the figures jaxspeed reads from it."""

    name: str
    text: str
    device_kind: str
    compute_capability: tuple[int, int]
    memory_bytes: int
    shared_memory_per_block_optin: int
    memory_bandwidth: float  #: HBM bytes/s (`memory_bandwidth`, the datasheet's figure)

    @property
    def capability(self) -> str:
        """`"9.0"`, as a real device's `compute_capability`."""
        return "{}.{}".format(*self.compute_capability)


def names() -> list[str]:
    """The targets shipped with jaxspeed."""
    return sorted(path.stem for path in TARGETS_DIR.glob("*.textproto"))


def _field(text: str, name: str) -> str:
    match = re.search(rf"^\s*{name}\s*:\s*(\S+)", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"GPU target config has no {name}")
    return match.group(1).strip('"')


@functools.cache
def load(name: str) -> GpuTarget:
    """The target `name` (`h100`, `h200`, `a100`; case-insensitive).

    Raises:
      JaxspeedError: for an unknown name, listing the known ones.
    """
    key = name.strip().lower()
    path = TARGETS_DIR / f"{key}.textproto"
    if not path.is_file():
        raise JaxspeedError(
            f"unknown GPU target {name!r}; known targets: {', '.join(names())}"
        )
    text = path.read_text()
    kind = re.search(r'^device_description_str:\s*"([^"]+)"', text, re.MULTILINE).group(1)
    capability = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)\s+minor:\s*(\d+)", text)
    return GpuTarget(
        name=key,
        text=text,
        device_kind=kind,
        compute_capability=(int(capability.group(1)), int(capability.group(2))),
        memory_bytes=int(_field(text, "device_memory_size")),
        shared_memory_per_block_optin=int(_field(text, "shared_memory_per_block_optin")),
        memory_bandwidth=float(_field(text, "memory_bandwidth")),
    )
