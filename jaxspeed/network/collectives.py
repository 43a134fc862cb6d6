"""How long one collective along mesh axes takes on a cluster's hosts and links.

Placement (`jaxspeed.network.placement`): device `d` of the row-major mesh sits on host
`d // devices_per_host`. All groups of a collective are alike, so the one holding device 0
stands for them.

Each step is the ring formula of `jaxspeed.network.links` on its link. A group that spans H
hosts with k members on each is costed hierarchically (`collective_time`), as NCCL runs it
(`ALGORITHMS[0]`, "nccl"). Gloo, which carries XLA:CPU's collectives between processes, runs
flat algorithms in the group's rank order instead (`ALGORITHMS[1]`, "gloo";
`jaxspeed.network.gloo`). No overlap with compute or between collectives is assumed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from jaxspeed.network.gloo import flat_seconds, link_load
from jaxspeed.network.links import LinkSpeed, collective_seconds
from jaxspeed.network.placement import along, axis_sizes, box, ordered_groups

#: Collective algorithm families a cluster's communication library runs (see the docstring).
ALGORITHMS = ("nccl", "gloo")


def check_algorithm(algorithm: str) -> None:
    """Raises a `ValueError` unless `algorithm` is one of `ALGORITHMS`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")


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


def hierarchical_seconds(
    kind: str, nbytes: float, members: Sequence[int], devices_per_host: int,
    intra: LinkSpeed, inter: LinkSpeed,
) -> float:
    """Seconds of one collective over the devices `members`, as NCCL runs it across hosts
    (the steps are in `collective_time`'s docstring)."""
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
      kind: one of `jaxspeed.network.links.COLLECTIVES`.
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
    return hierarchical_seconds(kind, nbytes, box(along(axes, shape), shape), devices_per_host,
                                intra, inter)


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
