"""How long a compiled step's collectives take on a cluster's links.

Placement: devices are numbered row-major over the mesh shape in `AXES` order (tensor
innermost), which is the order of SPMD partition ids, and device `d` sits on host
`d // devices_per_host`. A collective's group is a box of the mesh: the devices that differ from
one member only along the group's axes. All groups of a collective are alike, so the one holding
device 0 stands for them.

Costs are the ring / pairwise bandwidth-latency model on per-device bytes, in the profiler's
convention: the full buffer (all-gather: the gathered output; reduce-scatter: the unscattered
input; all-reduce, all-to-all: the operand; collective-permute: what one device sends). With
`bw` = `bandwidth_gbps`·1e9 bytes/s and `lat` = `latency_us`·1e-6 s, over `g` devices:

  all-reduce          2(g-1)/g · B/bw + 2(g-1) · lat   (reduce-scatter, then all-gather)
  all-gather          (g-1)/g · B/bw + (g-1) · lat
  reduce-scatter      (g-1)/g · B/bw + (g-1) · lat
  all-to-all          (g-1)/g · B/bw + (g-1) · lat
  collective-permute  B/bw + lat

A group that spans H hosts with k members on each is costed hierarchically (`collective_time`),
as NCCL runs it (`ALGORITHMS[0]`, "nccl"). Gloo, which carries XLA:CPU's collectives between
processes, runs flat algorithms in the group's rank order instead (`ALGORITHMS[1]`, "gloo";
`link_load`): all-reduce as one ring (reduce-scatter, then all-gather: 2(g-1) rounds of B/g
per edge), all-gather as one ring ((g-1) rounds of B/g), reduce-scatter by recursive halving
(round s exchanges B/2^(s+1) with rank XOR 2^s; a ring where g is not a power of 2),
all-to-all as direct sends of B/g to every peer, and collective-permute as one send. Each
message goes over the link its two ends share, so what bounds a gloo collective on a slow
network is the bytes the busiest host sends to other hosts (its NIC) plus one latency per
round. No overlap with compute or between collectives is assumed.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

from jaxspeed.runtime.mesh import AXES
from jaxspeed.cost.hlo import COLLECTIVES, Collective


#: Collective algorithm families a cluster's communication library runs (see the docstring).
ALGORITHMS = ("nccl", "gloo")


class LinkSpeed(Protocol):
    """What a link needs for costing; `jaxspeed.autoplan.cluster.Link` is one."""

    bandwidth_gbps: float  #: GB/s (1e9 bytes/s) one device sends while all send at once
    latency_us: float  #: one message hop


def _shape(mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
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


def _coords(device: int, shape: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        device, c = divmod(device, size)
        coords.append(c)
    return tuple(reversed(coords))


def _device(coords: Sequence[int], shape: Sequence[int]) -> int:
    device = 0
    for c, size in zip(coords, shape):
        device = device * size + c
    return device


def _box(sets: Sequence[Iterable[int]], shape: Sequence[int]) -> list[int]:
    """Device ids of the product of per-axis coordinate sets."""
    return [_device(c, shape) for c in itertools.product(*sets)]


def _along(axes: Sequence[str], shape: Sequence[int]) -> list[range]:
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
    shape = _shape(mesh_shape)
    devices = math.prod(shape)
    differ: set[int] = set()
    for group in groups:
        bad = [d for d in group if not 0 <= d < devices]
        if bad:
            raise ValueError(f"groups: device ids {bad} are outside the mesh {dict(mesh_shape)} "
                             f"of {devices} devices")
        coords = [_coords(d, shape) for d in group]
        differ.update(i for c in coords[1:] for i in range(len(AXES)) if c[i] != coords[0][i])
    return tuple(AXES[i] for i in sorted(differ))


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
        return nbytes / bw + lat
    rounds = 2 if kind == "all-reduce" else 1
    return rounds * ((g - 1) / g * nbytes / bw + (g - 1) * lat)


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
    shape = _shape(mesh_shape)
    return _placement(_box(_along(axes, shape), shape), devices_per_host)


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
    shape = _shape(mesh_shape)
    return _time(kind, nbytes, _box(_along(axes, shape), shape), devices_per_host, intra, inter)


def _real_shape(
    mesh_shape: Mapping[str, int], scale_axes: Mapping[str, int] | None
) -> tuple[int, ...]:
    shape = _shape(mesh_shape)
    if not scale_axes:
        return shape
    real = _shape({**mesh_shape, **scale_axes})
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
    shape = _shape(mesh_shape)
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
            sets = _along(axes, shape)
        else:
            group = next((g for g in groups if 0 in g), groups[0])
            coords = [_coords(d, shape) for d in group]
            sets = [sorted({c[i] for c in coords}) for i in range(len(AXES))]
        sets = [range(real[i]) if AXES[i] in scaled and len(s) > 1 else s
                for i, s in enumerate(sets)]
        if algorithm == "gloo":
            load = link_load(op.kind, op.bytes, groups, devices_per_host)
            once = flat_seconds(load, devices_per_host=devices_per_host, intra=intra, inter=inter)
        else:
            once = _time(op.kind, op.bytes, _box(sets, real), devices_per_host, intra, inter)
        seconds = op.executions * once
        by_kind[op.kind] += seconds
        key = "+".join(axes)
        by_axes[key] = by_axes.get(key, 0.0) + seconds
    return {"total": sum(by_kind.values()), "by_kind": by_kind, "by_axes": by_axes}


# -- flat (gloo) algorithms ------------------------------------------------------------------


def ordered_groups(axes: Sequence[str], mesh_shape: Mapping[str, int]) -> list[list[int]]:
    """Every group of a collective along `axes`, each in its rank order: `axes[0]` major.

    The order is the one a collective's replica groups list (a ZeRO gather over
    `("data", "host")` ranks data-major), which decides the ring's neighbours.
    """
    shape = _shape(mesh_shape)
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
            members.append(_device(coords, shape))
        groups.append(members)
    return groups


def _power_of_two(g: int) -> bool:
    return g & (g - 1) == 0


def _sends(kind: str, nbytes: float, group: Sequence[int]) -> Iterable[tuple[int, int, float]]:
    """(source, target, bytes) of every message of one flat collective over `group`."""
    g = len(group)
    if kind == "collective-permute":  # a group is a (source, target) pair
        yield group[0], group[-1], nbytes
    elif kind == "all-to-all":
        yield from ((s, t, nbytes / g) for s in group for t in group if s != t)
    elif kind == "reduce-scatter" and _power_of_two(g):
        for step in range(g.bit_length() - 1):
            for i, s in enumerate(group):
                yield s, group[i ^ (1 << step)], nbytes / 2 ** (step + 1)
    else:  # rings: all-reduce twice around, all-gather (and reduce-scatter otherwise) once
        per_edge = (2 if kind == "all-reduce" else 1) * (g - 1) / g * nbytes
        yield from ((s, group[(i + 1) % g], per_edge) for i, s in enumerate(group))


def _rounds(kind: str, g: int) -> int:
    if kind == "collective-permute":
        return 1
    if kind == "reduce-scatter" and _power_of_two(g):
        return g.bit_length() - 1
    return (2 if kind == "all-reduce" else 1) * (g - 1)


class LinkLoad(NamedTuple):
    """What one flat collective puts on the links (`link_load`)."""

    cross_host: float  #: bytes the busiest host sends to other hosts
    intra_host: float  #: bytes the busiest device sends to devices of its own host
    rounds: int  #: message rounds one after another (each pays one latency)
    crosses: bool  #: whether some message crosses hosts


def link_load(
    kind: str, nbytes: float, groups: Iterable[Sequence[int]], devices_per_host: int
) -> LinkLoad:
    """The load of one gloo collective (module docstring), all its groups running at once.

    Args:
      kind: one of `jaxspeed.cost.hlo.COLLECTIVES`.
      nbytes: per-device bytes in the profiler's full-buffer convention.
      groups: device ids of each group in rank order (`ordered_groups`, or parsed replica
        groups); collective-permute: `(source, target)` pairs.
      devices_per_host: device `d` sits on host `d // devices_per_host`.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"kind: unknown collective {kind!r}; accepted kinds are {list(COLLECTIVES)}")
    if devices_per_host < 1:
        raise ValueError(f"devices_per_host must be >= 1, got {devices_per_host}")
    egress: Counter = Counter()
    inside: Counter = Counter()
    rounds = 0
    for group in groups:
        if len(group) < 2 or (kind == "collective-permute" and group[0] == group[-1]):
            continue
        rounds = max(rounds, _rounds(kind, len(group)))
        for source, target, b in _sends(kind, nbytes, group):
            if source // devices_per_host != target // devices_per_host:
                egress[source // devices_per_host] += b
            else:
                inside[source] += b
    return LinkLoad(max(egress.values(), default=0.0), max(inside.values(), default=0.0),
                    rounds, bool(egress))


def flat_seconds(load: LinkLoad, *, devices_per_host: int, intra: LinkSpeed,
                 inter: LinkSpeed) -> float:
    """Seconds of a flat collective of `load`: its busiest link's bytes, plus a latency a round.

    A host's network link moves `inter.bandwidth_gbps x devices_per_host` (the cluster's
    figures are per device with every device sending); the links inside a host run at once.
    """
    host_bw = inter.bandwidth_gbps * 1e9 * devices_per_host
    busiest = max(load.cross_host / host_bw, load.intra_host / (intra.bandwidth_gbps * 1e9))
    latency = (inter if load.crosses else intra).latency_us * 1e-6
    return busiest + load.rounds * latency


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
