"""What the explicit ZeRO-3 step's collectives (`jaxspeed.sharding.zero_collectives`) move per
device and per step, intra-host and cross-host: pure arithmetic over the leaves' shapes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from jaxspeed.ops import quantize as qz
from jaxspeed.runtime.mesh import HOST
from jaxspeed.sharding.zero_layout import (
    LeafGather, Switches, across_hosts_last, leaf_gather, part_stages,
)
from jaxspeed.sharding.zero_comm import worth_quantizing


class Traffic(NamedTuple):
    """Bytes one device sends per step, by where they go.

    Attributes:
      intra_host: over links inside its host.
      cross_host: over the network between hosts.
      by_collective: `{name: (intra_host, cross_host)}` for `forward_gather`,
        `backward_gather` (the recomputation's gathers; 0 without per-layer gathering or
        without remat), `secondary_gather` (hpZ's once-per-step gather over `host`) and
        `reduce_scatter`.
    """

    intra_host: int
    cross_host: int
    by_collective: dict[str, tuple[int, int]]


def _gather_bytes(size: int, peers: int, dtype_bytes: int, quantized: bool, block: int) -> int:
    """Bytes one device sends in a ring all-gather of a `size`-element shard to `peers`."""
    if quantized and worth_quantizing(size, 8, block, dtype_bytes):
        return (peers - 1) * qz.quantized_bytes(size, bits=8, block=block)
    return (peers - 1) * size * dtype_bytes


def _scatter_bytes(size: int, peers: int, bits: int | None, block: int) -> int:
    """Bytes one device sends reduce-scattering `size` elements over `peers` (fp32 ring, or
    one all-to-all of quantized chunks)."""
    chunk = size // peers
    if bits and worth_quantizing(chunk, bits, block, 4):
        return (peers - 1) * qz.quantized_bytes(chunk, bits=bits, block=block)
    return (peers - 1) * 4 * chunk


def zero_traffic(shapes: Mapping[str, tuple[int, ...]], gathers: Mapping[str, LeafGather | None],
                 mesh_shape: Mapping[str, int], *, switches: Switches = Switches(),
                 compute_bytes: int = 2, layered: Mapping[str, bool] | None = None,
                 recompute: bool = False, accumulation: int = 1) -> Traffic:
    """Bytes each ZeRO-3 collective moves per device and per step, intra- and cross-host.

    Pure arithmetic over the leaves' full shapes and their `LeafGather`s (a leaf split over
    `tensor` too moves its tensor part, inside each tensor group), as
    `jaxspeed.train.zero_step` runs them. A ring collective over `peers` devices sends
    `(peers - 1)` shards (all-gather) or chunks (reduce-scatter, fp32); qgZ's all-to-all sends
    `(peers - 1)` quantized chunks per axis; shards too small to gain from quantizing move as
    they are (`worth_quantizing`). A collective counts as cross-host when its group spans
    hosts (it has the `host` axis). Per step: a leaf that is not `layered` is gathered once;
    a `layered` one (a scanned stack the model gathers layer by layer) once per microbatch,
    and again by the backward pass: each layer's matrices always, its vectors (norm scales,
    biases, saved in their broadcast form without remat) only when `recompute` or when they
    move in one buffer with the matrices (`Switches.grouped`, and the matrices not split over
    `tensor`, which moves them apart); hpZ's `host` stage of it
    once; every gradient is reduce-scattered once per microbatch.

    Args:
      shapes: leaf path → full (global) shape.
      gathers: leaf path → its `LeafGather` (None: not ZeRO-sharded, nothing moves).
      mesh_shape: mesh axis → size.
      switches: ZeRO++'s switches.
      compute_bytes: bytes per element of the compute dtype the weights are gathered in.
      layered: leaf path → True where gathered per layer (default: none).
      recompute: whether activation checkpointing recomputes the layers (any policy but
        "none"), so the backward pass gathers their vectors again too.
      accumulation: microbatches per step.

    Returns:
      `Traffic`.
    """
    totals = {name: [0, 0] for name in (
        "forward_gather", "backward_gather", "secondary_gather", "reduce_scatter")}
    layered = layered or {}

    def add(name: str, axes, nbytes: int) -> None:
        totals[name][1 if HOST in axes else 0] += nbytes

    # the leaves split over `tensor` move apart from the rest (`gather_leaves`): a layer's
    # vectors then never share a buffer with its matrices
    split = {bool(leaf.kept_axes) for path, leaf in gathers.items()
             if leaf is not None and layered.get(path) and len(shapes[path]) > 2}
    for path, leaf in gathers.items():
        if leaf is None:
            continue
        # a device's part of the leaf: split over `tensor` too, it gathers inside its group
        size = math.prod(shapes[path]) // math.prod(mesh_shape[a] for a in leaf.kept_axes)
        shard = size // math.prod(mesh_shape[a] for a in leaf.axes)
        per_layer = bool(layered.get(path))
        stages = leaf.stages(switches.hpz)
        secondary = part_stages(stages, "secondary", switches.hpz) if per_layer else ()
        for axes in stages:
            peers = math.prod(mesh_shape[a] for a in axes)
            nbytes = _gather_bytes(shard, peers, compute_bytes, switches.quantized_weights,
                                   switches.block)
            if axes in secondary:
                add("secondary_gather", axes, nbytes)
            elif per_layer:
                add("forward_gather", axes, nbytes * accumulation)
                # a matrix of each layer; a vector too when it moves with them
                if recompute or len(shapes[path]) > 2 or (
                        switches.grouped and split <= {bool(leaf.kept_axes)}):
                    add("backward_gather", axes, nbytes * accumulation)
            else:
                add("forward_gather", axes, nbytes)
            shard *= peers
        remaining = size  # the reduce-scatters, innermost gather's first
        for axes in reversed(stages):
            groups = ([(a,) for a in across_hosts_last(axes)]
                      if switches.gradient_bits else [axes])
            for group in groups:
                peers = math.prod(mesh_shape[a] for a in group)
                add("reduce_scatter", group,
                    _scatter_bytes(remaining, peers, switches.gradient_bits, switches.block)
                    * accumulation)
                remaining //= peers
    by = {name: (intra, cross) for name, (intra, cross) in totals.items()}
    return Traffic(
        intra_host=sum(v[0] for v in by.values()),
        cross_host=sum(v[1] for v in by.values()),
        by_collective=by,
    )


def plan_traffic(plan, *, switches: Switches = Switches(), compute_bytes: int = 2,
                 per_layer: bool = True, recompute: bool = False,
                 accumulation: int = 1) -> Traffic:
    """`zero_traffic` of a stage-3 `jaxspeed.sharding.Plan`.

    Args:
      plan: the plan (its leaves' param specs give the `LeafGather`s).
      switches: ZeRO++'s switches (`jaxspeed.train.zero_step.switches_of(config section)`).
      compute_bytes: bytes per element of the compute dtype (2 for bf16/fp16, 4 for fp32).
      per_layer: whether the scanned stack (`layers/...` leaves) is gathered layer by layer
        (the reference GPT over `max_live_parameters`); else every leaf once per step.
      recompute: activation checkpointing on (`activation_checkpointing.policy` not "none").
      accumulation: microbatches per step.
    """
    from jaxspeed.sharding.leaves import flatten_leaf_plans

    leaves = {leaf.path: leaf for _, leaf in flatten_leaf_plans(plan.leaves)}
    return zero_traffic(
        {path: leaf.shape for path, leaf in leaves.items()},
        {path: leaf_gather(leaf.param, leaf.gathered) for path, leaf in leaves.items()},
        dict(plan.mesh.shape), switches=switches, compute_bytes=compute_bytes,
        layered={path: per_layer and (leaf.logical or ())[:1] == ("layers",)
                 for path, leaf in leaves.items()},
        recompute=recompute, accumulation=accumulation,
    )
