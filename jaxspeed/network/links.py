"""One collective on one kind of link: the collective kinds, what a link is, the ring formulas.

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
presets), once per collective, or per step of a hierarchical one
(`jaxspeed.network.collectives`). No overlap with compute or between collectives is assumed.
"""

from __future__ import annotations

from typing import Protocol

#: The collective kinds, as XLA's HLO names them (`jaxspeed.cost.hlo` reads them by these).
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


class LinkSpeed(Protocol):
    """What a link needs for costing; `jaxspeed.config.cluster.Link` is one."""

    bandwidth_gbps: float  #: GB/s (1e9 bytes/s) one device sends while all send at once
    latency_us: float  #: one message hop
    # optionally `overhead_us`: once per collective, besides its hops (`overhead_seconds`)


def check_kind(kind: str) -> None:
    """Raises a `ValueError` unless `kind` is one of `COLLECTIVES`."""
    if kind not in COLLECTIVES:
        raise ValueError(
            f"kind: unknown collective {kind!r}; accepted kinds are {list(COLLECTIVES)}"
        )


def overhead_seconds(link: LinkSpeed) -> float:
    """A collective's fixed cost on `link`: its `overhead_us` (a `Cluster` link's), else 0."""
    return getattr(link, "overhead_us", 0.0) * 1e-6


def collective_seconds(kind: str, nbytes: float, group_size: int, link: LinkSpeed) -> float:
    """Seconds of one collective over `group_size` devices on one kind of link (module formulas).

    Args:
      kind: one of `COLLECTIVES`.
      nbytes: per-device bytes in the profiler's full-buffer convention.
      group_size: devices in the group; 1 costs nothing.
      link: anything with `bandwidth_gbps` (GB/s per device) and `latency_us`.
    """
    check_kind(kind)
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
