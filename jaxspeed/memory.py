"""Per-device memory of a plan: from the arrays' shardings and from the compiled step."""

from __future__ import annotations

import math
from typing import Any

import jax


def sharded_bytes(tree) -> int:
    """Bytes one device holds of a pytree of `ShapeDtypeStruct`s / arrays with shardings."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize  # PRNG key dtypes have an itemsize too
    return total


def host_bytes(tree) -> int:
    """Bytes one device's share keeps in host memory kinds (`pinned_host`, `unpinned_host`)."""
    on_host = [
        x for x in jax.tree.leaves(tree)
        if x.sharding is not None and (x.sharding.memory_kind or "device").endswith("host")
    ]
    return sharded_bytes(on_host)


def memory_report(engine) -> dict[str, Any]:
    """Per-device bytes for params / grads / opt state / temp, estimated and compiled.

    `estimate` comes from the plan's shardings; `compiled` from XLA's `memory_analysis()` of
    the jitted train step. `per_device_bytes.temp` is the compiled scratch (activations,
    gradients, collectives' buffers); `total` = arguments + outputs − aliased + temp.
    """
    state = engine.abstract_state()
    estimate = {
        "params": sharded_bytes(state.params),
        "grads": engine.plan.bytes_per_device("grad"),
        "opt_state": sharded_bytes(state.opt_state),
    }
    analysis = engine.compile_train_step().memory_analysis()
    compiled = {
        "argument": int(analysis.argument_size_in_bytes),
        "output": int(analysis.output_size_in_bytes),
        "alias": int(analysis.alias_size_in_bytes),
        "temp": int(analysis.temp_size_in_bytes),
        "generated_code": int(analysis.generated_code_size_in_bytes),
    }
    total = compiled["argument"] + compiled["output"] - compiled["alias"] + compiled["temp"]
    return {
        "mesh": dict(engine.mesh.shape),
        "zero_stage": engine.plan.stage,
        "per_device_bytes": {**estimate, "temp": compiled["temp"], "total": total},
        "estimate": {**estimate, "state_total": sum(estimate.values())},
        "compiled": compiled,
        "host_bytes": host_bytes(state),
    }
