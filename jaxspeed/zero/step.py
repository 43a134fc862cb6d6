"""ZeRO-3's loss and gradients with explicit collectives: a `shard_map` over the data-parallel
axes `host`, `data` and `expert`.

Inside the map each data-parallel worker holds its rows, its ZeRO shard of every param and,
with an expert axis, its experts; the MoE layers exchange tokens with the experts' owners
inside the map. `tensor` stays automatic: the weights stay split over it, and the leaves
split over it gather inside each tensor group (`zero.collectives.gather_leaves`). With
`pipe`, the pipeline's `shard_map` nests inside this one: each stage gathers its own layers
where it runs them, forward and again in the backward of its F/B schedule (GPipe's too, as
`spmd_pipeline` runs it there; jax 0.12 or later). `sequence` must have size 1
(`_unsupported`). With `offload_param`, the shards live on the host and come in where they
are gathered (a layer's one layer at a time). The loss is
differentiated w.r.t. the shards; the gathers (`jaxspeed.zero.collectives`) run
where the params are used, and their transposes reduce-scatter the gradients, so each worker
ends with the gradient of its own shard, summed over workers in fp32, and the update runs on
shards as with the sharding path. Where the gathers run:

- the reference GPT's scanned layers: one layer at a time, inside the scan
  (`GPT.gather_layers`), again in the backward pass (the gathered params are never saved);
  hpZ's `host` stage of them once per step, before the microbatches;
- every other leaf, and every leaf of another model: once per step, before the
  microbatches, its reduce-scatter once per microbatch;
- all params within `zero_optimization.max_live_parameters`: every leaf once per step.

`explicit_zero` decides from the config whether stage 3 runs this way (`collectives`), and
refuses the ZeRO++ switches where it cannot.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxspeed.errors import ConfigError
from jaxspeed.ops import offload
from jaxspeed.ops.losses import mean_extras, sum_extras
from jaxspeed.runtime.distributed import over_gloo, process_count
from jaxspeed.runtime.mesh import DATA, EXPERT, HOST, PIPE, SEQUENCE
from jaxspeed.sharding.leaves import LeafPlan
from jaxspeed.sharding.planner import Plan
from jaxspeed.sharding.rules import without_axes
from jaxspeed.zero import collectives as zc
from jaxspeed.zero import layout as zl
from jaxspeed.sharding.two_level import spanned_hosts
from jaxspeed.sharding.vma import make_varying


def _leaves(plan: Plan, fn):
    return jax.tree.map(fn, plan.leaves, is_leaf=lambda x: isinstance(x, LeafPlan))


@dataclasses.dataclass(frozen=True, eq=False)
class ZeroStep:
    """What the explicit ZeRO-3 step needs besides the `StepSpec`.

    Attributes:
      mesh: the device mesh.
      rules: the logical rules inside the map (without its manual axes).
      specs: a pytree like the params: each stored leaf's `shard_map` spec (its manual axes:
        on the ZeRO dimension, and `expert` on an expert weight's expert dimension).
      gathers: a pytree like the params: each leaf's `LeafGather` (None: not ZeRO-sharded).
      layered: a pytree like the params: True where the model gathers the leaf layer by layer.
      switches: ZeRO++'s switches.
      compute_dtype: the dtype params are gathered in.
      model: the reference GPT with its per-layer gather, or None (no leaf is layered).
    """

    mesh: Mesh
    rules: Any
    specs: Any
    gathers: Any
    layered: Any
    switches: zl.Switches
    compute_dtype: Any
    model: Any = None

    @property
    def axes(self) -> tuple[str, ...]:
        return zl.MANUAL_AXES

    @property
    def split(self) -> tuple[str, ...]:
        """The manual axes of size > 1: the rows and the gradients vary over these only (a
        gradient summed over a size-1 axis is an all-reduce XLA:CPU does not drop)."""
        return tuple(a for a in self.axes if self.mesh.shape[a] > 1)

    @property
    def workers(self) -> int:
        return math.prod(self.mesh.shape.get(a, 1) for a in self.axes)

    def _step_gather(self, params):
        """The once-per-step gathers: whole leaves, or hpZ's secondary copy of layered ones."""
        xs, treedef = jax.tree.flatten(params)
        layered = treedef.flatten_up_to(self.layered)
        parts = ["secondary" if one else "all" for one in layered]
        # streamed (`offload_param`): a layer's shards come in one layer at a time
        # (`_gather_layer`), hpZ's secondary copy of them before the microbatches
        xs = [offload.on_device(x) if not one or self.switches.hpz else x
              for x, one in zip(xs, layered)]
        return treedef.unflatten(zc.gather_leaves(
            xs, treedef.flatten_up_to(self.gathers), parts, dtype=self.compute_dtype,
            switches=self.switches))

    def _vary(self, params):
        """Params varying over every manual axis: a leaf replicated over one of them (no ZeRO
        dimension divisible by it) has its gradient summed over it by the `pcast`'s transpose."""
        return jax.tree.map(lambda x: make_varying(x, self.split), params)

    def loss_and_grads(self, spec, params, batch, rng, scale):
        """Mean loss, mean extras and the fp32 gradients of the stored (sharded) `params`,
        over `spec.accumulation` microbatches of the global `batch`; the `train_step` part."""
        rows = P(self.split)

        def local(params, batch, rng, scale):
            with nn.logical_axis_rules(self.rules):
                micro = jax.tree.map(
                    lambda x: x.reshape(spec.accumulation, -1, *x.shape[1:]), batch)
                # each worker its own draws (gate noise, dropout): its rows are its own
                rng = jax.random.fold_in(rng, jax.lax.axis_index(self.split))
                compute, reduce = jax.vjp(lambda p: self._step_gather(self._vary(p)), params)

                def grads_of(i, b):
                    def loss_of(p):
                        loss, extras = spec.objective(p, b, jax.random.fold_in(rng, i), True)
                        loss = loss.astype(jnp.float32)
                        return loss * scale, (loss, extras)
                    (_, (loss, extras)), grads = jax.value_and_grad(loss_of, has_aux=True)(
                        compute)
                    return loss, extras, reduce(grads)[0]

                total = grads_of(0, jax.tree.map(lambda x: x[0], micro))
                if spec.accumulation > 1:
                    def body(carry, indexed):
                        loss, extras, grads = grads_of(*indexed)
                        return (carry[0] + loss, sum_extras(carry[1], extras),
                                jax.tree.map(jnp.add, carry[2], grads)), None
                    rest = jax.tree.map(lambda x: x[1:], micro)
                    total, _ = jax.lax.scan(
                        body, total, (jnp.arange(1, spec.accumulation), rest))
            loss, extras, grads = total
            n = spec.accumulation
            mean = lambda x: jax.lax.pmean(x / n, self.split)  # noqa: E731
            divisor = n * self.workers * scale
            grads = jax.tree.map(lambda g: g.astype(jnp.float32) / divisor, grads)
            return mean(loss), mean_extras(extras, n, self.split), grads

        specs = self.specs
        return jax.shard_map(
            local, mesh=self.mesh,
            in_specs=(specs, jax.tree.map(lambda _: rows, batch), P(), P()),
            out_specs=(P(), P(), specs), axis_names=set(self.axes),
        )(params, batch, rng, jnp.asarray(scale, jnp.float32))

    def eval_loss(self, spec, params, batch, rng):
        """Mean loss over the global `batch` in `spec.accumulation` microbatches (no grads)."""
        def local(params, batch, rng):
            with nn.logical_axis_rules(self.rules):
                compute = self._step_gather(self._vary(params))
                micro = jax.tree.map(
                    lambda x: x.reshape(spec.accumulation, -1, *x.shape[1:]), batch)

                def body(total, b):
                    loss, _ = spec.objective(compute, b, rng, False)
                    return total + loss.astype(jnp.float32), None

                total, _ = jax.lax.scan(
                    body, jax.lax.pcast(jnp.zeros((), jnp.float32), self.split, to="varying"),
                    micro)
            return jax.lax.pmean(total / spec.accumulation, self.split)

        return jax.shard_map(
            local, mesh=self.mesh,
            in_specs=(self.specs, jax.tree.map(lambda _: P(self.split), batch), P()),
            out_specs=P(), axis_names=set(self.axes),
        )(params, batch, rng)


def _is_gather(x) -> bool:
    return x is None or isinstance(x, zl.LeafGather)


#: The first jax whose XLA compiles a pipeline nested in the step's map.
NESTED_PIPELINE_JAX = (0, 12)


def _unsupported(config, mesh: Mesh) -> str | None:
    """Why stage 3 cannot run with explicit collectives here (None: it can)."""
    zero = config.zero_optimization
    if mesh.shape.get(SEQUENCE, 1) > 1:
        return f"mesh.sequence={mesh.shape[SEQUENCE]}"
    if mesh.shape.get(PIPE, 1) > 1 and jax.__version_info__ < NESTED_PIPELINE_JAX:
        # its XLA aborts on the nested map's manual axes ("Manual axes must be sorted")
        return f"mesh.pipe={mesh.shape[PIPE]} on jax {jax.__version__} (0.12 or later runs it)"
    if config.fp8.enabled and config.fp8.recipe == "delayed":  # its state is not carried there
        return "fp8.recipe=delayed"
    if zero.fp8_all_gather:  # the sharding path gathers what the FP8 matmuls read
        return "zero_optimization.fp8_all_gather"
    return None


#: `max_reduce_scatter_elements: auto` where the collectives run over gloo (see the schema).
GLOO_BUCKET = 2**18
#: `max_reduce_scatter_elements: auto` elsewhere: runs of 2**22 elements (8 MiB gathered in
#: bf16, 16 MiB of fp32 gradients). The step peak of `zero_memory.py`'s 100M model came
#: within 1.5% of the sharding path's, layer by layer and once per step; 2**20 within 2.6%,
#: 2**23 6% over layer by layer (a whole layer in one run), none 39% over once per step.
RUN_BUCKET = 2**22


def switches_of(zero, *, gloo: bool = False) -> zl.Switches:
    """The collectives' `Switches` from the `zero_optimization` section; `gloo`: whether the
    collectives run over gloo (`jaxspeed.runtime.distributed.over_gloo`), which
    `max_reduce_scatter_elements: auto` follows."""
    bucket = zero.max_reduce_scatter_elements
    return zl.Switches(
        quantized_weights=zero.zero_quantized_weights,
        gradient_bits=zero.quantized_gradient_bits if zero.zero_quantized_gradients else None,
        hpz=zero.zero_hpz_partition_size > 1,
        block=zero.quantization_block_size,
        bucket=(GLOO_BUCKET if gloo else RUN_BUCKET) if bucket == "auto" else bucket,
    )


def check_hpz(size: int, mesh: Mesh) -> None:
    """`zero_hpz_partition_size` is 1 (off) or the dense weights' ZeRO group within a host
    (`data` per host, times `expert`: the expert weights' group is `data` alone)."""
    intra = mesh.shape.get(DATA, 1) * mesh.shape.get(EXPERT, 1)
    if size not in (1, intra):
        expert = f" x mesh.expert {mesh.shape[EXPERT]}" if mesh.shape.get(EXPERT, 1) > 1 else ""
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size={size}: accepted values are 1 (off) or "
            f"{intra} (the ZeRO group within a host: mesh.data / mesh.hosts = "
            f"{mesh.shape.get(DATA, 1) * mesh.shape.get(HOST, 1)} / {mesh.shape.get(HOST, 1)}"
            f"{expert})"
        )


def gathered_once(config, mesh: Mesh, plan: Plan, param_count: int):
    """The sharding path's (`collectives: compiler`) compute params for ZeRO-3, gathered once
    per step when they all fit `max_live_parameters`; else None (XLA gathers them where used).

    Not with offloaded params (they stream from the host) or a pipeline (each stage holds its
    own layers), nor with `fp8_all_gather`: then each use gathers its weights after the FP8
    matmul has cast them (XLA quantizes the shard and gathers the FP8 values with their scale,
    half the bytes of the compute dtype's gather; `tests/test_gpu_compile.py`).
    """
    zero = config.zero_optimization
    if (zero.stage < 3 or zero.offload_param.device != "none" or mesh.shape.get(PIPE, 1) > 1
            or zero.fp8_all_gather):
        return None
    return plan.params_gathered if param_count <= zero.max_live_parameters else None


def runs_explicit(config, mesh: Mesh) -> bool:
    """Whether stage 3 runs with explicit collectives on `mesh`.

    `collectives: auto` runs them where the mesh spans hosts (`spans_hosts`) or a ZeRO++
    switch is on, and keeps the sharding path inside one host, where it measured faster on CPU
    on 2026-12-04 (13-27% on `throughput.py`'s fsdp8, an AVX2 machine; on 2026-12-06 the
    explicit step was 1.08x faster on an AVX-512 one, `zero_paths.py`) and where the explicit
    step peaked higher until its groups moved in runs of whole leaves (now within 1.5% on
    `zero_memory.py`'s 100M model; benchmarks/README). `explicit` and the ZeRO++
    switches refuse (one `ConfigError`) where they cannot run: a sequence axis, delayed FP8
    scaling, `fp8_all_gather`. With an `expert` axis the MoE layers exchange tokens inside the step's map
    (`jaxspeed.moe.parallel.moe_ffn`).
    """
    zero = config.zero_optimization
    if zero.stage != 3 or zero.collectives == "compiler":
        return False
    switches = switches_of(zero)
    wanted = [key for key, on in (("collectives=explicit", zero.collectives == "explicit"),
                                  ("zero_quantized_weights", switches.quantized_weights),
                                  ("zero_quantized_gradients", switches.gradient_bits),
                                  ("zero_hpz_partition_size", switches.hpz)) if on]
    why = _unsupported(config, mesh)
    if why is not None:
        if wanted:
            raise ConfigError(
                f"zero_optimization.{wanted[0]} needs ZeRO-3 with explicit collectives, which "
                f"is not available with {why}; turn it off (collectives: auto uses the "
                f"sharding path there)")
        return False
    return bool(wanted) or spans_hosts(mesh)


def host_major(config, mesh: Mesh) -> bool:
    """Whether the explicit step's ZeRO shards are host-major on `mesh` (`shard_order`)."""
    if not runs_explicit(config, mesh) or mesh.shape.get(HOST, 1) == 1:
        return False
    return shard_order_is_host(config.zero_optimization, gloo=over_gloo(mesh.devices.flat))


def shard_order_is_host(zero, *, gloo: bool) -> bool:
    """`shard_order` of the `zero_optimization` section resolved: `auto` is host-major over
    gloo, where a data-major ring crosses hosts at every edge (ZeRO-3 on the slow link: 453
    tokens/s host-major, 280 data-major), else data-major."""
    if zero.shard_order != "auto":
        return zero.shard_order == "host"
    return gloo


def spans_hosts(mesh: Mesh) -> bool:
    """Whether `mesh` crosses hosts: a `host` axis, or devices of several processes (an expert
    axis across them, as on the slow link's `mesh.expert=4, mesh.data=1`)."""
    return mesh.shape.get(HOST, 1) > 1 or process_count(mesh.devices.flat) > 1


def two_level_axes(mesh: Mesh) -> tuple[tuple[str, int], ...]:
    """`(axis, hosts)` of the manual axes whose devices span `hosts` processes with no `host`
    axis naming them (the slow link's `mesh.expert=4, mesh.data=1`): `Switches.two_level`."""
    processes = process_count(mesh.devices.flat)
    spans = [(axis, spanned_hosts(mesh, axis, processes)) for axis in zl.MANUAL_AXES
             if mesh.shape.get(axis, 1) > 1]
    return tuple((axis, hosts) for axis, hosts in spans if 1 < hosts < mesh.shape[axis])


def explicit_zero(config, mesh: Mesh, plan: Plan, model, *, compute_dtype,
                  param_count: int) -> ZeroStep | None:
    """The `ZeroStep` when stage 3 runs with explicit collectives (`runs_explicit`), else None."""
    if not runs_explicit(config, mesh):
        return None
    zero = config.zero_optimization
    switches = switches_of(zero, gloo=over_gloo(mesh.devices.flat))._replace(
        two_level=two_level_axes(mesh))
    check_hpz(zero.zero_hpz_partition_size, mesh)
    gathers = _leaves(plan, lambda leaf: zl.leaf_gather(leaf.param, leaf.gathered))
    # a model that takes a per-layer gather hook (the reference GPT's `gather_layers`)
    per_layer = hasattr(model, "gather_layers") and param_count > zero.max_live_parameters
    layered = _leaves(plan, lambda leaf: per_layer and (leaf.logical or ())[:1] == ("layers",))
    step = ZeroStep(mesh=mesh, rules=without_axes(plan.rules, zl.MANUAL_AXES),
                    specs=_leaves(plan, lambda leaf: zl.manual_spec(leaf.param)),
                    gathers=gathers, layered=layered, switches=switches,
                    compute_dtype=compute_dtype)
    if not per_layer:
        return step
    layer_gathers = {
        path: (leaf.sliced() if leaf is not None else None)
        for path, leaf in _flat(gathers).items() if path.startswith("layers/")
    }
    hook = functools.partial(_gather_layer, gathers=layer_gathers, dtype=compute_dtype,
                             switches=switches)
    return dataclasses.replace(step, model=model.clone(gather_layers=hook))


def _flat(tree) -> dict[str, Any]:
    from jaxspeed.sharding.planner import path_str

    flat = jax.tree.flatten_with_path(tree, is_leaf=_is_gather)[0]
    return {path_str(p): leaf for p, leaf in flat}


def _gather_layer(variables, *, gathers, dtype, switches):
    """`GPT.gather_layers`: one scanned unit's `{"params": ...}` gathered for its use; with
    `offload_param`, its shards streamed in from the host first (one layer at a time)."""
    def one(collection):
        prefixed = {"layers": jax.tree.map(offload.on_device, collection)}
        out = zc.gather_tree(prefixed, gathers, dtype=dtype, switches=switches, part="use")
        return out["layers"]
    return {name: one(tree) for name, tree in variables.items()}
