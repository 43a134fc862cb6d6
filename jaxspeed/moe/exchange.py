"""An MoE layer's expert FFN on its dispatched capacity buffer, by strategy
(`jaxspeed.moe.strategies`): the exchanges with the experts' owners, or the experts gathered.

Runs inside `shard_map` (or a step's map) manual over the expert axis; `jaxspeed.moe.parallel`
calls it per device.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxspeed.moe.all_to_all import (
    a2a_chunk_count, collectives_overlap, hierarchical_all_to_all, within_host_all_to_all,
)
from jaxspeed.moe.experts import ExpertParams, expert_ffn
from jaxspeed.moe.strategies import choose
from jaxspeed.sharding.two_level import gather_across_hosts

if TYPE_CHECKING:
    from jaxspeed.moe.parallel import GatingOptions


def exchange(buf, experts: ExpertParams, *, opts: GatingOptions, expert_axis: str | None,
             ep: int):
    """The experts' FFN on the dispatched buffer `[E, S, M]`, by `opts.parallelism`
    (`jaxspeed.moe.strategies`): on the experts' owners (`expert`), here with every expert
    gathered (`data`), or on the owners inside the host with the other hosts' experts gathered
    (`expert_data`); `auto` picks one of them for this buffer's size. Returns the FFN's
    output and the strategy that ran (None without an expert axis).

    `expert`'s exchange is flat or, with `opts.all_to_all="hierarchical"`, inside each of the
    `opts.a2a_hosts` hosts first and then across them (`hierarchical_all_to_all`).
    With `opts.a2a_chunks` > 1 the `S` slots go out in that many chunks, each its own
    all-to-all, FFN and all-to-all back: chunk i+1's exchange has no dependence on chunk i's
    FFN, so a scheduler that runs collectives asynchronously (XLA:GPU's) overlaps them. The FFN
    is row by row, so the result is the unchunked one.
    """
    if ep == 1:
        return expert_ffn(buf, experts, activation=opts.activation), None
    hosts, hierarchical = opts.a2a_hosts or 1, opts.all_to_all == "hierarchical"
    strategy = choose(
        opts.parallelism, buffer_bytes=buf.size * buf.dtype.itemsize,
        weight_bytes=sum(w.size * w.dtype.itemsize for w in experts if w is not None),
        ep=ep, hosts=hosts, hierarchical=hierarchical, cluster=opts.cluster)
    gather = {"data": lambda w: jax.lax.all_gather(w, expert_axis, axis=0, tiled=True),
              "expert_data": lambda w: gather_across_hosts(w, expert_axis, hosts=hosts)}
    if strategy in gather:
        experts = ExpertParams(*(None if w is None else gather[strategy](w) for w in experts))
    if strategy == "data":
        return expert_ffn(buf, experts, activation=opts.activation), strategy
    if strategy == "expert_data":  # device l of each host owns the experts of shards h*L + l
        per_host = ep // hosts
        buf = swap_expert_blocks(buf, hosts, per_host)
        move = functools.partial(within_host_all_to_all, axis=expert_axis, hosts=hosts)
    else:
        move = functools.partial(hierarchical_all_to_all, axis=expert_axis,
                                 hosts=hosts if hierarchical else 1)
    row_bytes = buf.shape[0] * buf.shape[2] * buf.dtype.itemsize
    chunks = a2a_chunk_count(opts.a2a_chunks, buf.shape[1], row_bytes, ep,
                             overlap=collectives_overlap())

    def one(part):
        part = move(part, split_axis=0, concat_axis=1)
        return move(expert_ffn(part, experts, activation=opts.activation),
                        split_axis=1, concat_axis=0)

    out = one(buf) if chunks == 1 else jnp.concatenate(
        [one(part) for part in jnp.split(buf, chunks, axis=1)], axis=1)
    if strategy == "expert_data":
        out = swap_expert_blocks(out, per_host, hosts)
    return out, strategy


def swap_expert_blocks(buf, outer: int, inner: int):
    """`buf [E, ...]` with its experts as `[outer, inner, E / (outer * inner)]` blocks,
    reordered to `[inner, outer, ...]`: host-major shards to local-index-major and back."""
    blocks = buf.reshape(outer, inner, -1, *buf.shape[1:])
    return blocks.swapaxes(0, 1).reshape(buf.shape)
