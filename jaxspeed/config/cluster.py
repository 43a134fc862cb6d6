"""The cluster an automatic plan is searched for: devices, memory, peak FLOP/s and links.

A `Cluster` is data, read from YAML: a preset (`clusters/<name>.yaml` beside this module,
shipped as package data) or any file (`load_cluster`), or measured on this machine
(`jaxspeed.autoplan.calibrate`). Link figures are what one device gets while every device
communicates at once, because that is what a collective over the whole mesh sees: a 10 GbE NIC
shared by 8 GPUs is 1.25 / 8 GB/s per device.

It is a config section (beside `config`'s others, below `models` and `optim`), so the planner,
the GPT's `model.moe.cluster` and Muon's `optimizer.params.cluster` all read it without
importing upward; `jaxspeed.config` does not import it (`import jaxspeed.config.cluster`).
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, Field, ValidationError

from jaxspeed.config.loading import _read_file
from jaxspeed.config.schema import _Section
from jaxspeed.config.units import parse_bytes
from jaxspeed.errors import ConfigError, did_you_mean

#: Folder of the preset clusters: package data (`jaxspeed/config/clusters/`), so an installed
#: wheel has them too. Installed packages are folders, so it is a `Path`.
PRESETS = Path(str(resources.files(__package__) / "clusters"))

#: dtype spellings → `PeakTflops` field. fp16 shares the 16-bit tensor-core rate (V100 has no
#: bf16; its fp16 rate is what a 16-bit step reaches).
_DTYPES: Mapping[str, str] = types.MappingProxyType(
    {
        "bf16": "bf16", "bfloat16": "bf16", "fp16": "bf16", "float16": "bf16",
        "fp32": "fp32", "float32": "fp32",
    }
)  # fmt: skip


def _check_gpu(value: Any) -> Any:
    if value is not None:
        from jaxspeed.gpu import targets

        if str(value).lower() not in targets.names():
            raise ValueError(f"unknown GPU {value!r}; known: {', '.join(targets.names())}")
    return value


def _check_bytes(value: Any) -> Any:
    parse_bytes(value)
    return value


_Bytes = Annotated[str | int, BeforeValidator(_check_bytes)]
_PositiveFloat = Annotated[float, Field(strict=True, gt=0)]
_PositiveInt = Annotated[int, Field(strict=True, ge=1)]


class Link(_Section):
    """One class of link (NVLink-class inside a host, InfiniBand/Ethernet-class between hosts).

    `bandwidth_gbps` is GB/s (1e9 bytes/s) that one device can send while every device sends
    at once; `latency_us` is the time of one message hop; `overhead_us` what each collective
    costs besides its hops, once, whatever its group (the runtime's own cost of starting and
    finishing one: `calibrate` times a burst of tiny ones; 0 where not measured).
    """

    bandwidth_gbps: _PositiveFloat
    latency_us: Annotated[float, Field(strict=True, ge=0)] = 5.0
    overhead_us: Annotated[float, Field(strict=True, ge=0)] = 0.0


class PeakTflops(_Section):
    """Dense matmul peak of one device, in TFLOP/s.

    `fp32` is the rate of a float32 matmul at XLA's default precision, which runs on the TF32
    tensor cores of A100/H100; `bf16` is the 16-bit tensor-core rate.
    """

    bf16: _PositiveFloat
    fp32: _PositiveFloat


class UpdateBandwidth(_Section):
    """GB/s of XLA's bytes accessed that one device's optimizer update moves with every device
    busy (`jaxspeed.autoplan.update_cost`): a plain update (AdamW's) and one that runs the 1-bit
    compression (1-bit Adam's compressed phase)."""

    plain_gbps: _PositiveFloat
    compressed_gbps: _PositiveFloat


class Cluster(_Section):
    """Hosts of identical devices; the figures a plan's time and memory are estimated from.

    `efficiency` is the fraction of the matmul peak that a training step's matmuls reach on
    this backend (0.5 unless calibrated). `inter_host` is required even for one host, and
    `host_link` even where nothing is offloaded, so every file names the same keys.
    """

    name: Annotated[str, Field(min_length=1)]
    hosts: _PositiveInt
    devices_per_host: _PositiveInt
    device_memory: _Bytes
    peak_tflops: PeakTflops
    efficiency: Annotated[float, Field(strict=True, gt=0, le=1)] = 0.5
    #: GB/s one device reads plus writes its own memory (HBM; on CPU, RAM shared by all).
    memory_bandwidth_gbps: Annotated[float, Field(strict=True, gt=0)]
    #: the rates optimizer updates run at, where `calibrate` timed them; None: the memory
    #: bandwidth (a GPU's update is a bandwidth-bound stream)
    update_bandwidth: UpdateBandwidth | None = None
    intra_host: Link
    inter_host: Link
    #: between one device and its host's memory (PCIe-class): what offloaded optimizer state,
    #: params and `offload_dots` activations cross, per device with every device copying.
    host_link: Link
    host_memory: _Bytes
    #: the GPU model (`jaxspeed.gpu.targets`: h100, h200, a100), which `jaxspeed plan` compiles
    #: for without a GPU; None for a cluster jaxspeed has no target for (or a calibrated CPU)
    gpu: Annotated[str | None, BeforeValidator(_check_gpu)] = None
    #: the algorithms of the library that runs the collectives (`jaxspeed.network.collectives`):
    #: `nccl`, hierarchical across hosts (GPU clusters); `gloo`, flat rings, recursive
    #: halving and direct all-to-all in rank order (XLA:CPU across processes; `calibrate`
    #: writes it when it measures across processes)
    collectives: Literal["nccl", "gloo"] = "nccl"

    @property
    def devices(self) -> int:
        """Devices in the whole cluster."""
        return self.hosts * self.devices_per_host

    @property
    def device_memory_bytes(self) -> int:
        """`device_memory` of one device, in bytes."""
        return parse_bytes(self.device_memory)

    @property
    def host_memory_bytes(self) -> int:
        """`host_memory` of one host, in bytes (room for offloaded state)."""
        return parse_bytes(self.host_memory)

    def peak_flops(self, dtype: str) -> float:
        """Peak dense matmul FLOP/s of one device for `dtype` ("bf16", "float32", ...)."""
        key = _DTYPES.get(str(dtype).lower())
        if key is None:
            raise ConfigError(
                f"cluster {self.name}: no peak for dtype {dtype!r}; accepted: {', '.join(_DTYPES)}"
                + did_you_mean(str(dtype), list(_DTYPES))
            )
        return getattr(self.peak_tflops, key) * 1e12


def available_presets() -> list[str]:
    """Names of the preset clusters (`PRESETS`: `jaxspeed/config/clusters/*.yaml`), sorted."""
    return sorted(path.stem for path in PRESETS.glob("*.yaml"))


def load_cluster(spec: str | os.PathLike) -> Cluster:
    """Loads a preset by name (`"8xh100-nvlink"`) or a YAML/JSON file by path.

    A `spec` with a path separator or a `.yaml`/`.yml`/`.json` suffix, or any `os.PathLike`, is
    a file; anything else is a preset name.

    Raises:
      ConfigError: one line: an unknown preset (naming the presets), a missing or unreadable
        file, or each invalid key with its value.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError(f"cluster must be a preset name or a file path, got {spec!r}")
    if isinstance(spec, os.PathLike) or _looks_like_path(spec):
        path, label = Path(spec), os.fspath(spec)
    else:
        presets = available_presets()
        if spec not in presets:
            raise ConfigError(
                f"unknown cluster preset {spec!r}{did_you_mean(spec, presets)}; "
                f"available: {', '.join(presets)}; or give a path to a YAML file"
            )
        path, label = PRESETS / f"{spec}.yaml", spec
    raw = _read_file(path)
    try:
        return Cluster.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(_describe(error) for error in err.errors())
        raise ConfigError(f"cluster {label}: {problems}") from None


def save_cluster(cluster: Cluster, path: str | os.PathLike, *, comment: str = "") -> Path:
    """Writes `cluster` as YAML that `load_cluster` reads back; `comment` becomes `#` lines.

    Returns:
      the path written.
    """
    path = Path(path)
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    body = yaml.safe_dump(cluster.model_dump(), sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + body)
    return path


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or "/" in spec or Path(spec).suffix.lower() in (".yaml", ".yml", ".json")


# `jaxspeed.config.validation_errors.describe_error` words errors for `Config` (its key hints
# look up Config's sections), so cluster errors get their own wording: `key.path must be > 0,
# got 0`.
_BOUNDS: Mapping[str, tuple[str, str]] = types.MappingProxyType(
    {
        "greater_than": ("gt", ">"),
        "greater_than_equal": ("ge", ">="),
        "less_than": ("lt", "<"),
        "less_than_equal": ("le", "<="),
    }
)


def _describe(error: Mapping[str, Any]) -> str:
    """One pydantic error as `key.path must be ..., got VALUE`."""
    loc = error["loc"]
    path = ".".join(str(part) for part in loc)
    kind = error["type"]
    if kind == "missing":
        return f"{path} is required"
    if kind == "extra_forbidden":
        accepted = _keys_at(loc[:-1])
        return (
            f"{path} is not a key{did_you_mean(str(loc[-1]), accepted)}; "
            f"accepted: {', '.join(accepted)}"
        )
    shown = repr(error["input"])
    if kind in _BOUNDS:
        name, sign = _BOUNDS[kind]
        return f"{path} must be {sign} {error['ctx'][name]:g}, got {shown}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{path}: {message}" if shown in message else f"{path}: {message}, got {shown}"


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """Accepted keys of the section at `loc` (`()` is the cluster itself)."""
    model: Any = Cluster
    for part in loc:
        model = model.model_fields[part].annotation
    return list(model.model_fields)
