"""Gloo's flat collectives on a slow network: what each puts on the links, and how long it takes.

Gloo, which carries XLA:CPU's collectives between processes, runs flat algorithms in the group's
rank order: all-reduce as one ring (reduce-scatter, then all-gather: 2(g-1) rounds of B/g per
edge), all-gather as one ring ((g-1) rounds of B/g), reduce-scatter by recursive halving (round
s exchanges B/2^(s+1) with rank XOR 2^s; a ring where g is not a power of 2), all-to-all as
direct sends of B/g to every peer, and collective-permute as one send. Each message goes over
the link its two ends share, so what bounds a gloo collective on a slow network is the bytes the
busiest host sends to other hosts (its NIC) plus one latency per round.

Recursive halving (`gloo::ReduceScatterHalvingDoubling`) leaves rank r holding the block of rank
bit-reverse(r), so a last round sends each such block (B/g) to its owner: for g = 4 ranks 1 and
2 swap theirs, which on 2 hosts x 2 devices crosses hosts in either rank order. Measured across
a 100 Mbit/s link on 2 hosts x 2 devices (6 MiB of fp32 per device, in pieces of at most 1 MiB):
0.66 s in rank order 0-2-1-3 (`data` before `host`), 0.40 s in 0-1-2-3; this model gives 0.67 s
and 0.40 s (without that round: 0.54 s and 0.27 s).

Gloo's reduce-scatter and all-to-all send each peer its whole share as one message. Over that
link a message past about a MiB runs slower than the link (TCP overruns the shaper's queue):
the same 6 MiB reduce-scatter in one piece took 0.99 s, not 0.66 s, while the ring all-gather
and all-reduce, which pipeline their messages, ran at the link's rate at every size measured.
The explicit ZeRO-3 step therefore cuts its reduce-scatters into pieces on gloo
(`zero_optimization.max_reduce_scatter_elements`); this model prices every message at the
link's rate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from jaxspeed.network.links import LinkSpeed, check_kind, overhead_seconds


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
        steps = g.bit_length() - 1
        for step in range(steps):
            for i, s in enumerate(group):
                yield s, group[i ^ (1 << step)], nbytes / 2 ** (step + 1)
        for i, s in enumerate(group):  # each reduced block to its owner (module docstring)
            if _bit_reversed(i, steps) != i:
                yield s, group[_bit_reversed(i, steps)], nbytes / g
    else:  # rings: all-reduce twice around, all-gather (and reduce-scatter otherwise) once
        per_edge = (2 if kind == "all-reduce" else 1) * (g - 1) / g * nbytes
        yield from ((s, group[(i + 1) % g], per_edge) for i, s in enumerate(group))


def _bit_reversed(i: int, bits: int) -> int:
    """`i`'s lowest `bits` bits in reverse order (the block recursive halving leaves on rank i)."""
    return int(format(i, f"0{bits}b")[::-1], 2) if bits else i


def _rounds(kind: str, g: int) -> int:
    if kind == "collective-permute":
        return 1
    if kind == "reduce-scatter" and _power_of_two(g):
        steps = g.bit_length() - 1
        return steps + (g > 2)  # the halving steps, then the blocks to their owners
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
      kind: one of `jaxspeed.network.links.COLLECTIVES`.
      nbytes: per-device bytes in the profiler's full-buffer convention.
      groups: device ids of each group in rank order (`ordered_groups`, or parsed replica
        groups); collective-permute: `(source, target)` pairs.
      devices_per_host: device `d` sits on host `d // devices_per_host`.
    """
    check_kind(kind)
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
    """Seconds of a flat collective of `load`: its busiest link's bytes, plus a latency a round
    and the link's fixed cost a collective (`overhead_us`).

    A host's network link moves `inter.bandwidth_gbps x devices_per_host` (the cluster's
    figures are per device with every device sending); the links inside a host run at once.
    """
    host_bw = inter.bandwidth_gbps * 1e9 * devices_per_host
    busiest = max(load.cross_host / host_bw, load.intra_host / (intra.bandwidth_gbps * 1e9))
    link = inter if load.crosses else intra
    return busiest + load.rounds * link.latency_us * 1e-6 + overhead_seconds(link)
