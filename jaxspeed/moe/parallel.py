"""The MoE feed-forward over token groups, expert-parallel over the mesh's `expert` axis.

Tokens are split into `G` groups (GShard): gating (capacity, slots, aux loss) is computed per
group, so the math depends on `G` only, not on how groups are laid out on devices. A mesh with
data=8, expert=1, one with data=1, expert=8 and a single device with `num_groups=8` compute the
same outputs, gradients and losses.

With data-parallel mesh axes (`data`, `expert`) of size > 1 in the current mesh, the layer runs
inside `jax.shard_map`, manual over those axes and `tensor` (which splits the experts' hidden
dimension: `jaxspeed.moe.expert_tensor` runs them split or whole there) and Auto over the rest
(ZeRO-3 data-sharded weights are all-gathered by XLA at the boundary). Each device holds `G / dp` groups and, for expert parallelism (`ep` = size of
the expert axis), GShard's two all-to-alls move the capacity buffers:

    dispatch      [G_l, E, C, M] -> [E, G_l * C, M]
    all_to_all    [E, G_l * C, M] -> [E / ep, ep * G_l * C, M]   (each expert to its owner)
    expert FFN    on the local experts' weights [E / ep, M, H]
    all_to_all    back to [E, G_l * C, M], then combine per group.

Inside a step already manual over the expert axis (the explicit ZeRO-3 step,
`jaxspeed.zero.step`), the layer gets this worker's tokens and its own `[E / ep, ...]`
experts, and runs the same per-device body there, over the step's manual axes of size > 1.

Gradients of the weights replicated over manual axes (the router, and the experts over `data`)
are summed over devices by `shard_map`'s transpose: where a replicated weight meets per-device
tokens, JAX inserts `pcast(..., to="varying")`, whose transpose is a `psum`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxspeed.errors import ConfigError
from jaxspeed.runtime.mesh import DATA, HOST, TENSOR
from jaxspeed.moe.experts import ExpertParams, capacity_buckets, dropless_ffn, switch_on_capacity
from jaxspeed.moe.balance import centered_load, report_load
from jaxspeed.moe.exchange import exchange
from jaxspeed.moe.expert_choice import expert_choice_gating
from jaxspeed.moe.expert_tensor import hidden_specs, summed
from jaxspeed.moe.gating import Routing, gate_logits, top_k_gating
from jaxspeed.moe.options import GatingOptions
from jaxspeed.moe.strategies import STRATEGIES
from jaxspeed.sharding.two_level import spanned_hosts
from jaxspeed.sharding.vma import make_varying, vary_alike

#: `fold_in` stream of DeepSpeed's `Jitter` (gating.py uses streams 0-2 for the rest).
_JITTER_STREAM = 3


class MoEOutput(NamedTuple):
    """What `moe_ffn` returns; per-group values have a leading `[G]` (all groups).

    Attributes:
      y: `[T, M]` combined expert outputs, in the dtype of `x`.
      aux_loss: fp32 `[G]`, GShard's balance loss per group, unscaled.
      z_loss: fp32 `[G]`, the router z-loss per group, already scaled by `z_loss_coef`.
      expert_counts: int32 `[G, E]`, choices per expert before drops.
      dropped_fraction: fp32 `[G]`.
      strategy: fp32 `[G, len(STRATEGIES)]`, one-hot: the strategy (`jaxspeed.moe.strategies`)
        the step's exchange ran, per step (the capacity bucket's with `dynamic_capacity`);
        all zeros where nothing is exchanged (no expert axis, dropless).
    """

    y: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    expert_counts: jax.Array
    dropped_fraction: jax.Array
    strategy: jax.Array


def data_parallel_axes(expert_axis: str = "expert", *, manual: bool = False) -> dict[str, int]:
    """The data-parallel axes (`host`, `data`, `expert_axis`) of the current mesh, name -> size.

    Axes that are already manual (inside an outer `shard_map`) are left out, or with `manual`
    the only ones returned.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return {}
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return {a: mesh.shape[a] for a in (HOST, DATA, expert_axis)
            if a in types and (types[a] == AxisType.Manual) == manual}


def _auto_size(axis: str) -> int:
    """The size of the current mesh's `axis` where it is not manual yet (else 1)."""
    mesh = jax.sharding.get_abstract_mesh()
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return mesh.shape[axis] if types.get(axis) == AxisType.Auto else 1


def default_num_groups(expert_axis: str = "expert") -> int:
    """Product of the sizes of the current mesh's data-parallel axes (1 without a mesh)."""
    return math.prod(data_parallel_axes(expert_axis).values())


def _route(x, gate_kernel, rng, group_ids, opts: GatingOptions,
           capacity: int | None = None, bias=None) -> Routing:
    """Gates each group of `x [G_l, Tg, M]`; group `g` draws from `fold_in(rng, g)`; `bias`
    is the balancing bias added to the scores that pick the experts."""
    use_rts = opts.use_rts and opts.drop_tokens

    def one(xg, gid):
        key = None if rng is None else jax.random.fold_in(rng, gid)
        jitter_key = None if key is None else jax.random.fold_in(key, _JITTER_STREAM)
        logits = gate_logits(xg, gate_kernel, noisy_gate_policy=opts.noisy_gate_policy,
                             rng=jitter_key, eval_mode=opts.eval_mode)
        if opts.routing == "expert_choice":
            return expert_choice_gating(
                logits, opts.k, opts.capacity_factor, min_capacity=opts.min_capacity,
                eval_mode=opts.eval_mode, eval_capacity_factor=opts.eval_capacity_factor,
                z_loss_coef=opts.z_loss_coef)
        return top_k_gating(
            logits, opts.k, opts.capacity_factor, min_capacity=opts.min_capacity,
            drop_tokens=opts.drop_tokens, eval_mode=opts.eval_mode,
            eval_capacity_factor=opts.eval_capacity_factor, normalize_gate=opts.normalize_gate,
            noisy_gate_policy=opts.noisy_gate_policy, rng=key, gate_noise=opts.gate_noise,
            use_rts=use_rts, bpr=opts.bpr, z_loss_coef=opts.z_loss_coef, capacity=capacity,
            selection_bias=bias)

    return jax.vmap(one)(x, group_ids)


def _flat_routing(routing: Routing, num_experts: int) -> Routing:
    """Groups as `G_l * E` virtual experts: one dispatch/combine call for all local groups."""
    groups, tokens, k = routing.expert_index.shape
    offset = (jnp.arange(groups, dtype=jnp.int32) * num_experts)[:, None, None]
    return routing._replace(
        expert_index=(routing.expert_index + offset).reshape(groups * tokens, k),
        position=routing.position.reshape(groups * tokens, k),
        weight=routing.weight.reshape(groups * tokens, k))


def _experts_via_buffers(x, routing: Routing, experts: ExpertParams, *, opts: GatingOptions,
                         expert_axis: str | None, ep: int, tensor: str | None, tp: int):
    """Dispatch to the capacity buffer, to the experts' owners and back, combine
    (`exchange`); also the strategy that ran, one-hot (`ran`)."""
    groups, tokens, width = x.shape
    y, strategy = exchange(x.reshape(groups * tokens, width),
                           _flat_routing(routing, opts.num_experts), experts, groups=groups,
                           opts=opts, expert_axis=expert_axis, ep=ep, tensor=tensor, tp=tp)
    return y, ran(strategy)


def ran(strategy: str | None) -> jax.Array:
    """fp32 `[len(STRATEGIES)]`: one-hot at `strategy`, all zeros for None."""
    return jnp.asarray([float(s == strategy) for s in STRATEGIES], jnp.float32)


def _local_moe(x, gate_kernel, experts: ExpertParams, rng, bias=None, *, opts: GatingOptions,
               group_offset, expert_axis: str | None, ep: int,
               sync_axes: tuple[str, ...] = (), tensor: str | None = None,
               tp: int = 1) -> MoEOutput:
    """The MoE on this device's groups `x [G_l, Tg, M]`; all-to-all over `expert_axis` if ep > 1;
    the experts' hidden units split over the manual axis `tensor` (of size `tp`) if not None.

    With a balancing `bias` (`jaxspeed.moe.balance`), the bias joins the expert choice and the
    groups' load becomes its cotangent: every device routes as many choices, so 1/n of each
    device's centred share, summed over the `n` devices of `sync_axes` by `shard_map`'s
    transpose, is the centred share of all groups, as one device holding them all reports.

    With `opts.dynamic_capacity` (training), the capacity is the smallest of a few static
    buckets (`capacity_buckets`, capped by `capacity_factor`) that holds the busiest expert of
    every group on every device (`pmax` over `sync_axes`), picked at run time with
    `lax.switch`: one compiled branch per bucket, so the buffers and expert FLOPs follow the
    load instead of the cap.
    """
    groups, tokens, width = x.shape
    group_ids = group_offset + jnp.arange(groups, dtype=jnp.int32)
    routing = _route(x, gate_kernel, rng, group_ids, opts, bias=bias)
    run = functools.partial(_experts_via_buffers, experts=experts, opts=opts,
                            expert_axis=expert_axis, ep=ep, tensor=tensor, tp=tp)
    if not opts.drop_tokens and ep == 1:
        dropless = functools.partial(
            dropless_ffn, x.reshape(groups * tokens, width),
            routing.expert_index.reshape(groups * tokens, -1),
            routing.weight.reshape(groups * tokens, -1), activation=opts.activation)
        y = dropless(experts) if tensor is None else summed(dropless, experts, tensor)
        strategy = ran(None)
    elif opts.dynamic_capacity and opts.drop_tokens and not opts.eval_mode:
        buckets = capacity_buckets(tokens, opts.num_experts, k=opts.k,
                                   capacity_factor=-opts.capacity_factor,
                                   min_capacity=opts.min_capacity)
        busiest = jnp.max(routing.expert_counts)
        if sync_axes:
            busiest = jax.lax.pmax(busiest, sync_axes)

        def at_capacity(x, capacity):
            routed = _route(x, gate_kernel, rng, group_ids, opts, capacity=capacity, bias=bias)
            return *run(x, routed), routed.dropped_fraction

        # Counts, aux and z-loss do not depend on the capacity; the drops (and, with
        # `parallelism: auto`, the strategy) do.
        y, strategy, dropped = switch_on_capacity(at_capacity, busiest[None], buckets, x)
        routing = routing._replace(dropped_fraction=dropped)
    else:
        y, strategy = run(x, routing)
    if bias is not None:  # each device reports 1/n of its share: the sum is the global one
        load = centered_load(routing.expert_counts)
        if sync_axes:
            load = load / jax.lax.psum(1, sync_axes)
            bias = vary_alike(bias, load)[0]
        y = report_load(y, bias, load.astype(bias.dtype))
    return MoEOutput(y, routing.aux_loss, routing.z_loss, routing.expert_counts,
                     routing.dropped_fraction,
                     jnp.broadcast_to(strategy, (groups, len(STRATEGIES))))


def moe_ffn(x, gate_kernel, experts: ExpertParams, *, opts: GatingOptions,
            num_groups: int | None = None, rng=None, expert_axis: str = "expert",
            selection_bias=None) -> MoEOutput:
    """Routes `x` to the experts and back, per token group, expert-parallel under a mesh.

    Args:
      x: `[T, M]` tokens (in the compute dtype), `T` divisible by the number of groups.
      gate_kernel: `[M, E]` router weight (the router runs in fp32).
      experts: `ExpertParams` with `E` experts; under a mesh with an expert axis of size
        `ep > 1`, expected sharded over it on the expert dimension (`E % ep == 0`).
      opts: the routing options.
      num_groups: `G`, the token groups gated separately; None = `default_num_groups()`.
        Must be a multiple of the data-parallel size of the current mesh.
      rng: a PRNG key, needed when `opts.needs_rng`; group `g` uses `fold_in(rng, g)`.
      expert_axis: the mesh axis experts are sharded over.
      selection_bias: `[E]` balancing bias (`jaxspeed.moe.balance`), or None.

    Returns:
      A `MoEOutput`.
    """
    tokens, width = x.shape
    dp = data_parallel_axes(expert_axis)
    # Inside a step's map manual over the expert axis (the explicit ZeRO-3 step, a 1-bit
    # step), `x` is this worker's tokens and the groups are gated here; `experts` are its own
    # shard, exchanged with over the manual axes, or all of them (nothing to exchange).
    outer = {a: n for a, n in data_parallel_axes(expert_axis, manual=True).items() if n > 1}
    outer = outer if expert_axis in outer else {}
    if outer and dp:
        raise ConfigError(f"the MoE layer's mesh axes {dp} must all be manual, or none, "
                          f"with {expert_axis!r} manual")
    dp = outer or dp
    dp_size = math.prod(dp.values())
    groups = dp_size if num_groups is None else num_groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ConfigError(f"num_groups must be a positive int or None, got {num_groups!r}")
    if groups % dp_size:
        raise ConfigError(
            f"num_groups={groups} must be a multiple of the data-parallel size {dp_size} "
            f"(mesh axes {dp}); use None for the default")
    here = groups // math.prod(outer.values())  # of the groups, those in `x`
    if tokens % here:
        raise ConfigError(
            f"the {tokens} tokens (batch * length) must split evenly into the {here} groups "
            f"they hold (num_groups={groups})")
    ep = dp.get(expert_axis, 1)
    if outer and experts.w_in.shape[0] == opts.num_experts:
        ep = 1
    if opts.num_experts % ep:
        raise ConfigError(
            f"num_experts={opts.num_experts} must be divisible by the size {ep} of the mesh "
            f"axis {expert_axis!r}")
    if opts.needs_rng and rng is None:
        raise ValueError(f"routing with {', '.join(opts.random_features)} needs a PRNG key")
    by_host = opts.all_to_all == "hierarchical" or opts.parallelism != "expert"
    if by_host and opts.a2a_hosts is None:
        opts = dataclasses.replace(
            opts, a2a_hosts=spanned_hosts(jax.sharding.get_abstract_mesh(), expert_axis))
    if by_host and ep > 1 and ep % opts.a2a_hosts:
        raise ConfigError(
            f"a2a_hosts={opts.a2a_hosts} must divide the size {ep} of the mesh axis "
            f"{expert_axis!r} (the hierarchical all-to-all and the parallelism strategies split "
            f"it into hosts x devices)")
    xg = x.reshape(here, tokens // here, width)
    if dp_size == 1:
        out = _local_moe(xg, gate_kernel, experts, rng, selection_bias, opts=opts,
                         group_offset=0, expert_axis=None, ep=1)
        return out._replace(y=out.y.reshape(tokens, width))

    axes = tuple(dp)
    local_groups = groups // dp_size
    # the experts' hidden units over `tensor`, manual too (`jaxspeed.moe.expert_tensor`)
    tp = 1 if outer else _auto_size(TENSOR)
    tensor = TENSOR if tp > 1 else None

    def body(xl, kernel, local_experts, key, bias):
        # the weights' gradients are summed over the devices they are replicated on, in fp32
        kernel, local_experts = jax.tree.map(lambda w: make_varying(w, axes),
                                             (kernel, local_experts))
        offset = jax.lax.axis_index(axes) * local_groups
        return _local_moe(xl, kernel, local_experts, key, bias, opts=opts, group_offset=offset,
                          expert_axis=expert_axis if ep > 1 else None, ep=ep, sync_axes=axes,
                          tensor=tensor, tp=tp)

    if not outer:
        expert_spec = hidden_specs(experts, expert_axis if expert_axis in dp else None, tensor)
        key_spec = None if rng is None else P()
        bias_spec = None if selection_bias is None else P()
        body = jax.shard_map(
            body, in_specs=(P(axes), P(), expert_spec, key_spec, bias_spec),
            out_specs=MoEOutput(*(P(axes),) * len(MoEOutput._fields)),
            axis_names=frozenset(axes + ((tensor,) if tensor else ())))
    out = body(xg, gate_kernel, experts, rng, selection_bias)
    return out._replace(y=out.y.reshape(tokens, width))
