"""The MoE layers' work across the `expert` axis as the planner prices it: the layer's own
strategy model (`jaxspeed.moe.strategies`, what `parallelism: auto` chooses by), on the hosts
the plan's expert axis spans.

Per MoE layer and micro-step, with one token group a device (the layer's default): the
capacity buffer `[E, C, M]` in the compute dtype, C = `compute_capacity` of the device's tokens
(all of them when dropless); the device's experts `E / ep`; and, for the hierarchical exchange,
the tokens with their routing (an fp32 weight and an int32 slot a choice), which cross hosts
instead of the slots where they are fewer bytes, unless collectives overlap compute (not over
gloo) and the slots go out in chunks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxspeed.cost.flops import expert_matmul_params
from jaxspeed.moe.gating import compute_capacity
from jaxspeed.moe.strategies import (
    cheapest, exchange_mesh, layer_sizes, links_of, per_host, strategy_collectives)
from jaxspeed.network.collectives import hosts_spanned
from jaxspeed.ops.precision import compute_dtype
from jaxspeed.runtime.mesh import EXPERT, SEQUENCE, TENSOR


class Exchange(NamedTuple):
    """What one step of the MoE layers moves over the expert axis."""

    strategy: str  #: the one that runs (`auto`: the cheapest on the cluster)
    collectives: list  #: `(kind, bytes, axes, count)` per layer and micro-step, on `mesh`
    mesh: dict[str, int]  #: `exchange_mesh`: the expert axis's hosts x devices, and `tensor`
    times: int  #: MoE layers of a pipeline stage x micro-steps

    @property
    def devices_per_host(self) -> int:
        return per_host(self.mesh)


def exchange(config: Any, plan: Any, sizes: dict[str, int], cluster: Any) -> Exchange | None:
    """The MoE exchange of `plan` (mesh axis sizes `sizes`, `host` split off) on `cluster`, or
    None without a MoE or an expert axis."""
    m = config.model
    ep = sizes[EXPERT]
    if not m.moe or ep == 1:
        return None
    moe, itemsize = m.moe, compute_dtype(config).itemsize
    hosts = moe.a2a_hosts or hosts_spanned((EXPERT,), sizes, cluster.devices_per_host)[0]
    tokens = plan.micro_batch * config.data.seq_len // sizes[SEQUENCE]
    slots = compute_capacity(tokens, moe.num_experts, k=moe.k, capacity_factor=moe.capacity_factor,
                             min_capacity=moe.min_capacity) if moe.drop_tokens else tokens
    tp = sizes[TENSOR]  # the experts' hidden units split over it (Tutel's sharding degree)
    experts = moe.num_experts // ep * expert_matmul_params(m) // tp  # a device's
    kw = layer_sizes(slots=slots, row_bytes=moe.num_experts * m.d_model * itemsize,
                     token_bytes=tokens * m.d_model * itemsize, choices=tokens * moe.k,
                     weight_bytes=experts * itemsize, ep=ep, hosts=hosts,
                     hierarchical=moe.all_to_all == "hierarchical", chunks=moe.a2a_chunks,
                     overlap=cluster.collectives != "gloo", tp=tp)  # gloo: CPU processes
    strategy = moe.parallelism
    if strategy == "auto":
        strategy = cheapest(cluster=links_of(cluster), **kw)[0]
    layers = m.n_layers // moe.every_n_layers // sizes["pipe"]
    return Exchange(strategy, strategy_collectives(strategy, **kw), exchange_mesh(ep, hosts, tp),
                    layers * plan.accumulation)
