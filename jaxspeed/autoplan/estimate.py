"""The fast analytic cost of a plan: memory per device, FLOPs, collectives, bubble, step time.

It prunes the search before anything is compiled, so it counts what decides a plan's rank and
no more (every figure per device, per optimizer step):
- **State.** Params, gradients and Adam moments in fp32 (4 + 4 + 8 bytes per parameter), split
  over `pipe` (layers) and `tensor` (everything but norms), and over the ZeRO axes (`data`,
  `sequence`, `expert`) by stage: 1 splits the moments, 2 the gradients too, 3 the params too.
  A MoE's routed experts are split over `expert` at every stage (their owners), and ZeRO
  splits them further over the other axes.
  Optimizer offload moves the moments to host memory; parameter offload the fp32 params too,
  leaving a compute-dtype copy on the device.
- **Activations.** Per layer and token of a micro-batch, in the compute dtype: what the remat
  policy keeps (`_SAVED`) plus one layer's working set while it is recomputed, times the
  microbatches a pipeline stage holds at once (all of them for GPipe, `pipe` for 1F1B); plus
  the fp32 logits of one micro-batch. `dots_saveable` also keeps the fp32 attention scores;
  `offload_dots` keeps the projections' outputs in host memory instead.
- **Compute.** 6 FLOPs per parameter a token meets for the matmuls (in a MoE layer, its
  router and `k` experts; 8 with full remat, which runs the forward twice) plus attention's
  12·L·d per token and layer, divided over the devices
  that split the work, at the cluster's peak x its efficiency; plus each micro-step's two
  reads of the local weights, and the optimizer's update of the local shard
  (`jaxspeed.autoplan.update_cost`: XLA's bytes per parameter of that optimizer in the priced
  phase), at the memory bandwidth.
- **Communication.** The data-parallel collectives of `jaxspeed.autoplan.traffic` (ZeRO
  stages, ZeRO++'s switches, the 1-bit optimizers' compressed exchange); per micro-step,
  tensor parallelism's 4 all-reduces of the activations per layer (6 with full remat), what
  a MoE layer's strategy moves over the expert axis (`jaxspeed.autoplan.moe_exchange`),
  Ulysses' 8 all-to-alls per layer and the pipeline's activation hand-offs. Each collective
  is costed on the links its groups cross, by the cluster's collective algorithms
  (`jaxspeed.network.collectives`: `nccl` hierarchical, `gloo` flat), with `host` split off `data`
  as the two-level mesh does (`traffic.mesh_sizes`).
- **Host copies.** Per step, over the cluster's `host_link`: with offload, the gradient shard
  to the host and the updated param shard back (with parameter offload, the compute-dtype
  copy instead); with `offload_dots`, the offloaded activations out and back per micro-step.
  The host's Adam update is not timed.
- **Overlap (the one stated assumption): none.** Step time = compute / (1 - bubble) +
  communication + host copies. On the emulated CPU devices collectives are copies on the same
  cores, so nothing overlaps; on GPUs XLA overlaps part of it, which makes the model
  pessimistic for communication-heavy plans by at most the overlapped share.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspeed.autoplan import moe_exchange, traffic
from jaxspeed.autoplan.muon_cost import muon_cost, muon_owners
from jaxspeed.autoplan.traffic import param_counts
from jaxspeed.autoplan.space import ON_HOST, Candidate
from jaxspeed.autoplan.update_cost import update_seconds
from jaxspeed.config import Config
from jaxspeed.config.optimizer import clips_logits
from jaxspeed.cost.flops import layer_matmul_params
from jaxspeed.network.collectives import collective_time, host_egress_bytes, hosts_spanned
from jaxspeed.network.placement import ordered_groups
from jaxspeed.ops.precision import compute_dtype

#: Activation bytes a layer keeps per token, in units of d_model x compute-dtype bytes, by
#: remat policy (the rest is recomputed in the backward pass). `none` keeps every
#: intermediate: the attention block's inputs, q/k/v, output and the MLP's (counted
#: separately, per d_ff); `dots...` keeps only the matmul outputs; `full` only the layer input.
_SAVED = {"none": 10.0, "dots_saveable": 6.0, "dots_with_no_batch_dims_saveable": 6.0,
          "offload_dots": 1.0, "full": 1.0}
#: ... and per token, in units of d_ff x compute-dtype bytes (the MLP's hidden activations).
_SAVED_FF = {"none": 3.0, "dots_saveable": 2.0, "dots_with_no_batch_dims_saveable": 2.0,
             "offload_dots": 0.0, "full": 0.0}
#: What `offload_dots` keeps in host memory instead: the projections' outputs, as
#: `dots_with_no_batch_dims_saveable` keeps them on the device.
_OFFLOADED = {"offload_dots": "dots_with_no_batch_dims_saveable"}
#: One layer's working set while it runs (forward or recomputed), per token, in d_model and
#: d_ff units, on top of what is saved.
_WORKING, _WORKING_FF = 10.0, 3.0
#: Matmul FLOPs per parameter per token: forward 2, backward 4, and one more forward (2) when
#: every layer is recomputed.
_FLOPS_PER_PARAM = {"none": 6.0, "dots_saveable": 6.0, "dots_with_no_batch_dims_saveable": 6.0,
                    "offload_dots": 6.0, "full": 8.0}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A plan's predicted cost (per device, per optimizer step)."""

    state_bytes: int  #: params + grads + optimizer state on the device
    activation_bytes: int
    host_bytes: int  #: state and activations in host memory (offload)
    flops: float  #: matmul FLOPs per device per step
    compute_s: float
    comm_s: float
    host_s: float  #: copies between the device and host memory (offload)
    bubble: float  #: the pipeline's idle fraction
    step_s: float
    comm_by_kind: dict[str, float]
    #: bytes the busiest host sends to other hosts per step (`host_egress_bytes`)
    cross_host_bytes: float = 0.0
    tokens: int = 0  #: tokens per step

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    @property
    def device_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    @property
    def bound(self) -> str:
        """What the step time is mostly made of: compute, network, host copies or bubble."""
        parts = {"compute": self.compute_s, "network": self.comm_s, "host": self.host_s,
                 "bubble": self.compute_s * self.bubble / max(1e-12, 1 - self.bubble)}
        return max(parts, key=parts.get)


def estimate(config: Config, plan: Candidate, cluster: Any, *, optimizer: str | None = None,
             phase: str = "auto") -> Estimate:
    """The analytic cost of `plan` for `config`'s model on `cluster` (`Cluster`).

    Args:
      optimizer: price this optimizer type's communication and update instead of the config's.
      phase: the phase of a 1-bit optimizer to price (`traffic.exchange_fractions`).
    """
    m, s = config.model, plan.sizes
    pipe, tensor, seq = s["pipe"], s["tensor"], s["sequence"]
    zero = s["data"] * s["sequence"] * s["expert"]
    counts = param_counts(config)
    layers_here = m.n_layers // pipe
    dense = (layers_here * (counts["layer_matmul"] / tensor + counts["layer_norm"])
             + counts["embed"] / tensor + counts["final_norm"])
    experts = layers_here * counts["layer_expert"] / tensor  # the MoE layers' routed experts
    params_here = dense + experts / s["expert"]  # each device owns E / expert of them
    # a ZeRO shard: the dense weights over data x sequence x expert, the owned experts over
    # data x sequence
    sharded = (dense + experts) / zero
    p_b, g_b, o_b = 4 * params_here, 4 * params_here, 8 * params_here
    if plan.stage >= 1:
        o_b = 8 * sharded
    if plan.stage >= 2:
        g_b = 4 * sharded
    if plan.stage >= 3:
        p_b = 4 * sharded
    dtype = compute_dtype(config)
    act = dtype.itemsize
    host, host_moved = 0.0, 0.0  # bytes in host memory; bytes copied to or from it per step
    state = p_b + g_b + o_b
    on_host = ON_HOST[plan.offload]
    if "opt_state" in on_host:  # the moments live on the host; once a step the fp32 gradient
        host += o_b             # shard goes there and the updated param shard comes back, in
        state -= o_b            # the compute dtype where the fp32 params stay on the host too
        back = act if "params" in on_host else 4
        host_moved += (4 + back) * sharded
    if "params" in on_host:  # the fp32 masters on the host; the device keeps a compute copy
        host += p_b
        state += act * sharded - p_b
    tokens_micro = plan.micro_batch * config.data.seq_len / seq  # per device per micro-step
    per_layer_saved = tokens_micro * act * (_SAVED[plan.remat] * m.d_model / tensor
                                            + _SAVED_FF[plan.remat] * m.d_ff / tensor)
    if plan.remat == "dots_saveable":  # also the attention scores (fp32), one row per token
        per_layer_saved += tokens_micro * 4 * m.n_heads / tensor * config.data.seq_len / seq
    working = tokens_micro * act * (_WORKING * m.d_model / tensor + _WORKING_FF * m.d_ff / tensor)
    in_flight = 1
    if pipe > 1:
        in_flight = plan.accumulation if plan.schedule == "gpipe" else pipe
    logits = tokens_micro * m.vocab_size / tensor * 4 * 2  # fp32 logits and their gradient
    activations = in_flight * layers_here * per_layer_saved + working + logits
    if plan.remat in _OFFLOADED:  # out to the host in the forward pass, back in the backward
        kept = _OFFLOADED[plan.remat]
        offloaded = tokens_micro * act * (_SAVED[kept] * m.d_model / tensor + _SAVED_FF[kept] * m.d_ff / tensor)
        host += in_flight * layers_here * offloaded
        host_moved += 2 * layers_here * offloaded * plan.accumulation

    tokens_step = plan.micro_batch * plan.accumulation * s["data"] * s["expert"] * config.data.seq_len
    matmul_params = layer_matmul_params(m) + m.vocab_size * m.d_model  # a token's (top-k)
    attention = 12 * m.n_layers * config.data.seq_len * m.d_model  # per token: QK^T and PV, x3
    if clips_logits(config.optimizer):  # QK-clip's statistic: one more QK^T, forward only
        attention += 2 * m.n_layers * config.data.seq_len * m.d_model
    total_flops = tokens_step * (_FLOPS_PER_PARAM[plan.remat] * matmul_params + attention)
    flops = total_flops / cluster.devices
    # every micro-step reads the local weights twice (forward, backward) from memory: what
    # accumulation costs beyond its FLOPs
    weights = 2 * plan.accumulation * 4 * params_here / (cluster.memory_bandwidth_gbps * 1e9)
    update = 0.0 if "opt_state" in on_host else update_seconds(  # the host's is not timed
        config, params=sharded if plan.stage >= 1 else params_here, cluster=cluster,
        optimizer=optimizer, phase=phase)
    if config.optimizer.type == "Muon" and optimizer in (None, "Muon"):  # Newton–Schulz
        axes = muon_owners(plan.stage, s, ("data", "sequence", "expert"))
        flops += muon_cost(config, layers=layers_here, axes=axes, sizes=s)[0]
    compute = flops / (cluster.peak_flops(dtype.name) * cluster.efficiency) + weights + update
    bubble = 0.0
    if pipe > 1:
        micro = plan.accumulation * (config.pipeline.virtual_stages if plan.schedule == "interleaved" else 1)
        bubble = (pipe - 1) / (micro + pipe - 1)

    by_kind: dict[str, float] = {}
    sizes = traffic.mesh_sizes(s, plan.hosts if plan.hosts > 1 else cluster.hosts)
    algorithm = getattr(cluster, "collectives", "nccl")
    cross_host = 0.0

    def cost(kind: str, nbytes: float, axes: tuple[str, ...], times: float, *,
             mesh: dict[str, int] = sizes, per_host: int = cluster.devices_per_host,
             how: str = algorithm) -> None:
        nonlocal cross_host
        axes = tuple(a for a in axes if mesh.get(a, 1) > 1)
        if not axes or nbytes <= 0 or times <= 0:
            return
        seconds = collective_time(
            kind, nbytes, axes, mesh, devices_per_host=per_host,
            intra=cluster.intra_host, inter=cluster.inter_host, algorithm=how,
        )
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds * times
        cross_host += times * host_egress_bytes(
            kind, nbytes, ordered_groups(axes, mesh), per_host, how)

    # Over gloo, the explicit ZeRO-3 step gathers and reduce-scatters over an axis that spans
    # processes with no `host` axis naming them in two stages, across the hosts and inside
    # them (`zero.step.two_level_axes`): the hierarchical algorithm's cost.
    staged = algorithm == "gloo" and sizes["host"] == 1
    for t in traffic.step_transfers(config, plan, hosts=sizes["host"], optimizer=optimizer,
                                    phase=phase, gloo=algorithm == "gloo"):
        two = staged and t.name.startswith("zero3.") and hosts_spanned(
            [a for a in t.axes if sizes[a] > 1], sizes, cluster.devices_per_host)[0] > 1
        cost(t.kind, t.nbytes, t.axes, t.count, how="nccl" if two else algorithm)
    micro_steps = plan.accumulation
    hidden = tokens_micro * m.d_model * act
    recompute = 1.5 if plan.remat == "full" else 1.0
    moe = moe_exchange.exchange(config, plan, sizes, cluster)
    for kind, nbytes, axes, count in moe.collectives if moe is not None else ():
        cost(kind, nbytes, axes, count * moe.times, mesh=moe.mesh, per_host=moe.devices_per_host)
    cost("all-reduce", hidden, ("tensor",), 4 * recompute * m.n_layers / pipe * micro_steps)
    cost("all-to-all", hidden / tensor, ("sequence",), 8 * recompute * m.n_layers * micro_steps)
    cost("collective-permute", hidden, ("pipe",), 2 * micro_steps)
    comm_s = sum(by_kind.values())
    host_s = host_moved / (cluster.host_link.bandwidth_gbps * 1e9)
    step = compute / (1 - bubble) + comm_s + host_s
    return Estimate(
        state_bytes=int(state), activation_bytes=int(activations), host_bytes=int(host),
        flops=flops, compute_s=compute, comm_s=comm_s, host_s=host_s, bubble=bubble, step_s=step,
        comm_by_kind=by_kind, cross_host_bytes=cross_host, tokens=tokens_step,
    )
