"""ZeRO as sharding: spread state over the data-parallel axes the spec does not use yet.

Rajbhandari et al. 2020 (ZeRO): stage 1 partitions optimizer state, stage 2 also gradients,
stage 3 also parameters. Here a partition is one more mesh axis on one dimension of the
array's `PartitionSpec`; XLA turns the layout change into reduce-scatters and all-gathers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec as P

from jaxspeed.runtime.mesh import DATA, HOST, ZERO_AXES
from jaxspeed.sharding.rules import as_tuple, spec_entry

#: Logical dimensions never chosen for ZeRO: scanned layers are sliced one at a time, so
#: sharding them would gather the whole stack for every layer.
_AVOID = frozenset({"layers", "stage"})


def zero_spec(
    spec: P,
    shape: Sequence[int],
    mesh_shape: Mapping[str, int],
    *,
    logical: Sequence[str | None] | None = None,
    dp_axes: Sequence[str] = ZERO_AXES,
    beside: bool = True,
) -> tuple[P, str]:
    """Adds the free data-parallel axes to one dimension of `spec`, chosen by divisibility.

    Tries all free data-parallel axes together, then each alone; prefers a `vocab` dimension
    (an embedding sharded on its columns makes XLA rematerialize the whole batch-sharded
    gradient onto them: "Involuntary full rematerialization" on tensor x ZeRO-2/3), then
    unsharded dimensions, then larger ones. A leaf no dimension can take stays as it is.

    Args:
      spec: the array's spec before ZeRO (from the logical rules).
      shape: the array's shape.
      mesh_shape: mesh axis name → size.
      logical: the logical names, to skip `layers`/`stage` dimensions.
      dp_axes: the axes ZeRO shards over (data-parallel and sequence).
      beside: whether ZeRO may join a dimension another axis splits already (`tensor` on
        `vocab`). False for the explicit ZeRO-3 step: its gathers run inside each group of
        the other axes, where such a dimension's ZeRO shards are not one contiguous block
        (`jaxspeed.zero.collectives.gather_leaves`).

    Returns:
      The new spec and a note ('' when all free data-parallel axes were placed).
    """
    entries = [as_tuple(e) for e in tuple(spec) + (None,) * (len(shape) - len(spec))]
    used = {a for e in entries for a in e}
    free = tuple(a for a in dp_axes if a not in used and mesh_shape.get(a, 1) > 1)
    if not free:
        return spec, ""
    names = tuple(logical or ()) + (None,) * (len(shape) - len(logical or ()))
    avoid = {i for i, n in enumerate(names) if n in _AVOID}
    order = sorted(
        (i for i in range(len(shape)) if i not in avoid and (beside or not entries[i])),
        key=lambda i: (names[i] != "vocab", bool(entries[i]), -shape[i]),
    )
    candidates = [free] + ([(a,) for a in free] if len(free) > 1 else [])
    for axes in candidates:
        ways = math.prod(mesh_shape[a] for a in axes)
        for i in order:
            existing = math.prod(mesh_shape[a] for a in entries[i])
            if shape[i] % (existing * ways) == 0:
                entries[i] = axes + entries[i]
                note = "" if axes == free else f"ZeRO over {axes} only"
                return P(*(spec_entry(e) for e in entries)), note
    return spec, f"ZeRO: no dimension of {tuple(shape)} divisible by {free}; replicated"


#: `ZERO_AXES` host-major (`zero_optimization.shard_order: host`).
HOST_MAJOR_AXES: tuple[str, ...] = (HOST, DATA, *(a for a in ZERO_AXES if a not in (HOST, DATA)))
