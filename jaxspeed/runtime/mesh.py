"""The device mesh: axis names, sizes from config, `-1` filled from the device count."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

from jaxspeed.errors import ConfigError

PIPE = "pipe"
DATA = "data"
SEQUENCE = "sequence"
EXPERT = "expert"
TENSOR = "tensor"
#: Mesh axes, outermost first. `tensor` is innermost so tensor-parallel peers are neighbours.
AXES: tuple[str, ...] = (PIPE, DATA, SEQUENCE, EXPERT, TENSOR)
#: Axes the batch's rows are split over.
DATA_PARALLEL_AXES: tuple[str, ...] = (DATA, EXPERT)
#: Axes ZeRO shards state over: every axis whose devices see different tokens of the same
#: parameters, so the sequence axis too (as MaxText's `context` axis).
ZERO_AXES: tuple[str, ...] = (DATA, SEQUENCE, EXPERT)


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


def make_mesh(mesh_config=None, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the `("pipe", "data", "sequence", "expert", "tensor")` mesh with Auto axes.

    Axes are Auto so that the planner chooses shardings and XLA propagates and inserts the
    collectives (see DESIGN.md, "JAX facts").

    Args:
      mesh_config: a `MeshConfig`, a mapping of axis sizes, or None (all devices on `data`).
      devices: devices to use; default all of `jax.devices()`.
    """
    if mesh_config is None:
        sizes: Mapping[str, int] = {DATA: -1}
    elif isinstance(mesh_config, Mapping):
        sizes = mesh_config
    else:
        sizes = mesh_config.model_dump()
    devices = list(devices) if devices is not None else jax.devices()
    resolved = resolve_axis_sizes(sizes, len(devices))
    shape = tuple(resolved[axis] for axis in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def data_parallel_size(mesh: Mesh) -> int:
    """Number of data-parallel replicas: the size of `data` × the size of `expert`."""
    return math.prod(mesh.shape[axis] for axis in DATA_PARALLEL_AXES)
