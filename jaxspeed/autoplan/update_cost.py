"""What an optimizer's update costs the step: the bytes it moves per parameter, as XLA counts
them in the compiled update, at the device's memory bandwidth.

An update is elementwise over the params and its state, so its time is its memory traffic. The
traffic differs a lot between optimizers, and the planner priced none of it: measured on the
tiny GPT (4.8M params, one CPU device), XLA's `bytes accessed` per parameter and the update's
time were AdamW 60 B and 15 ms, LAMB 76 B and 15 ms, 1-bit Adam's compressed update 235 B and
90 ms (error feedback, signs packed and unpacked twice), 0/1 Adam's 333 B and 135 ms, 1-bit
LAMB's 351 B and 140 ms (also the fresh variance and the drift factor): 12-19 GB/s, the rate
of a streaming pass on that machine. Across the slow link that left 1-bit LAMB's step 0.2 s
slower than 1-bit Adam's with the same bytes on the wire, which the planner could not see.

The figure is read from the optimizer itself (`jaxspeed.optim.factory.make_optimizer`, the
phase given statically as the engine compiles it), compiled on a stand-in set of params, so a
new optimizer is priced without a table to keep. A 1-bit optimizer's phases are weighted by
how many of the priced steps run each (`phase_weights`).
"""

from __future__ import annotations

import functools
import json
import math
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp

from jaxspeed.config.optimizer import ONEBIT_TYPES

#: The params the update is compiled for: a few matrices and a norm-sized vector, so per-leaf
#: work (norms, scales, padding) weighs about as it does in a model's layers.
_STAND_IN = ((1024, 1024), (1024, 1024), (1024, 4096), (1024,))
#: Steps a 0/1 Adam "compressed" estimate averages over, from its variance freeze.
_COMPRESSED_WINDOW = 1000


@functools.lru_cache(maxsize=64)
def _bytes_per_param(optimizer_json: str, clipping: float, phase: str | None) -> float:
    """XLA's `bytes accessed` of one update of the optimizer (a config's `optimizer` section as
    JSON, after gradient clipping at `clipping` where it is > 0) in `phase` (None: no 1-bit
    phases), per parameter, compiled on one CPU device."""
    from jaxspeed.optim.factory import build_optimizer  # optax and the optimizers: when priced
    from jaxspeed.optim.onebit import PHASE_ARG

    tx, _ = build_optimizer(SimpleNamespace(optimizer=json.loads(optimizer_json), scheduler=None,
                                            gradient_clipping=clipping))
    params = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in _STAND_IN]
    extra = {} if phase is None else {PHASE_ARG: phase}

    state = jax.eval_shape(tx.init, params)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        compiled = jax.jit(functools.partial(tx.update, **extra)).lower(
            params, state, params).compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # jax 0.11 returns one dict per computation
        analysis = analysis[0]
    elements = sum(math.prod(shape) for shape in _STAND_IN)
    return float(analysis.get("bytes accessed", 0.0)) / elements


def phase_weights(optimizer_cfg: Any, steps: int, phase: str = "auto") -> dict[str | None, float]:
    """The share of the priced steps each phase of the optimizer runs (`{None: 1}` for an
    optimizer without phases).

    `phase`: "auto" prices a run of `steps` as `traffic.exchange_fractions` does (1-bit Adam and
    LAMB in the phase the run ends in, 0/1 Adam over its second half); "warmup" the first
    phase; "compressed" the phases after the freeze.
    """
    if optimizer_cfg.type not in ONEBIT_TYPES:
        return {None: 1.0}
    from jaxspeed.optim.factory import onebit_phases

    phases, phase_of = onebit_phases(optimizer_cfg)
    if phase == "warmup":
        return {phases[0]: 1.0}
    if optimizer_cfg.type != "ZeroOneAdam":
        last = phases[-1] if phase == "compressed" else phase_of(max(0, steps - 1))
        return {last: 1.0}
    freeze = optimizer_cfg.params.var_freeze_step
    window = (range(freeze, freeze + _COMPRESSED_WINDOW) if phase == "compressed"
              else range(steps // 2, max(steps, 1)))
    weights: dict[str | None, float] = {}
    for step in window:
        weights[phase_of(step)] = weights.get(phase_of(step), 0.0) + 1 / len(window)
    return weights


def optimizer_section(config: Any, optimizer: str | None = None) -> Any:
    """`config.optimizer`, or for another `optimizer` type that type with the config's lr and
    its own defaults (what `plan` prices a 1-bit variant as)."""
    if optimizer is None or optimizer == config.optimizer.type:
        return config.optimizer
    from jaxspeed.config import load_config

    return load_config(config, overrides=[replace_optimizer(config, optimizer)]).optimizer


def replace_optimizer(config: Any, optimizer: str) -> str:
    """The `--set` override that makes `config`'s optimizer an `optimizer` with the same lr."""
    return f"optimizer={{type: {optimizer}, params: {{lr: {config.optimizer.params.lr}}}}}"


def update_seconds(config: Any, *, params: float, bandwidth_gbps: float,
                   optimizer: str | None = None, phase: str = "auto") -> float:
    """Seconds one step's optimizer update takes on a device that updates `params` parameters
    (its ZeRO shard) at `bandwidth_gbps` GB/s of memory traffic.

    Args:
      config: the run config (its optimizer, gradient clipping and `steps`).
      params: parameters this device updates per step.
      bandwidth_gbps: the device's memory bandwidth (`Cluster.memory_bandwidth_gbps`).
      optimizer: price this optimizer type instead of the config's (`optimizer_section`).
      phase: as for `phase_weights`.
    """
    section = optimizer_section(config, optimizer)
    key = json.dumps(section.model_dump(mode="json"), sort_keys=True)
    per_param = sum(share * _bytes_per_param(key, float(config.gradient_clipping or 0.0), name)
                    for name, share in phase_weights(section, config.steps, phase).items())
    return per_param * params / (bandwidth_gbps * 1e9)
