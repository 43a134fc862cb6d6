"""How long a compiled step's collectives take on a cluster's links.

Each collective the compiled program runs (`jaxspeed.cost.hlo.Collective`) is placed on the
mesh by its parsed device groups and priced by the link model of `jaxspeed.network`: the ring
formulas on one link (`jaxspeed.network.links`), hierarchical across hosts as NCCL runs them or
gloo's flat algorithms (`jaxspeed.network.collectives`). No overlap with compute or between
collectives is assumed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from jaxspeed.cost.hlo import COLLECTIVES, Collective
from jaxspeed.network.collectives import check_algorithm, hierarchical_seconds
from jaxspeed.network.gloo import flat_seconds, link_load
from jaxspeed.network.links import LinkSpeed
from jaxspeed.network.placement import along, axis_sizes, box, coords_of, group_axes
from jaxspeed.runtime.mesh import AXES


def _real_shape(
    mesh_shape: Mapping[str, int], scale_axes: Mapping[str, int] | None
) -> tuple[int, ...]:
    shape = axis_sizes(mesh_shape)
    if not scale_axes:
        return shape
    real = axis_sizes({**mesh_shape, **scale_axes})
    for axis, size in scale_axes.items():
        compiled = mesh_shape.get(axis, 1)
        if compiled < 2 or size < compiled:
            raise ValueError(
                f"scale_axes: {axis}={size} must be >= the compiled size, and the compiled "
                f"{axis} >= 2 (else its collectives are not in the program); got "
                f"mesh_shape[{axis!r}]={compiled}"
            )
    return real


def step_comm_seconds(
    collectives: Iterable[Collective], mesh_shape: Mapping[str, int], *,
    devices_per_host: int, intra: LinkSpeed, inter: LinkSpeed,
    scale_axes: Mapping[str, int] | None = None, algorithm: str = "nccl",
) -> dict:
    """Seconds per step of a compiled step's collectives, with `executions` counted.

    **Proxy compiles.** A cluster larger than the devices at hand is compiled with some
    data-parallel axes shrunk (data 64 → 2 to fit 8 emulated devices); `scale_axes` gives their
    real sizes (`{"data": 64}`). Every collective is then placed on the real mesh (the pipe
    peers of a bigger data axis may sit on other hosts), and one whose group spans a shrunk
    axis spans all of its real size there. The per-device bytes are kept: in the full-buffer
    convention an all-gather, reduce-scatter or all-reduce of parameters, gradients or
    optimizer state moves the same full buffer whatever the group size, and an all-to-all's
    operand is what one device holds, which keeping the per-device batch keeps. A gather of
    batch-sized activations along a shrunk axis is the exception: its full buffer grows with
    the group, so it is undercounted by real/compiled size. A group on a sub-axis of a shrunk
    axis is taken to span the whole real axis.

    Args:
      collectives: `jaxspeed.cost.hlo.collectives(compiled.as_text(), ...)`; one without
        groups spans every device (XLA's meaning of no replica groups).
      mesh_shape: axis name → size of the mesh the step was compiled on.
      devices_per_host: devices on one host of the real cluster.
      intra, inter: the links inside a host and between hosts.
      scale_axes: axis name → real size, for axes shrunk in a proxy compile (each >= its
        compiled size, and compiled at size >= 2 so that its collectives exist).
      algorithm: "nccl" or "gloo" (see `jaxspeed.network.collectives.collective_time`); gloo
        costs each collective's parsed groups in their rank order, all at once (no
        `scale_axes` with gloo).

    Returns:
      `{"total": s, "by_kind": {kind: s} for every kind in COLLECTIVES, "by_axes":
      {"data+tensor": s, ...}}` in seconds per step; axes keys are joined in `AXES` order.
    """
    check_algorithm(algorithm)
    if algorithm == "gloo" and scale_axes:
        raise ValueError("scale_axes: a proxy compile cannot be costed with gloo's flat "
                         "algorithms (their rank order is the real mesh's)")
    shape = axis_sizes(mesh_shape)
    real = _real_shape(mesh_shape, scale_axes)
    scaled = set(scale_axes or ())
    by_kind = dict.fromkeys(COLLECTIVES, 0.0)
    by_axes: dict[str, float] = {}
    for op in collectives:
        groups = op.groups or (tuple(range(math.prod(shape))),)
        axes = group_axes(groups, mesh_shape)
        if not axes:
            continue
        if op.kind == "collective-permute":
            sets = along(axes, shape)
        else:
            group = next((g for g in groups if 0 in g), groups[0])
            coords = [coords_of(d, shape) for d in group]
            sets = [sorted({c[i] for c in coords}) for i in range(len(AXES))]
        sets = [range(real[i]) if AXES[i] in scaled and len(s) > 1 else s
                for i, s in enumerate(sets)]
        if algorithm == "gloo":
            load = link_load(op.kind, op.bytes, groups, devices_per_host)
            once = flat_seconds(load, devices_per_host=devices_per_host, intra=intra, inter=inter)
        else:
            once = hierarchical_seconds(op.kind, op.bytes, box(sets, real), devices_per_host,
                                        intra, inter)
        seconds = op.executions * once
        by_kind[op.kind] += seconds
        key = "+".join(axes)
        by_axes[key] = by_axes.get(key, 0.0) + seconds
    return {"total": sum(by_kind.values()), "by_kind": by_kind, "by_axes": by_axes}
