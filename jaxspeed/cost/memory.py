"""Per-device memory of a plan: from the arrays' shardings and from the compiled step.

Every figure says where it comes from (`SOURCES`): `compiled` is read from XLA's
`memory_analysis()` of the compiled train step, `arrays` is summed from the shardings (and
memory kinds) of the state, and `model` is jaxspeed's own arithmetic for what XLA does not
report on this backend. Nothing labelled `compiled` holds a modelled adjustment.
"""

from __future__ import annotations

import math
from typing import TypedDict

import jax
import numpy as np

from jaxspeed.ops.offload import on_host

COMPILED, ARRAYS, MODEL = "compiled", "arrays", "model"
#: The values of a report's `sources` and of each `device_model` row's `source`.
SOURCES = (COMPILED, ARRAYS, MODEL)
#: A report's `source` for XLA:GPU (`compiled-<platform>`: which compiler's analysis it is).
COMPILED_GPU = "compiled-gpu"

#: Said in reports when XLA's analysis cannot tell host from device memory (the CPU backend).
HOST_NOTE = (
    "this backend's memory_analysis() counts host and device memory together: host bytes are "
    "summed from the arrays' memory kinds (source: arrays), and device memory needed is "
    "modelled from the compiled total (source: model; rows under it)"
)

#: Said with HOST_NOTE when the model streams its layers from the host.
STREAM_NOTE = (
    "the streamed layers' gradients go to host memory as the backward pass makes them: the "
    "model subtracts all but one layer's from the compiled temp"
)


class PerDeviceBytes(TypedDict):
    """Bytes one device needs, by category (`MemoryReport.per_device_bytes`)."""

    params: int
    grads: int
    opt_state: int
    temp: int  #: the compiled step's scratch: activations, gradients, collectives' buffers
    total: int  #: arguments + outputs - aliased + temp, as compiled (host memory included)
    device: int  #: what must fit in device memory
    host: int  #: what lives in host memory


class DeviceModelRow(TypedDict):
    """One term of a modelled `device` figure, its sign applied."""

    term: str
    bytes: int
    source: str


class MemoryReport(TypedDict):
    """`Engine.memory_report()`: a dict with these keys (see `memory_report`)."""

    mesh: dict[str, int]
    zero_stage: int
    source: str  #: `compiled-cpu` or `compiled-gpu`: whose `memory_analysis()` it is
    device_kind: str
    per_device_bytes: PerDeviceBytes
    sources: dict[str, str]  #: per key of `per_device_bytes`: one of `SOURCES`
    device_model: list[DeviceModelRow]  #: empty when `device` is compiled
    estimate: dict[str, int]  #: from the shardings: params, grads, opt_state, state_total, host
    compiled: dict[str, int]  #: XLA's figures, unchanged (`compiled_stats`)
    host_bytes: int
    notes: list[str]


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


def compiled_stats(compiled) -> dict[str, int]:
    """A compiled step's `memory_analysis()` as ints: argument, output, alias, temp (and host_*)."""
    analysis = compiled.memory_analysis()
    names = ("argument", "output", "alias", "temp", "generated_code")
    stats = {name: int(getattr(analysis, f"{name}_size_in_bytes")) for name in names}
    for name in ("argument", "output", "alias", "temp"):
        stats[f"host_{name}"] = int(getattr(analysis, f"host_{name}_size_in_bytes"))
    return stats


def step_peak(stats: dict[str, int]) -> int:
    """Arguments + outputs − aliased + temp of `compiled_stats`: the step's whole footprint."""
    return stats["argument"] + stats["output"] - stats["alias"] + stats["temp"]


def _offload_terms(engine, state, *, temp: int, grads: int) -> dict[str, int]:
    """The modelled terms of device memory when XLA counts host state as device memory:
    `fetched` and `update` (device bytes the step needs for host-resident state) and
    `streamed_grads` (the streamed gradients in `temp` that live on the host).

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
    fetched = others * itemsize // 4
    credit = 0
    if streamed:
        units = streamed[0].shape[0]
        fetched += host_bytes(streamed) // units * (4 + itemsize) // 4
        credit = host_bytes(streamed) * (units - 1) // units
    update = 0
    if engine.config.zero_optimization.offload_optimizer.update_on != "host":
        scratch = temp - credit
        update = max(0, grads + host_bytes(leaves) + host_bytes(state.opt_state) - scratch)
    return {"fetched": fetched, "update": update, "streamed_grads": credit}


def _device_model(total: int, on_host_state: int, terms: dict[str, int]) -> list[DeviceModelRow]:
    """The rows that sum to the modelled device bytes, each with its sign applied and source."""
    rows = [
        ("compiled_total", total, COMPILED),
        ("host_state", -on_host_state, ARRAYS),
        ("fetched", terms["fetched"], MODEL),
        ("update", terms["update"], MODEL),
        ("streamed_grads", -terms["streamed_grads"], MODEL),
    ]
    return [DeviceModelRow(term=term, bytes=value, source=source) for term, value, source in rows]


def memory_report(engine) -> MemoryReport:
    """Per-device bytes for params / grads / opt state / temp / host, estimated and compiled.

    `estimate` comes from the plan's shardings (source `arrays`); `compiled` is XLA's
    `memory_analysis()` of the jitted train step, unchanged (source `compiled`).
    `per_device_bytes.temp` is the compiled scratch (activations, gradients, collectives'
    buffers); `total` = arguments + outputs − aliased + temp (on CPU, host memory included),
    always compiled; `device` is what must fit in device memory. `sources` names, for each
    key of `per_device_bytes`, where its figure comes from (`SOURCES`).

    Where XLA separates host memory (GPU, TPU), `device` and `host_bytes` are compiled. Where
    it does not (CPU) and state lives on the host, `host` is summed from the arrays' memory
    kinds, and `device` is modelled: the host-resident state is subtracted from the compiled
    total and the state the step streams through the device is added back, net of streamed
    layers' gradients (XLA on CPU elides those copies; see `_offload_terms`). Then
    `device_model` lists the terms, each with its source, and `notes` says so; otherwise
    `device_model` is empty. `source` names the compiler behind every `compiled` figure:
    `compiled-gpu` for XLA:GPU (also when compiled without a GPU, `jaxspeed.gpu.deviceless`),
    `compiled-cpu` for XLA:CPU; `device_kind` is the device compiled for.
    """
    state = engine.abstract_state()
    estimate = {
        "params": sharded_bytes(state.params),
        "grads": engine.plan.bytes_per_device("grad"),
        "opt_state": sharded_bytes(state.opt_state),
    }
    compiled = compiled_stats(engine.compile_train_step())
    total = step_peak(compiled)
    on_host_state = host_bytes(state)
    notes: list[str] = []
    device_model: list[DeviceModelRow] = []
    sources = {name: ARRAYS for name in estimate} | {"temp": COMPILED, "total": COMPILED}
    host_fields = ("host_argument", "host_output", "host_temp")
    if any(compiled[name] for name in host_fields):
        host = compiled["host_argument"] + compiled["host_output"] - compiled["host_alias"]
        host += compiled["host_temp"]
        device = total
        sources |= {"device": COMPILED, "host": COMPILED}
    elif on_host_state:
        terms = _offload_terms(engine, state, temp=compiled["temp"], grads=estimate["grads"])
        device_model = _device_model(total, on_host_state, terms)
        host, device = on_host_state, sum(row["bytes"] for row in device_model)
        sources |= {"device": MODEL, "host": ARRAYS}
        notes.append(HOST_NOTE)
        if terms["streamed_grads"]:
            notes.append(STREAM_NOTE)
    else:  # nothing on the host: the compiled total is all device memory
        host, device = 0, total
        sources |= {"device": COMPILED, "host": COMPILED}
    compiled_for = engine.mesh.devices.flat[0]
    return MemoryReport(
        mesh=dict(engine.mesh.shape),
        zero_stage=engine.plan.stage,
        source=f"compiled-{compiled_for.platform}",
        device_kind=compiled_for.device_kind,
        per_device_bytes=PerDeviceBytes(
            **estimate, temp=compiled["temp"], total=total, device=device, host=host),
        sources=sources,
        device_model=device_model,
        estimate={**estimate, "state_total": sum(estimate.values()), "host": on_host_state},
        compiled=compiled,
        host_bytes=host,
        notes=notes,
    )
