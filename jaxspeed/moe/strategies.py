"""Where an MoE layer's work moves, over one stored layout of the experts (Tutel's adaptive
parallelism: Hwang et al. 2023, "Tutel: Adaptive Mixture-of-Experts at Scale", section 3.2).

The experts are stored one way whatever runs: `[E, ...]` split over the `expert` mesh axis,
`E / ep` whole experts a device, devices host-major. Every strategy runs from that layout, so
switching moves no stored weight; what differs is what crosses the axis in a step:

- `expert` (Tutel's r = 1): the tokens go to their experts' owners and back, four
  all-to-alls of the capacity buffer `[E, S, M]` a step (two forward, their transposes
  backward). The weights stay.
- `data` (Tutel's r = 0, ZeRO-gathered experts): every device gathers all experts' weights
  and the tokens stay; the weights' gradient goes back reduce-scattered (the gather's
  transpose).
- `expert_data`: `data` across hosts, `expert` inside each host. A device gathers the experts
  of its local index on every other host (`gather_across_hosts`), and the tokens are exchanged
  among the devices of the host only (`within_host_all_to_all`), so nothing batch-sized
  crosses a host: the slow link carries the weights and their gradient, a fixed amount,
  instead of a buffer that grows with the batch.
- `auto`: per capacity the step can run at, the strategy the cost model prices cheapest
  (`choose`): with a fixed capacity one choice; with `dynamic_capacity` one per capacity
  bucket, and each step runs the bucket its measured load needs, with that bucket's strategy.

Tutel also splits one expert over several devices when devices outnumber experts (its r between
1 and W/E). Here E is a multiple of the expert axis, and an expert's hidden dimension is split
by the `tensor` mesh axis instead, under every strategy.

The result is the same under every strategy, forward and gradients (tests/test_moe_strategies).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from jaxspeed.moe.all_to_all import a2a_chunk_count
from jaxspeed.moe.host_tokens import sends_tokens

#: `MoE.parallelism` values.
PARALLELISMS = ("expert", "data", "expert_data", "auto")
#: The strategies `auto` chooses from.
STRATEGIES = PARALLELISMS[:-1]

_log = logging.getLogger(__name__)


class Link(NamedTuple):
    """One class of link, as `jaxspeed.autoplan.comm` costs it."""

    bandwidth_gbps: float
    latency_us: float


class Links(NamedTuple):
    """The links `auto` prices the strategies on: a cluster's (`links_of`), hashable, so a Flax
    layer can hold them."""

    intra: Link
    inter: Link
    algorithm: str = "nccl"  #: the cluster's `collectives`


#: No cluster given: every byte costs the same, inside a host or across, so `auto` picks the
#: strategy that moves the fewest bytes.
UNIFORM = Links(Link(1.0, 0.0), Link(1.0, 0.0))


def links_of(cluster: Any) -> Links:
    """The `Links` of a `jaxspeed.autoplan.cluster.Cluster` (what the GPT passes its MoE layers
    for `model.moe.cluster`, a file the model builder reads)."""
    link = lambda spec: Link(float(spec.bandwidth_gbps), float(spec.latency_us))  # noqa: E731
    return Links(link(cluster.intra_host), link(cluster.inter_host), cluster.collectives)


def exchange_mesh(ep: int, hosts: int) -> dict[str, int]:
    """The expert axis as `strategy_collectives` prices it: `hosts` x `ep / hosts` devices."""
    return {"host": hosts, "expert": ep // hosts}


def layer_sizes(*, slots: int, row_bytes: int, token_bytes: int, choices: int, weight_bytes: int,
                ep: int, hosts: int, hierarchical: bool, chunks: int | str,
                overlap: bool) -> dict[str, Any]:
    """The keyword arguments of `strategy_collectives` (and `strategy_seconds`, `choose`) for one
    device of a MoE layer: what the layer prices its step by and the planner prices it by.

    Args:
      slots, row_bytes: the capacity buffer `[E, slots, M]`, `row_bytes = E * M * itemsize`.
      token_bytes, choices: the device's tokens `[N, M]`, and their routing's entries (`N * k`),
        each an fp32 weight and an int32 slot when the tokens cross hosts.
      weight_bytes: the device's stored experts.
      chunks, overlap: `a2a_chunks`, and whether collectives run beside compute: where the
        slots go out in chunks that overlap the FFN, the tokens do not cross instead.
    """
    chunked = overlap and a2a_chunk_count(chunks, slots, row_bytes, ep) > 1
    return dict(buffer_bytes=slots * row_bytes, weight_bytes=weight_bytes, ep=ep, hosts=hosts,
                hierarchical=hierarchical,
                token_bytes=token_bytes + choices * 8 if hierarchical and not chunked else None)


def tokens_cross(sizes: dict[str, Any]) -> bool:
    """Whether `expert`'s hierarchical exchange sends the tokens across hosts instead of the
    slots, for `layer_sizes`' `sizes`: where they were offered and are fewer bytes."""
    return sizes["token_bytes"] is not None and sends_tokens(
        token_bytes=sizes["token_bytes"], buffer_bytes=sizes["buffer_bytes"],
        hosts=sizes["hosts"])


def strategy_collectives(strategy: str, *, buffer_bytes: int, weight_bytes: int, ep: int,
                         hosts: int, hierarchical: bool = False,
                         token_bytes: int | None = None) -> list[tuple[str, float, tuple, int]]:
    """What crosses the expert axis in one MoE layer's step (forward and backward) under
    `strategy`: `(kind, bytes per device, axes of exchange_mesh(ep, hosts), count)` each.

    Args:
      strategy: one of `STRATEGIES`.
      buffer_bytes: one device's capacity buffer `[E, S, M]` (what an all-to-all moves).
      weight_bytes: one device's stored experts (`E / ep` of them).
      ep: devices on the expert axis; hosts: the hosts it spans (dividing `ep`).
      hierarchical: `expert`'s all-to-all runs in two stages (`hierarchical_all_to_all`).
      token_bytes: one device's tokens `[N, M]` and their routing: with `hierarchical`, what
        goes across hosts instead of the slots where it is fewer (`jaxspeed.moe.host_tokens`).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    every = ("host", "expert")
    if strategy == "data":
        return [("all-gather", ep * weight_bytes, every, 1),
                ("reduce-scatter", ep * weight_bytes, every, 1)]
    if strategy == "expert_data":
        return [("collective-permute", weight_bytes, ("host",), 2 * (hosts - 1)),
                ("all-to-all", buffer_bytes, ("expert",), 4)]
    tokens = tokens_cross(dict(token_bytes=token_bytes, buffer_bytes=buffer_bytes, hosts=hosts))
    if hierarchical and (tokens or 1 < hosts < ep):
        across = token_bytes if tokens else buffer_bytes / hosts
        return [("all-to-all", buffer_bytes, ("expert",), 4),
                ("collective-permute", across, ("host",), 4 * (hosts - 1))]
    return [("all-to-all", buffer_bytes, every, 4)]


def strategy_seconds(strategy: str, *, cluster: Links | None = None, **sizes) -> float:
    """The expert axis's communication of one MoE layer's step (forward and backward) under
    `strategy` (`strategy_collectives`, whose keyword arguments `sizes` are), by
    `jaxspeed.autoplan.comm`'s model on the cluster's links (`links_of`; None: `UNIFORM`)."""
    from jaxspeed.autoplan.comm import collective_time  # the planner's link model

    intra, inter, algorithm = cluster or UNIFORM
    mesh = exchange_mesh(sizes["ep"], sizes["hosts"])
    return sum(count * collective_time(kind, nbytes, axes, mesh, devices_per_host=mesh["expert"],
                                       intra=intra, inter=inter, algorithm=algorithm)
               for kind, nbytes, axes, count in strategy_collectives(strategy, **sizes))


def cheapest(**sizes) -> tuple[str, dict[str, float]]:
    """The strategy `strategy_seconds` prices cheapest on `sizes` (ties go to the earlier of
    `STRATEGIES`), and every strategy's price."""
    prices = {s: strategy_seconds(s, **sizes) for s in STRATEGIES}
    return min(STRATEGIES, key=prices.get), prices


def choose(parallelism: str, **sizes) -> str:
    """The strategy that runs for `parallelism` (`auto`: the cheapest by `strategy_seconds`
    on `sizes`, its keyword arguments; ties go to the earlier of `STRATEGIES`), logged once per
    traced layer and capacity."""
    if parallelism != "auto":
        return parallelism
    best, prices = cheapest(**sizes)
    _log.info("MoE parallelism auto: %s (priced per step: %s; capacity buffer %d B, experts "
              "%d B a device, %d devices on %d host(s))", best,
              ", ".join(f"{s} {1e3 * t:.2f} ms" for s, t in prices.items()),
              sizes["buffer_bytes"], sizes["weight_bytes"], sizes["ep"], sizes["hosts"])
    return best
