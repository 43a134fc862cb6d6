"""ZeRO-3 as explicit collectives, and ZeRO++'s qwZ, hpZ and qgZ on top.

Inside a `shard_map` manual over the data-parallel ZeRO axes (`host`, `data`, `expert`), a
parameter stored ZeRO-sharded on dimension `dim` is gathered with `all_gather(tiled=True)`,
and the gradient of the local loss w.r.t. the shard is the transpose: a reduce-scatter. Both
are written here, as one `custom_vjp` per gather, so the program says what moves on every
backend (XLA:CPU compiles the sharding path's gradient reduction to all-reduce + slice); the
collectives themselves are in `jaxspeed.zero.comm`:

- forward: cast to the compute dtype, then `all_gather` (qwZ: int8 block-quantized values and
  fp32 block scales, dequantized after; `jaxspeed.ops.quantize`);
- backward: the cotangent in fp32, `psum_scatter` (qgZ: an `all_to_all` of block-quantized
  int4/int8 chunks per mesh axis, major axis first, i.e. inside the host first and then across
  hosts, each receiver dequantizing and summing in fp32). qwZ's quantization is
  straight-through: its backward is the plain (or qgZ) reduce-scatter.

In full precision the leaves gathered together (one layer's, or every leaf once a step) move
as one flat buffer, one all-gather and one reduce-scatter (`gather_group`) instead of one
each: every collective pays a latency, on the order of a millisecond across hosts over gloo.
Over one mesh axis whose devices span hosts with no `host` axis naming them (an expert axis
across processes), both run in two stages, so each byte crosses the link once
(`jaxspeed.sharding.two_level`).

hpZ splits a gather into stages: over `host` alone first (once per step: a secondary copy
sharded within the host), then over the intra-host axes (per layer, in the forward pass and
again in the recomputed backward pass); where `host` is not ZeRO's minor axis (host-major
shards, or an `expert` axis after it), the blocks are put back in the spec's order after the
last stage (`zero.layout.reorder_blocks`, marked as gathered so that `not_gathered` does not
keep it for the backward pass). The chain's transpose is the hierarchical
reduce-scatter: inside the host, then across hosts.

`jaxspeed.autoplan.traffic.step_transfers` prices all this per step (`plan`, the planner;
`tests/test_zero3_traffic.py` checks it against the compiled step).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxspeed.sharding import two_level
from jaxspeed.zero import comm
from jaxspeed.zero.layout import (
    LeafGather, Switches, named, part_stages, reorder_blocks,
)


class _Gather(NamedTuple):  # static (hashable) arguments of `gather_stage`
    axes: tuple[str, ...]
    dim: int
    dtype: Any
    in_dtype: Any
    switches: Switches


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_stage(x, op: _Gather):
    return comm.all_gather(x, op.axes, op.dim, dtype=op.dtype,
                           quantized=op.switches.quantized_weights, block=op.switches.block)


def _gather_fwd(x, op: _Gather):
    return _gather_stage(x, op), None


def _gather_bwd(op: _Gather, _, cotangent):
    s = op.switches
    summed = comm.reduce_scatter(cotangent, op.axes, op.dim, bits=s.gradient_bits,
                                 block=s.block, bucket=s.bucket)
    return (summed.astype(op.in_dtype),)


_gather_stage.defvjp(_gather_fwd, _gather_bwd)


def gather_stage(x: jax.Array, axes: tuple[str, ...], dim: int, *, dtype,
                 switches: Switches = Switches()) -> jax.Array:
    """One ZeRO gather of `x` over `axes` (inside `shard_map` manual over them), in `dtype`.

    Its transpose is `reduce_scatter` in fp32 (qgZ: quantized), cast to `x`'s dtype.
    """
    return _gather_stage(x, _Gather(tuple(axes), dim, jnp.dtype(dtype), x.dtype, switches))


#: `_reordered`'s mark on its output, by which `not_gathered` knows it.
_REORDERED = "zero_reordered_blocks"


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _reordered(x, dim: int, have: tuple[str, ...], want: tuple[str, ...]):
    """`reorder_blocks` of gathered blocks, marked as gathered for `not_gathered`; its
    transpose reorders the cotangent back."""
    return checkpoint_name(reorder_blocks(x, dim, have, want), _REORDERED)


def _reordered_fwd(x, dim, have, want):
    return _reordered(x, dim, have, want), None


def _reordered_bwd(dim, have, want, _, cotangent):
    return (reorder_blocks(cotangent, dim, want, have),)


_reordered.defvjp(_reordered_fwd, _reordered_bwd)


class _Group(NamedTuple):  # static (hashable) arguments of `gather_group`
    axes: tuple[str, ...]
    dims: tuple[int, ...]
    in_dtypes: tuple[Any, ...]
    dtype: Any
    switches: Switches


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_group(xs, op: _Group):
    flat = jnp.concatenate([x.astype(op.dtype).reshape(-1) for x in xs])
    hosts = op.switches.hosts(op.axes)
    if hosts > 1:
        rows = comm.as_words(lambda w: two_level.all_gather(w, op.axes[0], hosts=hosts), flat)
    else:
        rows = comm.all_gather(flat[None], op.axes, 0, dtype=op.dtype)  # [peers, total]
    cuts = list(itertools.accumulate(x.size for x in xs))[:-1]
    return tuple(comm.concat_peers(part.reshape(-1, *x.shape), dim)
                 for part, x, dim in zip(jnp.split(rows, cuts, axis=1), xs, op.dims))


def _gather_group_fwd(xs, op: _Group):
    return _gather_group(xs, op), None


def _gather_group_bwd(op: _Group, _, cotangents):
    peers = jax.lax.axis_size(op.axes)
    hosts, bucket = op.switches.hosts(op.axes), op.switches.bucket
    rows = jnp.concatenate([comm.rows_of(c.astype(jnp.float32), peers, dim)
                            for c, dim in zip(cotangents, op.dims)], axis=1)
    mine = comm.scatter_rows(rows, op.axes, bucket, hosts)
    shards = [comm.shard_shape(c.shape, peers, dim) for c, dim in zip(cotangents, op.dims)]
    cuts = list(itertools.accumulate(math.prod(s) for s in shards))[:-1]
    return (tuple(part.reshape(s).astype(t)
                  for part, s, t in zip(jnp.split(mine, cuts), shards, op.in_dtypes)),)


_gather_group.defvjp(_gather_group_fwd, _gather_group_bwd)


def _buckets(sizes: list[int], bucket: int | None) -> list[list[int]]:
    """The leaves' indices in runs of consecutive leaves of at most `bucket` elements in all
    (a larger leaf alone; None: one run)."""
    runs: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if bucket is not None and runs[-1] and total + size > bucket:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += size
    return runs


def gather_group(xs, axes: tuple[str, ...], dims, *, dtype, switches: Switches = Switches()):
    """ZeRO gathers of several leaves over the same `axes` as one collective: each shard
    `xs[i]` (split on `dims[i]`) in `dtype`, flattened into one buffer, gathered, and cut
    back into the whole leaves (a copy of each: the gathered buffer is peer-major). Its
    transpose reduce-scatters their fp32 cotangents as one buffer, in pieces of at most
    `switches.bucket` elements (`gather_leaves` keeps a group within that size, or to one
    larger leaf). Over one axis that spans hosts
    (`switches.two_level`), both run in two stages. Full precision only (`Switches.grouped`).

    The same values as `gather_stage` leaf by leaf, in one collective a direction instead of
    one a leaf: each pays a latency (on the order of a millisecond across hosts over gloo).
    """
    op = _Group(tuple(axes), tuple(dims), tuple(x.dtype for x in xs), jnp.dtype(dtype),
                switches)
    return list(_gather_group(tuple(xs), op))


def gather_leaf(x: jax.Array, leaf: LeafGather | None, *, dtype, switches: Switches,
                part: str = "all") -> jax.Array:
    """`x` through `leaf`'s gather stages (`part` of `PARTS`), the last one's output in `dtype`.

    A leaf with no stage to run is returned as it is (cast only by `part="all"` or `"use"`,
    which hand the model its compute params).
    """
    return gather_leaves([x], [leaf], [part], dtype=dtype, switches=switches)[0]


def gather_leaves(xs, leaves, parts, *, dtype, switches: Switches) -> list:
    """`gather_leaf` on each `xs[i]` with `leaves[i]` and `parts[i]`; the leaves gathered over
    the same axes at the same stage move together, one collective a direction
    (`gather_group`) where `switches.grouped`, in runs of whole leaves of at most
    `switches.bucket` gathered elements (`_buckets`), else leaf by leaf (`gather_stage`).
    Leaves that are not floating pass through unchanged. Leaves split over another axis of
    the step's map too (`LeafGather.kept`: `tensor`) are gathered inside a `shard_map` manual
    over it: around a collective over the manual axes, XLA would first gather them whole
    over the automatic ones.

    The runs bound what the step holds twice: each run's gathered buffer until it is cut
    into its leaves, and in the backward pass its fp32 gradients. In one buffer, the 100M
    model gathered once per step peaked at 942 MiB against the sharding path's 676; in runs
    of 2**22 elements at 682 (`zero_memory.py`)."""
    stages = [part_stages(leaf.stages(switches.hpz), part, switches.hpz)
              if leaf is not None and jnp.issubdtype(x.dtype, jnp.floating) else ()
              for x, leaf, part in zip(xs, leaves, parts)]
    out = list(xs)
    moving = [i for i, s in enumerate(stages) if s]
    for split in (False, True):  # never in one buffer: it would vary over the groups' axes
        members = [i for i in moving if bool(leaves[i].kept_axes) is split]
        if not members:
            continue
        op = _Stages(tuple(leaves[i].dim for i in members), tuple(stages[i] for i in members),
                     jnp.dtype(dtype), switches)
        ys = tuple(xs[i] for i in members)
        if split:
            done = _in_groups(ys, op, tuple(P(*leaves[i].kept) for i in members))
        else:
            done = _run_stages(ys, op)
        for i, x in zip(members, done):
            out[i] = x
    for i in moving:  # hpZ's host stage first: the blocks back into the spec's order
        leaf = leaves[i]
        if parts[i] != "secondary" and leaf.order(switches.hpz) != leaf.axes:
            out[i] = _reordered(out[i], leaf.dim, leaf.order(switches.hpz), leaf.axes)
    return [x.astype(dtype) if part != "secondary" and jnp.issubdtype(x.dtype, jnp.floating)
            else x for x, part in zip(out, parts)]


class _Stages(NamedTuple):  # static (hashable) arguments of `_run_stages`
    dims: tuple[int, ...]
    stages: tuple[tuple[tuple[str, ...], ...], ...]
    dtype: Any
    switches: Switches


def _run_stages(xs, op: _Stages) -> tuple:
    """`xs[i]` through its `op.stages[i]` (split on `op.dims[i]`), stage by stage, the leaves
    at the same stage over the same axes together (`gather_leaves`)."""
    out, dims, switches = list(xs), op.dims, op.switches
    for depth in range(max(map(len, op.stages), default=0)):
        together: dict[tuple[str, ...], list[int]] = {}
        for i, leaf_stages in enumerate(op.stages):
            if depth < len(leaf_stages):
                together.setdefault(leaf_stages[depth], []).append(i)
        for axes, members in together.items():
            if switches.grouped:
                peers = jax.lax.axis_size(axes)
                done = []
                for run in _buckets([out[i].size * peers for i in members], switches.bucket):
                    done += gather_group([out[members[k]] for k in run], axes,
                                         [dims[members[k]] for k in run], dtype=op.dtype,
                                         switches=switches)
            else:
                done = [gather_stage(out[i], axes, dims[i], dtype=op.dtype, switches=switches)
                        for i in members]
            for i, x in zip(members, done):
                out[i] = x
    return tuple(out)


def _in_groups(xs, op: _Stages, specs):
    """`_run_stages` inside each group of the leaves' other axes (`LeafGather.kept`), in a
    `jax.checkpoint` that saves nothing: under the model's remat, the nested `shard_map`
    would otherwise be split into a saved and a recomputed part, and jax 0.12 names the outer
    map's manual axes in the saved values' specs (qwZ's constants), which Shardy refuses.
    `not_gathered` looks inside it."""
    model = {a for spec in specs for e in spec for a in named(e)}
    run = jax.shard_map(lambda ys: _run_stages(ys, op), in_specs=(specs,), out_specs=specs,
                        axis_names=model)
    return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)(xs)


def not_gathered(prim, *_, **params) -> bool:
    """A remat policy: every value is saved for the backward pass but what a ZeRO gather
    produced, so the backward pass gathers it again (DeepSpeed's ZeRO-3 releases a layer's
    params after its forward pass), nor a move into device memory (ZeRO-Offload streams the
    layer's shard in again: saved, it kept every gathered layer to the backward pass, 1.5x
    the step's temporaries on the tiny GPT). A gather is a `custom_vjp` whose primal holds an
    `all_gather`, or the `ppermute`s of a two-stage one, anywhere inside (its `call_jaxpr`,
    as jax 0.11 and 0.12 name it; `_in_groups` nests them in a `checkpoint` of a
    `shard_map`), or the reorder of gathered blocks that follows hpZ's stages (`_reordered`:
    saved, it would keep every gathered layer too)."""
    if prim.name == "device_put":  # `offload_param`'s shard: streamed in again, not kept
        return False
    if prim.name not in ("custom_vjp_call", "checkpoint"):
        return True
    return not _moves(params.get("call_jaxpr", params.get("jaxpr")))


def _moves(jaxpr) -> bool:
    """Whether `jaxpr` (or a jaxpr nested in one of its equations) gathers, permutes or
    reorders gathered blocks."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in getattr(jaxpr, "eqns", ()):
        if eqn.primitive.name in ("all_gather", "ppermute") or (
                eqn.primitive.name == "name" and eqn.params.get("name") == _REORDERED):
            return True
        if any(_moves(v) for v in eqn.params.values()):
            return True
    return False


def gather_tree(tree, leaves: Mapping[str, LeafGather | None], *, dtype, switches: Switches,
                part: str = "all"):
    """`gather_leaf` on every floating leaf of `tree`, found in `leaves` by its '/'-joined
    path; other leaves pass through unchanged."""
    from jaxspeed.sharding.planner import path_str

    flat, treedef = jax.tree.flatten_with_path(tree)
    xs = [x for _, x in flat]
    found = [leaves[path_str(path)] if jnp.issubdtype(x.dtype, jnp.floating) else None
             for path, x in flat]
    return treedef.unflatten(
        gather_leaves(xs, found, [part] * len(xs), dtype=dtype, switches=switches))
