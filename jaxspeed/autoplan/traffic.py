"""What a training step moves between devices, from the model's shapes: one `Transfer` per kind
of collective, with the mesh axes its groups run along (in rank order) and how often per step.

This is jaxspeed's one byte model: `plan`, the planner and the tests price every stage and
every optimizer's exchange from it, with no built plan (`tests/test_zero3_traffic.py` checks
ZeRO-3's against the compiled step's HLO on each axis combination the explicit step runs).
It gives each collective's kind, which `comm` needs; swap it by passing other `Transfer`s to
`comm`. Bytes are per device in the profiler's full-buffer convention
(`jaxspeed.cost.hlo`), so they compare with the compiled step's collectives.

- **ZeRO-0**: the fp32 gradient all-reduce over the batch axes (`host`, `data`: host-major),
  once per step (AdamW, Adam, Lamb, ... and the 1-bit optimizers before their freeze).
- **ZeRO-1/2**: fp32 gradient reduce-scatter and fp32 param all-gather over the ZeRO axes
  (`data` before `host`, `jaxspeed.runtime.mesh.ZERO_AXES`), once per step.
- **ZeRO-3** (the explicit step): the params gathered in the compute dtype and their fp32
  gradient reduce-scattered per micro-step: in full precision one collective a layer (and one
  for the rest), or one a step; quantized, one a leaf. A model larger than
  `zero_optimization.max_live_parameters` is gathered layer by layer in each micro-step, and
  again in the backward pass (its matrices; its norms too when they move in one buffer with
  them or remat recomputes the layers), the rest once per step; a smaller one once per step,
  before the micro-steps. `offload_param` changes none of this (the shards come in from the
  host where they are gathered).
  - qwZ (`zero_quantized_weights`): the gathers move int8 values plus an fp32 scale a block,
    each in its own collective (two latencies).
  - hpZ (`zero_hpz_partition_size` > 1): a gather over `host` alone, then inside the host; for
    a layer-by-layer model the `host` gather runs once per step (the secondary copy) and only
    the intra-host gathers run per use.
  - qgZ (`zero_quantized_gradients`): the reduce-scatter as one all-to-all per axis, inside the
    host first, of int4 (or int8) values plus a scale a block (again two collectives).
  - A full-precision gather or reduce-scatter of more elements than
    `max_reduce_scatter_elements` (`auto`: 2**18 over gloo, `gloo=True`; else 2**22) runs in
    pieces of at most that many, each a collective.
- **1-bit Adam / 1-bit LAMB** after `freeze_step`: the compressed all-reduce of the momentum,
  one all-to-all and one all-gather over the batch axes, each of the packed sign bits (1/8 byte
  a parameter, each leaf padded to 8 N) plus fp32 scales; the frozen trust ratios of 1-bit LAMB
  are local. Before the freeze: ZeRO-0's all-reduce.
- **0/1 Adam** (DeepSpeed's `ZeroOneAdam`): before `var_freeze_step`, a full-precision
  all-reduce on the variance-update steps (every `var_interval`-th step, the interval doubling
  after each `var_update_scaler` updates) and a 1-bit one on the others; after it, a 1-bit
  all-reduce only every `local_step_interval`-th step (doubling every `local_step_scaler`
  steps, up to `local_step_clipper`). `count` is the average over the steps of the phase.

The phase priced is the one a run of `config.steps` ends in (`phase="auto"`): a 1-bit run past
its freeze is priced compressed, averaged over the steps from the freeze to the end.
A MoE's routed experts are split over `expert` (their owners) and move over the other batch
axes only. Tensor, sequence and pipeline traffic, and the MoE exchange
(`jaxspeed.autoplan.moe_exchange`), are priced in `jaxspeed.autoplan.estimate`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from jaxspeed.config.optimizer import ONEBIT_TYPES, ZeroOneAdamParams
from jaxspeed.cost.flops import expert_matmul_params
from jaxspeed.ops.precision import compute_dtype
from jaxspeed.ops.quantize import num_blocks
from jaxspeed.runtime.mesh import AXES, DATA, EXPERT, HOST, SEQUENCE, TENSOR
from jaxspeed.sharding.zero import HOST_MAJOR_AXES
from jaxspeed.zero.layout import across_hosts_last
from jaxspeed.zero.step import shard_order_is_host, switches_of

#: Adam-family optimizer → its 1-bit variants (what `plan --auto` reports beside it).
ONEBIT_VARIANTS = {"Adam": ("OneBitAdam", "ZeroOneAdam"), "AdamW": ("OneBitAdam", "ZeroOneAdam"),
                   "Lamb": ("OneBitLamb",)}
#: Leaves of one transformer layer (q, k, v, o, two MLP matrices, two norms) and outside the
#: layers (embedding, final norm): the explicit ZeRO-3 step moves each quantized leaf in its
#: own collective, which pays its latency (full-precision leaves move together).
LAYER_LEAVES, OTHER_LEAVES = 8, 2
#: Of a layer's leaves, its vectors (the two norms' scales).
LAYER_VECTORS = 2
#: DeepSpeed's ZeroOneAdam defaults, as the config declares them (for a run priced with 0/1
#: Adam that is configured with another optimizer).
ZERO_ONE_DEFAULTS = {name: ZeroOneAdamParams.model_fields[name].default for name in (
    "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")}


class Transfer(NamedTuple):
    """One collective of a step, `count` times per step."""

    name: str  #: what moves, e.g. "zero3.forward_gather", "grad_all_reduce", "onebit.all_to_all"
    kind: str  #: one of `jaxspeed.cost.hlo.COLLECTIVES`
    nbytes: float  #: per device, full-buffer convention
    axes: tuple[str, ...]  #: mesh axes of its groups, rank order (first = major)
    count: float  #: executions per step (an average where steps differ)


def mesh_sizes(sizes: dict[str, int], hosts: int) -> dict[str, int]:
    """Config-style sizes (`data` the total degree) → mesh axis sizes with `host` split off:
    `hosts` when it divides `data`, else 1."""
    out = {axis: int(sizes.get(axis, 1)) for axis in AXES if axis != HOST}
    host = hosts if hosts > 1 and out[DATA] % hosts == 0 else 1
    return {HOST: host, **out, DATA: out[DATA] // host}


def onebit_bytes(params: float, workers: int, leaves: int) -> float:
    """Bytes of one phase of the compressed all-reduce: packed signs, each leaf padded to
    `8 workers` elements, plus fp32 scales (`jaxspeed.optim.compressed`)."""
    unit = 8 * workers
    padded = math.ceil(params / leaves / unit) * unit * leaves
    return padded / 8 + 4 * leaves * workers


def _param(config: Any, name: str, default: Any) -> Any:
    return getattr(config.optimizer.params, name, default)


def zero_one_fractions(config: Any, steps: int, *, after: int = 0) -> tuple[float, float]:
    """(full-precision, 1-bit) all-reduces per step of 0/1 Adam, averaged over its phase.

    Steps are counted as DeepSpeed's `ZeroOneAdam.step` counts them; the phase is the one step
    `steps` is in (after `var_freeze_step`: from the freeze to `steps`), from step `after + 1`
    on where that is later.
    """
    p = {k: int(_param(config, k, v)) for k, v in ZERO_ONE_DEFAULTS.items()}
    freeze = p["var_freeze_step"]
    first, last = (freeze, steps) if steps > freeze else (0, max(1, steps))
    first = max(first, min(after, last - 1))
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    full = onebit = 0
    for step in range(1, last + 1):
        frozen = step > freeze
        counted = step > first
        if not frozen:
            update = step % var_interval == 0
            full += counted and update
            onebit += counted and not update
            if update:
                var_counter += 1
                if var_counter == p["var_update_scaler"]:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            onebit += counted and step % local_interval == 0
            local_counter += 1
            if local_counter == p["local_step_scaler"]:
                local_counter = 0
                local_interval = min(p["local_step_clipper"], local_interval * 2)
    window = max(1, last - first)
    return full / window, onebit / window


def exchange_fractions(config: Any, optimizer: str, phase: str = "auto") -> tuple[float, float]:
    """(full-precision gradient all-reduces, 1-bit all-reduces) per step of `optimizer`.

    Args:
      phase: "auto" (the second half of a run of `config.steps`, where throughput is measured
        after start-up, within the phase the run ends in), "warmup" or "compressed".
    """
    if optimizer not in ONEBIT_TYPES:
        return 1.0, 0.0
    if optimizer == "ZeroOneAdam":
        freeze = int(_param(config, "var_freeze_step", ZERO_ONE_DEFAULTS["var_freeze_step"]))
        steps = {"auto": config.steps, "warmup": min(config.steps, freeze),
                 "compressed": max(config.steps, freeze + 1000)}[phase]
        return zero_one_fractions(config, steps, after=steps // 2 if phase == "auto" else 0)
    compressed = phase == "compressed" or (
        phase == "auto" and config.steps > int(_param(config, "freeze_step", 100000)))
    return (0.0, 1.0) if compressed else (1.0, 0.0)


def param_counts(config: Any) -> dict[str, float]:
    """Parameters of the GPT by where they live: per layer (matmuls, norms) and outside.

    With MoE, `layer_expert` is the routed experts' weights per layer, averaged over the layers
    (split over the `expert` axis, as their owners hold them); `layer_matmul` is the rest (the
    attention, the dense FFNs, the routers and shared or residual experts), averaged likewise.
    """
    m = config.model
    d, heads = m.d_model, m.n_heads
    head_dim, kv = d // heads, m.n_kv_heads or heads
    attention = d * heads * head_dim * 2 + 2 * d * kv * head_dim
    mlp = (3 if m.mlp == "swiglu" else 2) * d * m.d_ff
    experts = 0.0
    if m.moe:
        moe, n_moe = m.moe, m.n_layers // m.moe.every_n_layers
        expert = expert_matmul_params(m)
        beside = d * moe.num_experts + moe.num_shared_experts * expert  # router, shared experts
        if moe.use_residual:
            beside += expert + 2 * d
        mlp = ((m.n_layers - n_moe) * mlp + n_moe * beside) / m.n_layers
        experts = n_moe * moe.num_experts * expert / m.n_layers
    embed = m.vocab_size * d * (1 if m.tie_embeddings else 2)
    return {"layer_matmul": attention + mlp, "layer_expert": experts, "layer_norm": 2 * d,
            "embed": embed, "final_norm": d}


def step_transfers(
    config: Any, plan: Any, *, hosts: int = 1, optimizer: str | None = None,
    phase: str = "auto", gloo: bool = False,
) -> list[Transfer]:
    """The data-parallel collectives of one step of `plan` (module docstring), and Muon's
    moves of its matrices to their owners and back (`jaxspeed.autoplan.muon_cost`).

    Args:
      config: the run config (model, dtypes, optimizer, `steps`).
      plan: a `jaxspeed.autoplan.space.Candidate` (mesh, stage, remat, accumulation, switches).
      hosts: hosts the `data` axis is split over (`mesh_sizes`).
      optimizer: price this optimizer type instead of `config.optimizer.type`.
      phase: which phase of a 1-bit optimizer (`exchange_fractions`).
      gloo: the collectives run over gloo (`max_reduce_scatter_elements: auto` cuts there).
    """
    out = _exchanges(config, plan, hosts=hosts, optimizer=optimizer, phase=phase, gloo=gloo)
    if config.optimizer.type == "Muon" and optimizer in (None, "Muon"):
        from jaxspeed.autoplan.muon_cost import muon_cost, muon_owners

        sizes = mesh_sizes(plan.sizes, hosts)
        axes = muon_owners(plan.stage, sizes, (DATA, HOST, SEQUENCE, EXPERT))
        _, nbytes = muon_cost(config, layers=config.model.n_layers // sizes["pipe"], axes=axes,
                              sizes=sizes)
        if nbytes:
            out.append(Transfer("muon.owners", "all-to-all", nbytes, axes, 2.0))
    return out


def _exchanges(
    config: Any, plan: Any, *, hosts: int, optimizer: str | None, phase: str, gloo: bool,
) -> list[Transfer]:
    """`step_transfers` but Muon's: the gradients', params' and 1-bit exchanges."""
    sizes = mesh_sizes(plan.sizes, hosts)
    m, counts = config.model, param_counts(config)
    layers = m.n_layers // sizes["pipe"]
    layered_params = layers * (counts["layer_matmul"] / sizes["tensor"] + counts["layer_norm"])
    other_params = counts["embed"] / sizes["tensor"] + counts["final_norm"]
    # the experts a device owns: replicated (and ZeRO-split) over the batch axes but `expert`
    experts = layers * counts["layer_expert"] / sizes["tensor"] / sizes[EXPERT]
    params = layered_params + other_params
    leaves = layers * LAYER_LEAVES + OTHER_LEAVES
    batch_axes = tuple(a for a in (HOST, DATA, EXPERT) if sizes[a] > 1)
    zero_axes = tuple(a for a in (DATA, HOST, SEQUENCE, EXPERT) if sizes[a] > 1)
    beside = lambda axes: tuple(a for a in axes if a != EXPERT)  # noqa: E731 (the experts')
    out: list[Transfer] = []

    def add(name, kind, nbytes, axes, count):
        if axes and nbytes > 0 and count > 0:
            out.append(Transfer(name, kind, float(nbytes), tuple(axes), float(count)))

    stage = plan.stage
    if stage == 3:
        if shard_order_is_host(config.zero_optimization, gloo=gloo):  # the rings' order
            zero_axes = tuple(a for a in HOST_MAJOR_AXES if sizes[a] > 1)
        out += _zero3(config, plan, sizes, zero_axes, layered_params, other_params, layers,
                      gloo=gloo, layered_vectors=layers * counts["layer_norm"])
        if experts:
            out += [t._replace(name=t.name.replace("zero3.", "zero3.experts."))
                    for t in _zero3(config, plan, sizes, beside(zero_axes), experts, 0.0,
                                    layers, gloo=gloo)]
        return out
    # XLA reduces a scanned stack's gradients layer by layer inside the backward loop, and
    # the rest in one combined collective
    per_layer = layered_params / max(1, layers)
    if stage in (1, 2):
        for kind, name in (("reduce-scatter", "zero.grad_reduce_scatter"),
                           ("all-gather", "zero.param_all_gather")):
            add(f"{name}.layers", kind, 4 * per_layer, zero_axes, layers)
            add(f"{name}.other", kind, 4 * other_params, zero_axes, 1)
            add(f"{name}.experts", kind, 4 * experts / max(1, layers), beside(zero_axes), layers)
        return out
    full, onebit = exchange_fractions(config, optimizer or config.optimizer.type, phase)
    add("grad_all_reduce.layers", "all-reduce", 4 * per_layer, batch_axes, full * layers)
    add("grad_all_reduce.other", "all-reduce", 4 * other_params, batch_axes, full)
    add("grad_all_reduce.experts", "all-reduce", 4 * experts / max(1, layers),
        beside(batch_axes), full * layers)
    workers = math.prod(sizes[a] for a in batch_axes)
    onebit_b = onebit_bytes(params, workers, leaves)
    add("onebit.all_to_all", "all-to-all", onebit_b, batch_axes, onebit)
    add("onebit.all_gather", "all-gather", onebit_b, batch_axes, onebit)
    return out


def _quantized(name: str, kind: str, elements: float, bits: int, block: int,
               axes: tuple[str, ...], count: float) -> list[Transfer]:
    """A block-quantized collective: its values and its fp32 scales, each a collective."""
    blocks = num_blocks(elements, block)
    return [Transfer(f"{name}.values", kind, blocks * block * bits / 8, axes, count),
            Transfer(f"{name}.scales", kind, 4.0 * blocks, axes, count)]


def _zero3(config, plan, sizes, zero_axes, layered_params, other_params, layers, *,
           gloo: bool, layered_vectors: float = 0.0) -> list[Transfer]:
    """ZeRO-3's gathers and reduce-scatters (the explicit step's, ZeRO++ switches included),
    checked against the compiled step (`tests/test_zero3_traffic.py`): what is gathered once
    per step is gathered before the microbatches, once; what is gathered layer by layer, at
    each use in each microbatch, and again in the backward pass: its matrices always (the vectors of `layered_vectors` too where they move
    in one buffer with them, or where remat recomputes the layers)."""
    zero = config.zero_optimization
    sw = switches_of(zero, gloo=gloo)._replace(  # the plan's switches, the config's bits, block
        quantized_weights=plan.quantized_weights, hpz=plan.hpz,
        gradient_bits=zero.quantized_gradient_bits if plan.quantized_gradients else None)
    cbytes = compute_dtype(config).itemsize
    layered = ((layered_params + other_params) > zero.max_live_parameters
               or zero.fp8_all_gather)
    recompute = layered and plan.remat != "none"
    stages = [zero_axes]
    if sw.hpz and HOST in zero_axes and len(zero_axes) > 1:
        stages = [(HOST,), tuple(a for a in zero_axes if a != HOST)]
    z = math.prod(sizes[a] for a in zero_axes)
    micro = plan.accumulation
    out: list[Transfer] = []
    if not sw.grouped:  # one collective a leaf
        parts = [("layers", layered_params, LAYER_LEAVES * (layers if layered else 1), layered),
                 ("other", other_params, OTHER_LEAVES, False)]
    elif layered:  # one a layer, and one for the rest
        parts = [("layers", layered_params, layers, True), ("other", other_params, 1, False)]
    else:  # one a step
        parts = [("all", layered_params + other_params, 1, False)]
    for label, elements, leaves, per_layer in parts:
        if not elements:  # the experts' pass has no "other" part
            continue
        # hpZ's first stage of what is gathered per layer: the secondary copy, once a step
        secondary = per_layer and len(stages) > 1
        gathered = 1
        for i, axes in enumerate(stages):
            gathered *= math.prod(sizes[a] for a in axes)

            def gather(name: str, count: float, elements=elements, leaves=leaves) -> list[Transfer]:
                n = elements * gathered / z / leaves  # one leaf's gathered output, elements
                if sw.quantized_weights:
                    return _quantized(name, "all-gather", n, 8, sw.block, axes, count)
                # fp8_all_gather: the layers' weights (nearly all of their params) cross in FP8
                width = 1 if zero.fp8_all_gather and per_layer else cbytes
                runs = math.ceil(n / sw.bucket) if sw.bucket and sw.grouped else 1  # about
                return [Transfer(name, "all-gather", n * width / runs, axes, count * runs)]

            if secondary and i == 0:
                out += gather(f"zero3.secondary_gather.{label}", leaves)
                continue
            out += gather(f"zero3.forward_gather.{label}", leaves * (micro if per_layer else 1))
            # the vectors move with the matrices where grouped, but not beside `tensor`:
            # the matrices split over it move apart (`zero.collectives.gather_leaves`)
            if per_layer and (recompute or (sw.grouped and sizes[TENSOR] == 1)):
                out += gather(f"zero3.backward_gather.{label}", leaves * micro)
            elif per_layer:  # not recomputed: the matrices alone
                matrices = leaves if sw.grouped else (
                    leaves * (LAYER_LEAVES - LAYER_VECTORS) / LAYER_LEAVES)
                out += gather(f"zero3.backward_gather.{label}", matrices * micro,
                              elements=elements - layered_vectors, leaves=matrices)
        remaining = elements / leaves
        # what is gathered at each use reduce-scatters there; the rest (hpZ's secondary copy
        # too) once a microbatch, or once a step under a pipeline, which sums its own
        # microbatches' gradients
        once = 1 if sizes["pipe"] > 1 else micro
        for i, axes in reversed(list(enumerate(stages))):
            per_use = per_layer and not (secondary and i == 0)
            scatters = leaves * (micro if per_use else once)
            for group in ([(a,) for a in across_hosts_last(axes)] if sw.gradient_bits
                          else [axes]):
                if sw.gradient_bits:
                    out += _quantized(f"zero3.grad_all_to_all.{label}", "all-to-all", remaining,
                                      sw.gradient_bits, sw.block, group, scatters)
                else:
                    pieces = math.ceil(remaining / sw.bucket) if sw.bucket else 1
                    out.append(Transfer(f"zero3.grad_reduce_scatter.{label}", "reduce-scatter",
                                        4 * remaining / pieces, group, scatters * pieces))
                remaining /= math.prod(sizes[a] for a in group)
    return [t for t in out if t.axes and t.nbytes > 0]
