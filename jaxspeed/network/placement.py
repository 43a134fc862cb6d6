"""Where a collective's members sit on a mesh: device ids, coordinates and groups.

Devices are numbered row-major over the mesh shape in `AXES` order (tensor innermost), which is
the order of SPMD partition ids. A collective's group is a box of the mesh: the devices that
differ from one member only along the group's axes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

from jaxspeed.runtime.mesh import AXES


def axis_sizes(mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """`{"data": 4, "tensor": 2}` → sizes in `AXES` order, missing axes 1."""
    unknown = set(mesh_shape) - set(AXES)
    if unknown:
        raise ValueError(
            f"mesh_shape: unknown axis {sorted(unknown)}; accepted axes are {list(AXES)}"
        )
    bad = {a: n for a, n in mesh_shape.items() if n < 1 or int(n) != n}
    if bad:
        raise ValueError(f"mesh_shape: sizes must be positive integers, got {bad}")
    return tuple(int(mesh_shape.get(axis, 1)) for axis in AXES)


def coords_of(device: int, shape: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        device, c = divmod(device, size)
        coords.append(c)
    return tuple(reversed(coords))


def device_of(coords: Sequence[int], shape: Sequence[int]) -> int:
    device = 0
    for c, size in zip(coords, shape):
        device = device * size + c
    return device


def box(sets: Sequence[Iterable[int]], shape: Sequence[int]) -> list[int]:
    """Device ids of the product of per-axis coordinate sets."""
    return [device_of(c, shape) for c in itertools.product(*sets)]


def along(axes: Sequence[str], shape: Sequence[int]) -> list[range]:
    """Coordinate sets of the group along `axes` that holds device 0."""
    unknown = set(axes) - set(AXES)
    if unknown:
        raise ValueError(f"axes: unknown axis {sorted(unknown)}; accepted axes are {list(AXES)}")
    return [range(n) if axis in axes else range(1) for axis, n in zip(AXES, shape)]


def group_axes(groups: Iterable[Sequence[int]], mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the members of some group differ, in `AXES` order.

    Args:
      groups: replica groups of partition ids, or collective-permute `(source, target)` pairs
        (then: the axes along which a source and its target differ).
      mesh_shape: axis name → size of the mesh the program was compiled on.
    """
    shape = axis_sizes(mesh_shape)
    devices = math.prod(shape)
    differ: set[int] = set()
    for group in groups:
        bad = [d for d in group if not 0 <= d < devices]
        if bad:
            raise ValueError(f"groups: device ids {bad} are outside the mesh {dict(mesh_shape)} "
                             f"of {devices} devices")
        coords = [coords_of(d, shape) for d in group]
        differ.update(i for c in coords[1:] for i in range(len(AXES)) if c[i] != coords[0][i])
    return tuple(AXES[i] for i in sorted(differ))


def ordered_groups(axes: Sequence[str], mesh_shape: Mapping[str, int]) -> list[list[int]]:
    """Every group of a collective along `axes`, each in its rank order: `axes[0]` major.

    The order is the one a collective's replica groups list (a ZeRO gather over
    `("data", "host")` ranks data-major), which decides the ring's neighbours.
    """
    shape = axis_sizes(mesh_shape)
    unknown = set(axes) - set(AXES)
    if unknown:
        raise ValueError(f"axes: unknown axis {sorted(unknown)}; accepted axes are {list(AXES)}")
    along = [AXES.index(a) for a in axes]
    others = [i for i in range(len(AXES)) if i not in along]
    groups = []
    for fixed in itertools.product(*(range(shape[i]) for i in others)):
        members = []
        for moving in itertools.product(*(range(shape[i]) for i in along)):
            coords = [0] * len(AXES)
            for i, c in (*zip(others, fixed), *zip(along, moving)):
                coords[i] = c
            members.append(device_of(coords, shape))
        groups.append(members)
    return groups
