"""An MoE layer's experts on a device's routed tokens, by strategy (`jaxspeed.moe.strategies`):
dispatched to the capacity buffer, exchanged with the experts' owners (or the experts
gathered), and combined back.

Runs inside `shard_map` (or a step's map) manual over the expert axis; `jaxspeed.moe.parallel`
calls it per device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspeed.moe.all_to_all import (
    a2a_chunk_count, collectives_overlap, hierarchical_all_to_all, within_host_all_to_all,
)
from jaxspeed.moe.dispatch import combine, dispatch
from jaxspeed.moe.experts import ExpertParams
from jaxspeed.moe.expert_tensor import Whole, split_ffn
from jaxspeed.moe.gating import Routing
from jaxspeed.moe.host_tokens import exchange_tokens
from jaxspeed.moe.options import GatingOptions
from jaxspeed.moe.strategies import choose, layer_sizes, tokens_cross
from jaxspeed.sharding.two_level import gather_across_hosts


def exchange(x, routing: Routing, experts: ExpertParams, *, groups: int, opts: GatingOptions,
             expert_axis: str | None, ep: int, tensor: str | None = None, tp: int = 1):
    """The experts' outputs for this device's tokens `x [N, M]`, combined, by
    `opts.parallelism` (`jaxspeed.moe.strategies`): on the experts' owners (`expert`,
    `expert_tensor`), here with every expert gathered (`data`), or on the owners inside the host
    with the other hosts' experts gathered (`expert_data`); `auto` picks one of them for the
    capacity buffer's size. Returns the output `[N, M]` and the strategy that ran (None without
    an expert axis).

    Args:
      x: `[N, M]`, this device's `groups` token groups one after another.
      routing: their routing over `groups * E` virtual experts (`parallel._flat_routing`).
      tensor, tp: the manual mesh axis the experts' hidden units are split over, and its size
        (`jaxspeed.moe.expert_tensor`); None: not split.

    `expert`'s exchange is flat or, with `opts.all_to_all="hierarchical"`, inside each of the
    `opts.a2a_hosts` hosts first and then across them: the capacity buffer's slots
    (`hierarchical_all_to_all`), or the tokens themselves where they are fewer bytes
    (`jaxspeed.moe.host_tokens`), unless collectives overlap compute and the slots go out in
    chunks. With `opts.a2a_chunks` > 1 the slots go out in that many chunks
    (`through_owners`; the tokens' exchange chunks its stage inside the host).
    """
    num_experts, capacity, width = opts.num_experts, routing.capacity, x.shape[1]
    if ep == 1:
        ffn = split_ffn(experts, axis=tensor, activation=opts.activation, fp8=opts.fp8)
        return _on_buffer(x, routing, groups, opts, ffn), None
    hosts, hierarchical = opts.a2a_hosts or 1, opts.all_to_all == "hierarchical"
    # The tokens with their routing may cross instead of the slots, unless the slots go out in
    # chunks whose exchanges overlap the FFN: the tokens cross in one piece before it.
    sizes = layer_sizes(
        slots=groups * capacity, row_bytes=num_experts * width * x.dtype.itemsize,
        token_bytes=x.size * x.dtype.itemsize, choices=routing.weight.size,
        weight_bytes=sum(w.size * w.dtype.itemsize for w in experts if w is not None),
        ep=ep, hosts=hosts, hierarchical=hierarchical, chunks=opts.a2a_chunks,
        overlap=collectives_overlap(), tp=tp)
    strategy = choose(opts.parallelism, cluster=opts.cluster, **sizes)
    whole = Whole(tensor, tp) if tensor is not None and strategy != "expert_tensor" else None
    if whole is not None:  # each expert whole here, on this device's share of the slots
        experts, x = whole.experts(experts), whole.tokens(x)
    ran = _exchange(strategy, x, routing, experts, groups=groups, opts=opts, sizes=sizes,
                    expert_axis=expert_axis, ep=ep, whole=whole,
                    split=tensor if whole is None else None)
    return (ran if whole is None else whole.output(ran)), strategy


def _exchange(strategy: str, x, routing: Routing, experts: ExpertParams, *, groups: int,
              opts: GatingOptions, sizes: dict, expert_axis: str, ep: int, whole: Whole | None,
              split: str | None):
    """`exchange`'s output under `strategy`, the experts' FFN on the `whole` device's share of
    the slots (None: all of them) or split over the `split` axis (None: not split)."""
    hosts = sizes["hosts"]
    share = (lambda ffn: ffn) if whole is None else whole.slots
    gather = {"data": lambda w: jax.lax.all_gather(w, expert_axis, axis=0, tiled=True),
              "expert_data": lambda w: gather_across_hosts(w, expert_axis, hosts=hosts)}
    if strategy in gather:
        experts = ExpertParams(*(None if w is None else gather[strategy](w) for w in experts))
    ffn_of = functools.partial(split_ffn, axis=split, activation=opts.activation, fp8=opts.fp8)
    if strategy == "data":
        return _on_buffer(x, routing, groups, opts, share(ffn_of(experts)))

    def owners(all_to_all, spans: int):  # the FFN on its owners, `all_to_all` over `spans` hosts
        move = functools.partial(all_to_all, axis=expert_axis, hosts=spans)
        return share(functools.partial(through_owners, experts=experts, ffn_of=ffn_of, opts=opts,
                                       ep=ep, move=move))

    inside = owners(within_host_all_to_all, hosts)
    if strategy != "expert_data" and tokens_cross(sizes, strategy):
        return exchange_tokens(x, routing, inside, groups=groups, num_experts=opts.num_experts,
                               axis=expert_axis, hosts=hosts, impl=opts.impl)
    if strategy == "expert_data":  # device l of each host owns the experts of shards h*L + l
        per_host = ep // hosts
        return _on_buffer(x, routing, groups, opts, lambda buf: swap_expert_blocks(
            inside(swap_expert_blocks(buf, hosts, per_host)), per_host, hosts))
    return _on_buffer(x, routing, groups, opts, owners(
        hierarchical_all_to_all, hosts if sizes["hierarchical"] else 1))


def _on_buffer(x, routing: Routing, groups: int, opts: GatingOptions, ffn):
    """`x` dispatched to this device's capacity buffer `[E, G_l * C, M]`, `ffn` on it, and
    combined back."""
    num_experts, capacity, width = opts.num_experts, routing.capacity, x.shape[1]
    buf = dispatch(x, routing, groups * num_experts, impl=opts.impl)  # [G_l*E, C, M]
    buf = buf.reshape(groups, num_experts, capacity, width).swapaxes(0, 1)
    out = ffn(buf.reshape(num_experts, groups * capacity, width))
    out = out.reshape(num_experts, groups, capacity, width).swapaxes(0, 1)
    return combine(out.reshape(groups * num_experts, capacity, width), routing, impl=opts.impl)


def through_owners(buf, *, experts: ExpertParams, ffn_of, opts: GatingOptions, ep: int, move):
    """The experts' FFN (`ffn_of(experts)`, on `[E / ep, S', M]`) on their slots `buf [E', S, M]`,
    run where `move` (an all-to-all, `split_axis` experts and `concat_axis` slots) takes each
    expert's slots, and moved back.

    With `opts.a2a_chunks` > 1 the `S` slots go out in that many chunks, each its own
    all-to-all, FFN and all-to-all back: chunk i+1's exchange has no dependence on chunk i's
    FFN, so a scheduler that runs collectives asynchronously (XLA:GPU's) overlaps them. The FFN
    is row by row, so the result is the unchunked one.

    Each chunk's FFN reads the weights through an optimization barrier with that chunk's slots
    (`_weights_for`). Without it XLA:GPU's dot merger (`DotMerger`, for matmuls up to
    `--xla_gpu_dot_merger_threshold_mb`, 32 MiB by default) turns the chunks' matmuls, which
    share the weights, into one matmul on the concatenation of all the chunks' slots: it waits
    for every chunk's exchange, and no chunk's FFN overlaps another chunk's exchange. Measured
    on jax 0.12.0 and 0.12.1 (`tests/test_moe_a2a_gpu.py`, 2 chunks: 2 matmuls inside
    exchanges merged, 10 with the barrier).
    """
    row_bytes = buf.shape[0] * buf.shape[2] * buf.dtype.itemsize
    chunks = a2a_chunk_count(opts.a2a_chunks, buf.shape[1], row_bytes, ep,
                             overlap=collectives_overlap())

    def one(part):
        part = move(part, split_axis=0, concat_axis=1)
        params = experts
        if chunks > 1:
            part, params = _weights_for(part, experts)
        return move(ffn_of(params)(part), split_axis=1, concat_axis=0)

    return one(buf) if chunks == 1 else jnp.concatenate(
        [one(part) for part in jnp.split(buf, chunks, axis=1)], axis=1)


def _weights_for(part, experts: ExpertParams):
    """`(part, experts)` through one optimization barrier: the weights as a value of this
    chunk's own, which no XLA pass merges with another chunk's (the barrier is the identity,
    and so is its gradient)."""
    return jax.lax.optimization_barrier((part, experts))


def swap_expert_blocks(buf, outer: int, inner: int):
    """`buf [E, ...]` with its experts as `[outer, inner, E / (outer * inner)]` blocks,
    reordered to `[inner, outer, ...]`: host-major shards to local-index-major and back."""
    blocks = buf.reshape(outer, inner, -1, *buf.shape[1:])
    return blocks.swapaxes(0, 1).reshape(buf.shape)
