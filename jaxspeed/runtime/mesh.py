"""The device mesh: axis names, sizes from config, `-1` filled from the device count.

The mesh has two levels, as MaxText's `dcn_*` and `ici_*` axes: the outermost `host` axis
runs across hosts (by default one host per process), every other axis within one. The
config's `mesh.data` is the total data-parallel degree; `mesh.hosts` of it cross hosts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxspeed.errors import ConfigError
from jaxspeed.runtime.distributed import process_count, process_of

HOST = "host"
PIPE = "pipe"
DATA = "data"
SEQUENCE = "sequence"
EXPERT = "expert"
TENSOR = "tensor"
#: Mesh axes, outermost first. `host` is outermost so a host's devices are one contiguous
#: block; `tensor` is innermost so tensor-parallel peers are neighbours.
AXES: tuple[str, ...] = (HOST, PIPE, DATA, SEQUENCE, EXPERT, TENSOR)
#: Axes the batch's rows are split over (host-major, as the devices are laid out).
DATA_PARALLEL_AXES: tuple[str, ...] = (HOST, DATA, EXPERT)
#: Axes ZeRO shards state over: every axis whose devices see different tokens of the same
#: parameters, so the sequence axis too (as MaxText's `context` axis). `data` before `host`:
#: a ZeRO-sharded dimension is split data-major, so gathering over `host` alone yields
#: contiguous blocks of the intra-host partition (what ZeRO++'s hpZ needs).
ZERO_AXES: tuple[str, ...] = (DATA, HOST, SEQUENCE, EXPERT)
#: The axis keys of the `mesh` config: no `host` (`data` is the total degree, `mesh.hosts` its split).
CONFIG_AXES: tuple[str, ...] = tuple(axis for axis in AXES if axis != HOST)


def resolve_axis_sizes(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fills at most one `-1` so that the product of the sizes equals `num_devices`.

    Args:
      sizes: axis name → size (`-1` = fill). Missing axes default to 1.
      num_devices: number of devices the mesh must cover.

    Returns:
      axis name → size, for every axis in `AXES` order.
    """
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ConfigError(f"mesh: unknown axis {sorted(unknown)}; accepted axes are {list(AXES)}")
    resolved = {axis: int(sizes.get(axis, 1)) for axis in AXES}
    fill = [axis for axis, size in resolved.items() if size == -1]
    bad = {axis: size for axis, size in resolved.items() if size < 1 and size != -1}
    if bad:
        raise ConfigError(f"mesh: sizes must be positive or -1, got {bad}")
    if len(fill) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1, got {fill}")
    known = math.prod(size for size in resolved.values() if size != -1)
    if fill:
        if num_devices % known:
            raise ConfigError(
                f"mesh: cannot fill mesh.{fill[0]}=-1: {num_devices} devices are not divisible "
                f"by the product of the other axes ({known})"
            )
        resolved[fill[0]] = num_devices // known
    elif known != num_devices:
        raise ConfigError(
            f"mesh: product of axis sizes {resolved} is {known}, but there are {num_devices} "
            f"devices; make the product equal {num_devices} or set one axis to -1"
        )
    return resolved


def resolve_hosts(hosts: int | str, data: int, process_count: int) -> int:
    """The size of the `host` axis for a total data-parallel degree `data`.

    Args:
      hosts: `mesh.hosts`: `"auto"` or an int >= 1.
      data: the total data-parallel degree, `-1` already filled.
      process_count: the number of processes (`jax.process_count()`).

    Returns:
      `hosts` when an int (it must divide `data`); for `"auto"`, `process_count` when it is
      > 1 and divides `data`, else 1.
    """
    if hosts == "auto":
        return process_count if process_count > 1 and data % process_count == 0 else 1
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
        raise ConfigError(f"mesh.hosts: expected 'auto' or an int >= 1, got {hosts!r}")
    if data % hosts:
        raise ConfigError(
            f"mesh.hosts={hosts} must divide mesh.data={data} (the total data-parallel degree); "
            f"use a divisor of {data} or 'auto'"
        )
    return hosts


def config_axis_sizes(
    sizes: Mapping[str, int | str], num_devices: int, process_count: int = 1
) -> dict[str, int]:
    """Mesh axis sizes from config-style sizes: `data` the total degree, `hosts` its split.

    Args:
      sizes: config axis name → size (`-1` = fill), plus optional `hosts` (default "auto").
      num_devices: number of devices the mesh must cover.
      process_count: number of processes, for `hosts: auto`.

    Returns:
      axis name → size, for every axis in `AXES` order; `host × data` is the config's `data`.
    """
    sizes = dict(sizes)
    hosts = sizes.pop("hosts", "auto")
    if HOST in sizes:
        raise ConfigError(
            f"mesh: {HOST!r} is not a config key; set mesh.hosts (mesh.data stays the total "
            f"data-parallel degree)"
        )
    unknown = set(sizes) - set(CONFIG_AXES)
    if unknown:
        raise ConfigError(
            f"mesh: unknown axis {sorted(unknown)}; accepted keys are "
            f"{['hosts', *CONFIG_AXES]}"
        )
    resolved = resolve_axis_sizes(sizes, num_devices)
    host = resolve_hosts(hosts, resolved[DATA], process_count)
    return {**resolved, HOST: host, DATA: resolved[DATA] // host}


def host_major(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """`devices` grouped by process (stable), so the `host` axis index is the process index."""
    return sorted(devices, key=process_of)


def make_mesh(mesh_config=None, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the `("host", "pipe", "data", "sequence", "expert", "tensor")` mesh, Auto axes.

    Axes are Auto so that the planner chooses shardings and XLA propagates and inserts the
    collectives (see DESIGN.md, "JAX facts"). Devices are host-major: with several processes,
    each process's devices form one contiguous block, so `host` crosses processes.

    Args:
      mesh_config: a `MeshConfig`; a mapping of config sizes (`data` total, optional
        `hosts`); a mapping of mesh axis sizes naming `host` (then `data` is per host); or
        None (all devices on `data`, `hosts: auto`).
      devices: devices to use; default all of `jax.devices()`.
    """
    if mesh_config is None:
        sizes: Mapping[str, int | str] = {DATA: -1}
    elif isinstance(mesh_config, Mapping):
        sizes = mesh_config
    else:
        sizes = {**mesh_config.axis_sizes(), "hosts": mesh_config.hosts}
    devices = host_major(devices if devices is not None else jax.devices())
    if HOST in sizes and "hosts" not in sizes:  # mesh axis sizes, e.g. from `mesh.shape`
        resolved = resolve_axis_sizes(sizes, len(devices))
    else:
        processes = process_count(devices)
        resolved = config_axis_sizes(sizes, len(devices), processes)
    shape = tuple(resolved[axis] for axis in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def data_parallel_size(mesh: Mesh) -> int:
    """Number of data-parallel replicas: `host` × `data` × `expert`."""
    return math.prod(mesh.shape.get(axis, 1) for axis in DATA_PARALLEL_AXES)


def cross_host_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes whose collectives cross hosts: `("host",)` when it has size > 1."""
    return (HOST,) if mesh.shape.get(HOST, 1) > 1 else ()


def host_of_devices(mesh: Mesh) -> list[int]:
    """The `host` coordinate of each device, in the mesh's flat order (a program's partition
    ids, for a step jitted over this mesh); without a `host` axis, each device's process (an
    expert axis across processes crosses hosts)."""
    if mesh.shape.get(HOST, 1) == 1:
        return [process_of(d) for d in mesh.devices.flat]
    return np.indices(mesh.devices.shape)[mesh.axis_names.index(HOST)].ravel().tolist()


def intra_host_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes of size > 1 within one host, in mesh order."""
    return tuple(a for a in mesh.axis_names if a != HOST and mesh.shape[a] > 1)
