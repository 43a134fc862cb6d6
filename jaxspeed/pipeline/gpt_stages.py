"""The reference GPT as a pipeline: its scanned layers split into stages over the `pipe` axis.

The embedding runs before the pipelined body and the final norm, head and loss at its last
stage (`spmd_pipeline`'s `loss_fn`), so a 1F1B step takes each microbatch's loss cotangent
where it is made. The layers' params, `[n_layers, ...]` leaves sharded over `pipe` by the
planner (`layers` → `pipe`), are viewed as `[stages, n_layers / stages, ...]`: with the uniform
partition that is a reshape of the same shards, so nothing moves.

`partition: balanced` handles `n_layers % stages != 0` by padding: stage s gets
`n_layers // stages` or one more real layer, and the rest of its slots are gated-off copies
(`x + 0 · (layer(x) − x)`, with zero parameters and a gradient that is dropped), so the stages
stay one stacked shape.

Inside the pipe-manual region, a loss that gathers from vocab-sharded logits with
data-sharded labels (`lm_loss`), or the logits' own `(batch, length, vocab)` constraint,
crashes XLA's SPMD partitioner on a pipe × data × tensor mesh (jax 0.10.2: "Check failed:
partition_group_list.num_replica_groups() * ..."). So the head runs without the logical
rules and its logits are constrained to rows over the data-parallel axes, vocab whole (one
all-gather over `tensor` per microbatch), before the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxspeed.errors import ConfigError
from jaxspeed.runtime.mesh import DATA_PARALLEL_AXES
from jaxspeed.pipeline.schedules import check_schedule_args
from jaxspeed.pipeline.spmd import spmd_pipeline

PARTITIONS = ("uniform", "balanced")
PyTree = Any


def layer_slots(n_layers: int, stages: int, partition: str) -> np.ndarray:
    """Which layer fills each stage slot: int `[stages, per_stage]`, -1 for a padding slot.

    Raises:
      ConfigError: an unknown partition, or `uniform` with layers not divisible by stages.
    """
    if partition not in PARTITIONS:
        raise ConfigError(f"pipeline.partition: got {partition!r}; accepted values are {list(PARTITIONS)}")
    if partition == "uniform" and n_layers % stages:
        raise ConfigError(
            f"pipeline.partition='uniform' needs model.n_layers={n_layers} divisible by the "
            f"{stages} pipeline stages; change n_layers or set pipeline.partition: balanced "
            f"(pads the short stages with gated-off layers)"
        )
    per_stage = -(-n_layers // stages)
    counts = [n_layers // stages + (s < n_layers % stages) for s in range(stages)]
    slots = np.full((stages, per_stage), -1, np.int32)
    start = 0
    for s, count in enumerate(counts):
        slots[s, :count] = np.arange(start, start + count)
        start += count
    return slots


def stage_params(layers: PyTree, slots: np.ndarray) -> tuple[PyTree, jax.Array | None]:
    """`[n_layers, ...]` layer params → `[stages, per_stage, ...]`, plus the slot gates.

    Returns:
      The staged params and `None` when every slot holds a layer (a reshape), else float32
      gates `[stages, per_stage]` (1 for a layer, 0 for padding; padding params are zeros).
    """
    stages, per_stage = slots.shape
    if (slots >= 0).all():
        return jax.tree.map(lambda a: a.reshape(stages, per_stage, *a.shape[1:]), layers), None
    index = jnp.asarray(np.maximum(slots, 0))
    valid = jnp.asarray(slots >= 0)

    def gather(a):
        taken = jnp.take(a, index, axis=0)
        mask = valid.reshape(*valid.shape, *([1] * (a.ndim - 1)))
        return jnp.where(mask, taken, jnp.zeros((), a.dtype))

    return jax.tree.map(gather, layers), valid.astype(jnp.float32)


def pipelined_lm_objective(
    model: Any,
    loss_fn: Callable[[jax.Array, Any], jax.Array],
    *,
    mesh: Mesh,
    num_microbatches: int,
    schedule: str,
    partition: str = "uniform",
    virtual_stages: int = 1,
) -> Callable[[PyTree, Any], jax.Array]:
    """`(params, batch) -> loss` of the GPT, its layers pipelined over the `pipe` axis.

    Equal to `loss_fn(model.apply({"params": params}, batch["inputs"]), microbatch)` averaged
    over the `num_microbatches` microbatches (rows i, i+M, ...), and so are its gradients.

    Args:
      model: a `jaxspeed.models.GPT` (anything with its `embed` / `layer_stack` / `logits`).
      loss_fn: `(logits, batch) -> scalar`, e.g. `jaxspeed.ops.losses.lm_loss`.
      mesh: the mesh; its `pipe` axis holds the stages.
      num_microbatches: M.
      schedule: "gpipe", "1f1b" or "interleaved".
      partition: "uniform" or "balanced" (see the module docstring).
      virtual_stages: stages per device for "interleaved".

    Raises:
      ConfigError: a model without those pieces, or layers that cannot be split.
    """
    for method in ("embed", "layer_stack", "logits"):
        if not callable(getattr(model, method, None)):
            raise ConfigError(
                f"pipeline parallelism (mesh.pipe > 1) needs the reference GPT or a model with "
                f"embed / layer_stack / logits methods; {type(model).__name__} has no {method!r}"
            )
    virtual_stages = virtual_stages if schedule == "interleaved" else 1
    try:
        check_schedule_args(schedule, mesh.shape["pipe"], num_microbatches, virtual_stages)
    except ValueError as err:
        raise ConfigError(f"pipeline: {err}") from None
    slots = layer_slots(model.num_units, mesh.shape["pipe"] * virtual_stages, partition)
    layer = model.layer_stack(1)

    def run_layer(x, one):
        params, gate = one
        y, _ = layer.apply({"params": jax.tree.map(lambda a: a[None], params)}, x, False)
        return (y if gate is None else x + gate.astype(x.dtype) * (y - x)), None

    def stage_fn(staged, x):
        params, gates = staged["layers"], staged.get("gates")
        x, _ = jax.lax.scan(run_layer, x, (params, gates))
        return x

    def head_loss(head_params, y, extra):
        with nn.logical_axis_rules(()):  # see the note above
            logits = model.apply({"params": head_params}, y, method="logits")
        # rows over the data-parallel axes left automatic (explicit ZeRO-3 holds them manual)
        manual = jax.sharding.get_abstract_mesh().manual_axes
        rows = tuple(a for a in DATA_PARALLEL_AXES if a in mesh.axis_names and a not in manual)
        logits = jax.lax.with_sharding_constraint(logits, P(rows))
        return loss_fn(logits, extra)

    def objective(params, batch):
        outer = {k: v for k, v in params.items() if k != "layers"}
        x = model.apply({"params": outer}, batch["inputs"], method="embed")
        layers, gates = stage_params(params["layers"], slots)
        staged = {"layers": layers} if gates is None else {"layers": layers, "gates": gates}
        extra = {k: v for k, v in batch.items() if k != "inputs"}
        return spmd_pipeline(
            stage_fn, staged, x, num_microbatches=num_microbatches, schedule=schedule,
            mesh=mesh, virtual_stages=virtual_stages,
            loss_fn=head_loss, loss_params=outer, loss_inputs=extra,
        )

    return objective
