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
- `expert_tensor` (Tutel's r > 1, Megatron's expert tensor parallelism): `expert`'s exchange
  with each expert's hidden dimension left split over the `tensor` mesh axis, as it is stored:
  a device of a tensor group runs all the group's slots through its share of the hidden units
  and the shares' outputs are summed over `tensor`. The sharding degree r is `mesh.tensor`.
- `auto`: per capacity the step can run at, the strategy the cost model prices cheapest
  (`choose`): with a fixed capacity one choice; with `dynamic_capacity` one per capacity
  bucket, and each step runs the bucket its measured load needs, with that bucket's strategy.

On a mesh with a `tensor` axis the experts are stored split over it on their hidden dimension
(`[E, M, H]` as `expert x - x tensor`). Every strategy but `expert_tensor` runs an expert whole
where it runs (Tutel's r <= 1): the device gathers its experts' hidden units over `tensor` and
takes 1/t of the tensor group's slots (t = `mesh.tensor`), so its exchange moves 1/t of the
buffer, and the group's outputs are summed over `tensor` after the combine
(`jaxspeed.moe.expert_tensor`).
Without a `tensor` axis (r = 1) `expert_tensor` is `expert`.

The result is the same under every strategy, forward and gradients (tests/test_moe_strategies,
tests/test_moe_expert_tensor).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from jaxspeed.moe.all_to_all import a2a_chunk_count
from jaxspeed.moe.host_tokens import sends_tokens
from jaxspeed.network.collectives import collective_time
from jaxspeed.options.moe import PARALLELISMS

#: The strategies `auto` chooses from.
STRATEGIES = PARALLELISMS[:-1]

_log = logging.getLogger(__name__)


class Link(NamedTuple):
    """One class of link, as `jaxspeed.network.links` costs it."""

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
    """The `Links` of a `jaxspeed.config.cluster.Cluster` (what the GPT passes its MoE layers
    for `model.moe.cluster`, a file the model builder reads)."""
    link = lambda spec: Link(float(spec.bandwidth_gbps), float(spec.latency_us))  # noqa: E731
    return Links(link(cluster.intra_host), link(cluster.inter_host), cluster.collectives)


def exchange_mesh(ep: int, hosts: int, tp: int = 1) -> dict[str, int]:
    """The axes `strategy_collectives` prices on: the expert axis as `hosts` x `ep / hosts`
    devices, and the `tensor` axis (`tp`) inside each host."""
    return {"host": hosts, "expert": ep // hosts, "tensor": tp}


def per_host(mesh: dict[str, int]) -> int:
    """The devices on one host of an `exchange_mesh`."""
    return mesh["expert"] * mesh["tensor"]


def layer_sizes(*, slots: int, row_bytes: int, token_bytes: int, choices: int, weight_bytes: int,
                ep: int, hosts: int, hierarchical: bool, chunks: int | str,
                overlap: bool, tp: int = 1) -> dict[str, Any]:
    """The keyword arguments of `strategy_collectives` (and `strategy_seconds`, `choose`) for one
    device of a MoE layer: what the layer prices its step by and the planner prices it by.

    Args:
      slots, row_bytes: the capacity buffer `[E, slots, M]`, `row_bytes = E * M * itemsize`.
      token_bytes, choices: the device's tokens `[N, M]`, and their routing's entries (`N * k`),
        each an fp32 weight and an int32 slot when the tokens cross hosts.
      weight_bytes: the device's stored experts (their `1 / tp` share of the hidden units).
      chunks, overlap: `a2a_chunks`, and whether collectives run beside compute: where the
        slots go out in chunks that overlap the FFN, the tokens do not cross instead.
      tp: the `tensor` axis the experts' hidden units are split over.
    """
    chunked = overlap and a2a_chunk_count(chunks, slots, row_bytes, ep) > 1
    return dict(buffer_bytes=slots * row_bytes, weight_bytes=weight_bytes, ep=ep, hosts=hosts,
                hierarchical=hierarchical,
                token_bytes=token_bytes + choices * 8 if hierarchical and not chunked else None,
                tp=tp, output_bytes=token_bytes)


def moved_buffer(strategy: str, buffer_bytes: int, tp: int) -> int:
    """The capacity buffer's bytes a device exchanges under `strategy`: `expert_tensor` all of
    the tensor group's slots, every other strategy its `1 / tp` of them (padded up)."""
    if strategy == "expert_tensor" or tp == 1:
        return buffer_bytes
    return -(-buffer_bytes // tp)


def tokens_cross(sizes: dict[str, Any], strategy: str = "expert") -> bool:
    """Whether `expert`'s (or `expert_tensor`'s) hierarchical exchange sends the tokens across
    hosts instead of the slots, for `layer_sizes`' `sizes`: where they were offered and are
    fewer bytes than the slots `strategy` moves."""
    return sizes["token_bytes"] is not None and sends_tokens(
        token_bytes=sizes["token_bytes"], hosts=sizes["hosts"],
        buffer_bytes=moved_buffer(strategy, sizes["buffer_bytes"], sizes.get("tp", 1)))


def strategy_collectives(strategy: str, *, buffer_bytes: int, weight_bytes: int, ep: int,
                         hosts: int, hierarchical: bool = False, token_bytes: int | None = None,
                         tp: int = 1, output_bytes: int = 0) -> list[tuple[str, float, tuple, int]]:
    """What crosses the expert and tensor axes in one MoE layer's step (forward and backward)
    under `strategy`: `(kind, bytes per device, axes of exchange_mesh(ep, hosts, tp), count)`
    each.

    Args:
      strategy: one of `STRATEGIES`.
      buffer_bytes: one device's capacity buffer `[E, S, M]` (what an all-to-all moves).
      weight_bytes: one device's stored experts (`E / ep` of them, `1 / tp` of their hidden
        units).
      ep: devices on the expert axis; hosts: the hosts it spans (dividing `ep`).
      hierarchical: `expert`'s all-to-all runs in two stages (`hierarchical_all_to_all`).
      token_bytes: one device's tokens `[N, M]` and their routing: with `hierarchical`, what
        goes across hosts instead of the slots where it is fewer (`jaxspeed.moe.host_tokens`).
      tp: the `tensor` axis; output_bytes: one device's output `[N, M]` (summed over `tensor`
        where an expert runs whole, `jaxspeed.moe.expert_tensor`).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    moved = moved_buffer(strategy, buffer_bytes, tp)
    tensor = []
    if tp > 1 and strategy == "expert_tensor":  # the FFN's output and its input's cotangent
        tensor = [("all-reduce", buffer_bytes, ("tensor",), 2)]
    elif tp > 1:  # the hidden units gathered and their gradient back; the output, dx summed
        weight_bytes *= tp
        tensor = [("all-gather", weight_bytes, ("tensor",), 1),
                  ("reduce-scatter", weight_bytes, ("tensor",), 1),
                  ("all-reduce", output_bytes, ("tensor",), 2)]
    every = ("host", "expert")
    if strategy == "data":
        return tensor + [("all-gather", ep * weight_bytes, every, 1),
                         ("reduce-scatter", ep * weight_bytes, every, 1)]
    if strategy == "expert_data":
        return tensor + [("collective-permute", weight_bytes, ("host",), 2 * (hosts - 1)),
                         ("all-to-all", moved, ("expert",), 4)]
    sizes = dict(token_bytes=token_bytes, buffer_bytes=buffer_bytes, hosts=hosts, tp=tp)
    tokens = tokens_cross(sizes, strategy)
    if hierarchical and (tokens or 1 < hosts < ep):
        across = token_bytes if tokens else moved / hosts
        return tensor + [("all-to-all", moved, ("expert",), 4),
                         ("collective-permute", across, ("host",), 4 * (hosts - 1))]
    return tensor + [("all-to-all", moved, every, 4)]


def strategy_seconds(strategy: str, *, cluster: Links | None = None, **sizes) -> float:
    """The expert axis's communication of one MoE layer's step (forward and backward) under
    `strategy` (`strategy_collectives`, whose keyword arguments `sizes` are), by
    `jaxspeed.network.collectives`' model on the cluster's links (`links_of`; None: `UNIFORM`)."""
    intra, inter, algorithm = cluster or UNIFORM
    mesh = exchange_mesh(sizes["ep"], sizes["hosts"], sizes.get("tp", 1))
    return sum(count * collective_time(kind, nbytes, axes, mesh, devices_per_host=per_host(mesh),
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
              "%d B a device, %d devices on %d host(s), sharding degree %d)", best,
              ", ".join(f"{s} {1e3 * t:.2f} ms" for s, t in prices.items()),
              sizes["buffer_bytes"], sizes["weight_bytes"], sizes["ep"], sizes["hosts"],
              sizes.get("tp", 1))
    return best
