"""How long a compiled step's collectives take on a cluster's links.

Placement (`jaxspeed.autoplan.placement`): device `d` of the row-major mesh sits on host
`d // devices_per_host`. All groups of a collective are alike, so the one holding device 0
stands for them.

Costs are the ring / pairwise bandwidth-latency model on per-device bytes, in the profiler's
convention: the full buffer (all-gather: the gathered output; reduce-scatter: the unscattered
input; all-reduce, all-to-all: the operand; collective-permute: what one device sends). With
`bw` = `bandwidth_gbps`·1e9 bytes/s and `lat` = `latency_us`·1e-6 s, over `g` devices:

  all-reduce          2(g-1)/g · B/bw + 2(g-1) · lat   (reduce-scatter, then all-gather)
  all-gather          (g-1)/g · B/bw + (g-1) · lat
  reduce-scatter      (g-1)/g · B/bw + (g-1) · lat
  all-to-all          (g-1)/g · B/bw + (g-1) · lat
  collective-permute  B/bw + lat

each plus the link's `overhead_us` (a calibrated cluster's fixed cost a collective; 0 in the
presets), once per collective, or per step of a hierarchical one.

A group that spans H hosts with k members on each is costed hierarchically (`collective_time`),
as NCCL runs it (`ALGORITHMS[0]`, "nccl"). Gloo, which carries XLA:CPU's collectives between
processes, runs flat algorithms in the group's rank order instead (`ALGORITHMS[1]`, "gloo";
`jaxspeed.autoplan.gloo`). No overlap with compute or between collectives is assumed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from jaxspeed.autoplan.gloo import flat_seconds, link_load, overhead_seconds
from jaxspeed.autoplan.placement import (
    along, axis_sizes, box, coords_of, group_axes, ordered_groups,
)
from jaxspeed.cost.hlo import COLLECTIVES, Collective
from jaxspeed.runtime.mesh import AXES


#: Collective algorithm families a cluster's communication library runs (see the docstring).
ALGORITHMS = ("nccl", "gloo")


class LinkSpeed(Protocol):
    """What a link needs for costing; `jaxspeed.config.cluster.Link` is one."""

    bandwidth_gbps: float  #: GB/s (1e9 bytes/s) one device sends while all send at once
    latency_us: float  #: one message hop
    # optionally `overhead_us`: once per collective, besides its hops (`overhead_seconds`)


def collective_seconds(kind: str, nbytes: float, group_size: int, link: LinkSpeed) -> float:
    """Seconds of one collective over `group_size` devices on one kind of link (module formulas).

    Args:
      kind: one of `jaxspeed.cost.hlo.COLLECTIVES`.
      nbytes: per-device bytes in the profiler's full-buffer convention.
      group_size: devices in the group; 1 costs nothing.
      link: anything with `bandwidth_gbps` (GB/s per device) and `latency_us`.
    """
    if kind not in COLLECTIVES:
        raise ValueError(
            f"kind: unknown collective {kind!r}; accepted kinds are {list(COLLECTIVES)}"
        )
    if link.bandwidth_gbps <= 0 or link.latency_us < 0:
        raise ValueError(f"link: bandwidth_gbps must be > 0 and latency_us >= 0, got "
                         f"{link.bandwidth_gbps} and {link.latency_us}")
    if group_size <= 1:
        return 0.0
    bw, lat, g = link.bandwidth_gbps * 1e9, link.latency_us * 1e-6, group_size
    if kind == "collective-permute":
        return nbytes / bw + lat + overhead_seconds(link)
    rounds = 2 if kind == "all-reduce" else 1
    return rounds * ((g - 1) / g * nbytes / bw + (g - 1) * lat) + overhead_seconds(link)


def _placement(members: Sequence[int], devices_per_host: int) -> tuple[int, int]:
    """(hosts the members sit on, members on the fullest of those hosts)."""
    if devices_per_host < 1:
        raise ValueError(f"devices_per_host must be >= 1, got {devices_per_host}")
    per_host = Counter(d // devices_per_host for d in members)
    return len(per_host), max(per_host.values())


def hosts_spanned(
    axes: Sequence[str], mesh_shape: Mapping[str, int], devices_per_host: int
) -> tuple[int, int]:
    """(hosts a group along `axes` spans, its members per host), for the group of device 0.

    Members per host is the count on the fullest host (all hosts hold the same count when the
    mesh's inner sizes and `devices_per_host` divide each other, as on real clusters).
    """
    shape = axis_sizes(mesh_shape)
    return _placement(box(along(axes, shape), shape), devices_per_host)


def _time(
    kind: str, nbytes: float, members: Sequence[int], devices_per_host: int,
    intra: LinkSpeed, inter: LinkSpeed,
) -> float:
    hosts, local = _placement(members, devices_per_host)
    if kind in ("collective-permute", "all-to-all"):
        return collective_seconds(kind, nbytes, len(members), intra if hosts == 1 else inter)
    if kind == "all-reduce":
        return (collective_seconds("reduce-scatter", nbytes, local, intra)
                + collective_seconds("all-reduce", nbytes / local, hosts, inter)
                + collective_seconds("all-gather", nbytes, local, intra))
    across = collective_seconds(kind, nbytes / local, hosts, inter)
    return collective_seconds(kind, nbytes, local, intra) + across


def collective_time(
    kind: str, nbytes: float, axes: Sequence[str], mesh_shape: Mapping[str, int], *,
    devices_per_host: int, intra: LinkSpeed, inter: LinkSpeed, algorithm: str = "nccl",
) -> float:
    """Seconds of one collective along `axes` of a mesh laid out on hosts (see module docstring).

    A group inside one host runs on `intra`, one with every member on its own host on `inter`.
    A group of g = H·k devices, k on each of H hosts, runs hierarchically (the two cases above
    are its k = g and k = 1 ends), each step being the ring formula on its link:

      all-reduce      reduce-scatter over k (intra, B) → all-reduce over H (inter, B/k)
                      → all-gather over k (intra, B)
      all-gather      all-gather over H among the devices of one local rank (inter, B/k: the
                      H shards of that rank) → all-gather over k (intra, B)
      reduce-scatter  reduce-scatter over k (intra, B) → reduce-scatter over H (inter, B/k)
      all-to-all      (g-1)/g · B over `inter`: the slow link bounds the exchange
      permute         B over `inter` if the group crosses a host (a shift along the axes
                      crosses a host boundary somewhere and the slowest pair bounds the step)

    Args:
      kind: one of `jaxspeed.cost.hlo.COLLECTIVES`.
      nbytes: per-device bytes in the profiler's full-buffer convention.
      axes: mesh axes the group spans.
      mesh_shape: axis name → size (missing axes 1).
      devices_per_host: devices on one host.
      intra, inter: the links inside a host and between hosts.
      algorithm: "nccl" (the hierarchical costs above) or "gloo" (flat algorithms in the
        rank order `axes` gives, every group of the collective at once: `link_load`).
    """
    check_algorithm(algorithm)
    if algorithm == "gloo":
        load = link_load(kind, nbytes, ordered_groups(axes, mesh_shape), devices_per_host)
        return flat_seconds(load, devices_per_host=devices_per_host, intra=intra, inter=inter)
    shape = axis_sizes(mesh_shape)
    return _time(kind, nbytes, box(along(axes, shape), shape), devices_per_host, intra, inter)


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
      algorithm: "nccl" or "gloo" (see `collective_time`); gloo costs each collective's
        parsed groups in their rank order, all at once (no `scale_axes` with gloo).

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
            once = _time(op.kind, op.bytes, box(sets, real), devices_per_host, intra, inter)
        seconds = op.executions * once
        by_kind[op.kind] += seconds
        key = "+".join(axes)
        by_axes[key] = by_axes.get(key, 0.0) + seconds
    return {"total": sum(by_kind.values()), "by_kind": by_kind, "by_axes": by_axes}


def host_egress_bytes(
    kind: str, nbytes: float, groups: Iterable[Sequence[int]], devices_per_host: int,
    algorithm: str = "nccl",
) -> float:
    """Bytes the busiest host sends to other hosts in one collective: by the flat algorithm
    (`link_load`) for gloo; for nccl, the hierarchical one's inter-host step (each of a group's
    H hosts sends (H-1)/H of the buffer, twice for all-reduce; an all-to-all sends what goes
    to members on other hosts; a crossing permute its buffer)."""
    if algorithm == "gloo":
        return link_load(kind, nbytes, groups, devices_per_host).cross_host
    egress: Counter = Counter()
    for group in groups:
        hosts = Counter(d // devices_per_host for d in group)
        h, g = len(hosts), len(group)
        if h < 2:
            continue
        for host, m in hosts.items():
            if kind == "all-to-all":
                egress[host] += m * (g - m) / g * nbytes
            elif kind == "collective-permute":
                egress[host] += nbytes if group[0] // devices_per_host == host else 0.0
            else:
                egress[host] += (2 if kind == "all-reduce" else 1) * (h - 1) / h * nbytes
    return max(egress.values(), default=0.0)


def check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")
