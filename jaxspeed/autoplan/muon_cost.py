"""What Muon's Newton–Schulz costs a step: the model's matrices, each one's FLOPs, and the bytes
its stack moves to the devices that own whole matrices and back.

The engine (`jaxspeed.optim.muon`) runs the iterations on the devices that split the matrices'
state (ZeRO 1-3, tensor parallelism), each on whole matrices pooled by shape (`owner`), or
where the state lives (`sharded`; every device iterates on all of them when nothing splits the
state), or (`auto`) whichever `jaxspeed.optim.muon_price` prices cheaper. This prices that
choice for the planner: the FLOPs join the step's compute (`estimate`), the all-to-alls its
traffic (`traffic.step_transfers`). `plan` reads both from the compiled step instead.
"""

from __future__ import annotations

import math
from typing import Any

from jaxspeed.optim.muon import owner_dim
from jaxspeed.optim.muon_price import cluster_rates, newton_schulz_flops, owner_is_cheaper
from jaxspeed.runtime.mesh import HOST


def muon_matrices(model: Any, *, layers: int, split_heads: bool = False
                  ) -> list[tuple[tuple[int, ...], int, int, bool]]:
    """`(stack, fan_in, fan_out, experts)` of each leaf Muon orthogonalizes in `layers` of
    `model`'s layers, as the engine's params hold them: its stack's batch dimensions, each
    matrix's shape, and whether the second batch dimension is the experts (which `expert`
    splits). The embedding and head are AdamW's. The matrices are whole: tensor parallelism
    splits the state, not Muon's matrices.

    Per layer: the q, k, v and out projections (each head its own with `split_heads`) and the
    FFN's; a MoE layer's experts, each its own, and its router.
    """
    d, heads = model.d_model, model.n_heads
    head, kv = d // heads, model.n_kv_heads or heads

    def attention(stack):
        if split_heads:
            return [((stack, heads), d, head, False)] * 2 + [((stack, kv), d, head, False)] * 2
        return [((stack,), d, heads * head, False)] * 2 + [((stack,), d, kv * head, False)] * 2

    def ffn(stack, d_ff, activation, experts=False):
        gated = [(stack, d, d_ff, experts)] if activation == "swiglu" else []
        return [(stack, d, d_ff, experts), *gated, (stack, d_ff, d, experts)]

    moe = getattr(model, "moe", None)
    if moe is None:
        return attention(layers) + ffn((layers,), model.d_ff, model.mlp)
    # the scan runs over groups of `every_n_layers` blocks, the last of them a MoE block:
    # each block of a group is its own leaves, each a stack of `groups`
    every = moe.every_n_layers
    groups = layers // every
    return (every * attention(groups) + (every - 1) * ffn((groups,), model.d_ff, model.mlp)
            + ffn((groups, moe.num_experts), moe.d_ff or model.d_ff,
                  moe.activation or model.mlp, experts=True)
            + [((groups,), d, moe.num_experts, False)])


def muon_owners(stage: int, sizes: dict[str, int], zero_axes: tuple[str, ...]
                ) -> tuple[str, ...]:
    """The mesh axes that split the optimizer state's matrices: ZeRO's from stage 1, and
    `tensor` (the engine's `auto` placement moves them onto the stack)."""
    axes = (tuple(zero_axes) if stage >= 1 else ()) + (("tensor",) if sizes["tensor"] > 1 else ())
    return tuple(a for a in axes if sizes[a] > 1)


def muon_cost(config: Any, *, layers: int, axes: tuple[str, ...], sizes: dict[str, int]
              ) -> tuple[float, float]:
    """`(FLOPs, bytes)` of one device's Newton–Schulz per step, at the config's placement:
    `layers` of the model's layers, whose state the mesh `axes` (`muon_owners`; `sizes` theirs)
    split, and the experts' also `expert`.

    Unless `sharded`, the matrices of stacks nothing splits (all but the experts under
    `expert`, and with `tensor` beside ZeRO, which split both sides of a matrix) are pooled by
    shape, as the engine pools those of one shape and layout (ZeRO splits the same side of
    each, up to a transpose), and each pool goes whole to the owners: `ceil` of its share of
    the pool each, and the buffer of fp32 momentum exchanged each way (an all-to-all's). An
    expert stack goes to its owners where `owner_dim` finds a dimension, alike. `auto` decides
    each as the engine does (`owner_is_cheaper` at the rates of `optimizer.params.cluster`).
    Elsewhere the iteration runs where the state is: a share of the FLOPs as the state is split
    (XLA partitions the matmuls; their collectives are not priced here, `plan` counts them).
    """
    p = config.optimizer.params
    rates = cluster_rates(p.cluster)
    across_hosts = HOST in axes

    def owner(fans, count, padded, k):
        return p.placement == "owner" or owner_is_cheaper(
            fans, count=count, padded=padded, owners=k, steps=p.ns_steps, rates=rates,
            across_hosts=across_hosts)

    flops = nbytes = 0.0
    pools: dict[tuple[int, int, int], int] = {}
    for stack, fan_in, fan_out, experts in muon_matrices(config.model, layers=layers,
                                                         split_heads=p.split_heads):
        splits = (1, sizes["expert"]) if experts else (1,) * len(stack)
        k = math.prod(sizes[a] for a in axes if not (experts and a == "expert"))
        one = newton_schulz_flops(fan_in, fan_out, p.ns_steps)
        moves = k > 1 and p.placement != "sharded"
        # tensor parallelism beside ZeRO splits both sides of a matrix: no pool (see `muon`)
        if moves and math.prod(splits) == 1 and not (sizes["tensor"] > 1 and len(axes) > 1):
            key = (min(fan_in, fan_out), max(fan_in, fan_out), k)
            pools[key] = pools.get(key, 0) + math.prod(stack)
            continue
        found = owner_dim(stack, splits, k) if moves else None
        count = math.prod(stack) // math.prod(splits)
        if found is None or not owner((fan_in, fan_out), count,
                                      count * found[1] // stack[found[0]], k):
            flops += count * one / k
            continue
        share = count * found[1] // stack[found[0]] // k
        flops += share * one
        nbytes += 4 * share * fan_in * fan_out
    for (rows, cols, k), count in pools.items():
        one = newton_schulz_flops(rows, cols, p.ns_steps)
        share = -(-count // k)
        if not owner((rows, cols), count, share * k, k):
            flops += count * one / k
            continue
        flops += share * one
        nbytes += 4 * share * rows * cols
    return flops, nbytes
