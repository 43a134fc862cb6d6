"""Per-device memory of a plan: from the arrays' shardings and from the compiled step."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from jaxspeed.offload import on_host

#: Said in reports when XLA's analysis cannot tell host from device memory (the CPU backend).
HOST_NOTE = (
    "this backend's memory_analysis() counts host and device memory together; host bytes "
    "come from the arrays' memory kinds and are subtracted to give device bytes"
)


def sharded_bytes(tree) -> int:
    """Bytes one device holds of a pytree of `ShapeDtypeStruct`s / arrays with shardings."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize  # PRNG key dtypes have an itemsize too
    return total


def host_bytes(tree) -> int:
    """Bytes one device's share keeps in host memory kinds (`pinned_host`, `unpinned_host`)."""
    return sharded_bytes([x for x in jax.tree.leaves(tree) if on_host(x.sharding)])


def _compiled_stats(compiled) -> dict[str, int]:
    analysis = compiled.memory_analysis()
    names = ("argument", "output", "alias", "temp", "generated_code")
    stats = {name: int(getattr(analysis, f"{name}_size_in_bytes")) for name in names}
    for name in ("argument", "output", "alias", "temp"):
        stats[f"host_{name}"] = int(getattr(analysis, f"host_{name}_size_in_bytes"))
    return stats


#: Said with HOST_NOTE when the model streams its layers from the host.
STREAM_NOTE = (
    "the streamed layers' gradients go to host memory as the backward pass makes them: all "
    "but one layer's are subtracted from temp too"
)


def _streamed_bytes(engine, state, *, temp: int, grads: int) -> tuple[int, int]:
    """`(added, credit)`: device bytes the step needs for host-resident state, and the
    streamed gradients in `temp` that live on the host (when XLA does not count them).

    Offloaded params travel as their compute-dtype copy (cast on the host) for the forward
    and backward passes, next to the activations. Layers the model streams (`offload.fetch`)
    are on the device one scanned unit at a time instead (the fp32 slice and its cast), and
    their gradients go to the host as the backward pass makes them: the stacked gradient in
    `temp` is credited back, except the last unit's (a unit's working set can peak while its
    gradient is still on the device). The credit presumes the peak comes once the backward
    pass is done; if it comes as the backward pass starts, the layer inputs saved for it
    are live too, so `device` can be low by at most those (a residual stream per layer
    under full remat). An update on the device fetches the offloaded params,
    optimizer state and streamed gradients after the activations are freed: it adds only
    what exceeds the scratch already counted. An update on the host fetches nothing.
    """
    itemsize = np.dtype(engine.compute_dtype).itemsize
    leaves = jax.tree.leaves(state.params)
    streamed = []
    if engine.streamed_params is not None:
        mask = jax.tree.leaves(engine.streamed_params)
        streamed = [x for x, s in zip(leaves, mask, strict=True) if s]
    others = host_bytes(leaves) - host_bytes(streamed)
    compute = others * itemsize // 4
    credit = 0
    if streamed:
        units = streamed[0].shape[0]
        compute += host_bytes(streamed) // units * (4 + itemsize) // 4
        credit = host_bytes(streamed) * (units - 1) // units
    update = 0
    if engine.config.zero_optimization.offload_optimizer.update_on != "host":
        scratch = temp - credit
        update = max(0, grads + host_bytes(leaves) + host_bytes(state.opt_state) - scratch)
    return compute + update, credit


def memory_report(engine) -> dict[str, Any]:
    """Per-device bytes for params / grads / opt state / temp / host, estimated and compiled.

    `estimate` comes from the plan's shardings; `compiled` from XLA's `memory_analysis()` of
    the jitted train step. `per_device_bytes.temp` is the compiled scratch (activations,
    gradients, collectives' buffers); `total` = arguments + outputs − aliased + temp, on
    device and host together; `device` is what must fit in device memory.

    Where XLA separates host memory (GPU, TPU), `device` and `host_bytes` come from the
    analysis. Where it does not (CPU), the host-resident state is subtracted and the state
    the step streams through the device is added back, net of streamed layers' gradients
    (XLA on CPU elides those copies; see `_streamed_bytes`); `notes` says so.
    """
    state = engine.abstract_state()
    estimate = {
        "params": sharded_bytes(state.params),
        "grads": engine.plan.bytes_per_device("grad"),
        "opt_state": sharded_bytes(state.opt_state),
    }
    compiled = _compiled_stats(engine.compile_train_step())
    total = compiled["argument"] + compiled["output"] - compiled["alias"] + compiled["temp"]
    on_host_state = host_bytes(state)
    notes = []
    host_fields = ("host_argument", "host_output", "host_temp")
    if any(compiled[name] for name in host_fields):
        host = compiled["host_argument"] + compiled["host_output"] - compiled["host_alias"]
        host += compiled["host_temp"]
        device = total
    else:
        host = on_host_state
        added, credit = _streamed_bytes(
            engine, state, temp=compiled["temp"], grads=estimate["grads"]
        )
        device = total - on_host_state + added - credit
        if on_host_state:
            notes.append(HOST_NOTE)
        if credit:
            notes.append(STREAM_NOTE)
    return {
        "mesh": dict(engine.mesh.shape),
        "zero_stage": engine.plan.stage,
        "per_device_bytes": {
            **estimate, "temp": compiled["temp"], "total": total, "device": device, "host": host,
        },
        "estimate": {**estimate, "state_total": sum(estimate.values()), "host": on_host_state},
        "compiled": compiled,
        "host_bytes": host,
        "notes": notes,
    }
