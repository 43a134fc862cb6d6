"""A model's own training step as `calibrate --config` times it: the efficiency the planner
prices that model's compute at.

Calibrate's default `efficiency` is a matmul-only MLP's, which a small model's step does not
reach: its norms, softmax, loss and optimizer update take about as long again as its matmuls
(measured on the tiny GPT on CPU: 0.43 s a step against 0.25 s priced from the MLP). Timing the
model itself and dividing out what the planner prices separately gives the figure the planner's
compute term (`estimate`: matmul FLOPs / (peak x efficiency)) needs to come out right.

The step is the config's, on one device, with the per-device micro batch and accumulation the
config resolves to on the whole cluster, ZeRO-0, no offload, and the uncompressed optimizer of a
1-bit one (whose exchange `traffic` prices). Every device of the host runs its own copy at once,
as they share the host's cores in training, and none communicates: collectives are priced from
the links, and across processes even the devices of one process reach each other through gloo
(measured: an intra-host all-reduce in the step made it 0.71 s against 0.43 s without).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxspeed.autoplan.estimate import estimate
from jaxspeed.autoplan.space import from_config
from jaxspeed.autoplan.update_cost import replace_optimizer
from jaxspeed.config import Config, load_config
from jaxspeed.config.cluster import Cluster
from jaxspeed.config.optimizer import ONEBIT_TYPES
from jaxspeed.config.sizes import resolve_batch
from jaxspeed.ops.precision import compute_dtype
from jaxspeed.runtime.mesh import DATA, EXPERT, HOST, config_axis_sizes, make_mesh

#: The optimizer a 1-bit optimizer's step is timed with: its uncompressed baseline.
_UNCOMPRESSED = {"OneBitAdam": "Adam", "ZeroOneAdam": "Adam", "OneBitLamb": "Lamb"}


def probe_config(config: Config, *, devices: int, local: int) -> Config:
    """`config` as the step probe runs it on one of `local` devices of each host of a
    `devices`-device cluster."""
    sizes = config_axis_sizes(config.mesh.axis_sizes(), devices, devices // local)
    batch = resolve_batch(config, sizes[HOST] * sizes[DATA] * sizes[EXPERT])
    sets = [
        "mesh.pipe=1", "mesh.tensor=1", "mesh.sequence=1", "mesh.expert=1", "mesh.data=1",
        "mesh.hosts=1", "zero_optimization.stage=0",
        "zero_optimization.offload_optimizer.device=none",
        "zero_optimization.offload_param.device=none",
        f"train_batch_size={batch.micro_batch_per_device * batch.accumulation_steps}",
        f"train_micro_batch_size_per_device={batch.micro_batch_per_device}",
        f"gradient_accumulation_steps={batch.accumulation_steps}",
    ]
    if config.optimizer.type in ONEBIT_TYPES:
        sets.append(replace_optimizer(config, _UNCOMPRESSED[config.optimizer.type]))
    return load_config(config, overrides=sets)


def step_probe(config: Config, devices: Sequence[jax.Device]) -> Callable[[], Any]:
    """A training step of `config`'s model (a `probe_config`) on each of `devices` (this
    process's) at once, as a call that returns their losses; each call steps every device's
    state on, on the same batch."""
    from jaxspeed.train.engine import initialize  # the engine is the planner's client, not its base

    steps = []
    for device in devices:
        engine = initialize(config, mesh=make_mesh({DATA: 1}, devices=[device]))
        state = [engine.init(jax.random.key(config.seed))]
        shape = (engine.batch_sizes.train_batch_size, config.data.seq_len)
        tokens = np.random.default_rng(config.seed).integers(0, config.model.vocab_size, shape,
                                                             np.int32)
        batch = jax.device_put({"inputs": tokens, "targets": tokens}, engine.batch_sharding())

        def step(engine=engine, state=state, batch=batch):
            state[0], metrics = engine.train_step(state[0], batch)
            return metrics["loss"]

        steps.append(step)
    return lambda: [step() for step in steps]  # dispatched to every device before any waits


def step_efficiency(config: Config, seconds: float, cluster: Cluster) -> float:
    """The efficiency that makes the planner's compute term equal the timed step.

    `seconds` is one step of `config` (a `probe_config`) on every device at once. The planner
    prices that step as matmul FLOPs / (peak x efficiency) plus the local weights' reads, which
    is taken off before dividing.
    """
    one = cluster.model_copy(update={"hosts": 1, "devices_per_host": 1, "efficiency": 1.0})
    est = estimate(config, from_config(config, {DATA: 1}), one)
    matmul = est.flops / one.peak_flops(compute_dtype(config).name)
    priced_apart = est.compute_s - matmul + est.comm_s + est.host_s
    return min(1.0, matmul / max(seconds - priced_apart, matmul))
