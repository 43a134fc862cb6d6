"""What an optimizer's update costs the step: the bytes it moves per parameter, as XLA counts
them in the compiled update, at the rate the device runs updates.

An update is elementwise over the params and its state, so its time follows its memory
traffic, and that differs a lot between optimizers; the planner priced none of it. Measured on
the tiny GPT's params (4.8M, fp32, clipped), 2 devices sharing one CPU core, each updating its
own copy (XLA's bytes per parameter; the time of both): AdamW 60 B, 36 ms; LAMB 76 B, 42 ms;
1-bit Adam's compressed update 178 B, 215 ms (error feedback, signs packed and unpacked
twice); 0/1 Adam's sync 235 B, 220 ms and its local step 93 B, 64 ms; 1-bit LAMB's compressed
update 269 B, 360 ms (also the fresh variance and the drift factor). Across the slow link
1-bit LAMB's step was 0.2 s slower than 1-bit Adam's with the same bytes on the wire, which
the planner could not see.

The figure is read from the optimizer itself (`jaxspeed.optim.factory.make_optimizer`, the
phase given statically as the engine compiles it), compiled on a stand-in set of params, so a
new optimizer is priced without a table to keep. A 1-bit optimizer's phases are weighted by
how many of the priced steps run each (`phase_weights`).

The rate: a calibrated cluster has two (`Cluster.update_bandwidth`; `calibrate` times them
with `update_probe`), because the phases that compress (sign bits packed and unpacked, scales
spread per leaf, error feedback) move XLA's bytes at about half the rate a plain update does.
Measured with 2 devices sharing a core, the tiny GPT's params on each: AdamW's update at
0.125 ns a byte, 1-bit Adam's compressed one at 0.253. At those two rates the other updates
came out LAMB +8%, 0/1 Adam's local step -13% and its sync +28%, 1-bit LAMB's compressed
update -12% of their measured times; at the stream rate alone 1-bit LAMB's was -50%. Without
them (the presets) every phase is priced at `memory_bandwidth_gbps`, right for a GPU, where an
update is a bandwidth-bound stream.
"""

from __future__ import annotations

import functools
import json
import math
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspeed.config.optimizer import ONEBIT_TYPES

#: The params the update is compiled for: a few matrices and a norm-sized vector, so per-leaf
#: work (norms, scales, padding) weighs about as it does in a model's layers.
_STAND_IN = ((1024, 1024), (1024, 1024), (1024, 4096), (1024,))
#: Steps a 0/1 Adam "compressed" estimate averages over, from its variance freeze.
_COMPRESSED_WINDOW = 1000
#: The 1-bit optimizers' phases whose update runs the compressed all-reduce's arithmetic
#: (`onebit.COMPRESSED`; 0/1 Adam's `GRADIENT` and `SYNC`).
COMPRESSING_PHASES = ("compressed", "gradient", "sync")
#: What `calibrate` times for the two rates: (optimizer section, phase).
PLAIN_PROBE = ({"type": "AdamW", "params": {"lr": 1e-3}}, None)
COMPRESSED_PROBE = ({"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 0}},
                    "compressed")


@functools.lru_cache(maxsize=64)
def bytes_per_param(optimizer_json: str, clipping: float, phase: str | None) -> float:
    """XLA's `bytes accessed` of one update of the optimizer (a config's `optimizer` section as
    JSON, after gradient clipping at `clipping` where it is > 0) in `phase` (None: no 1-bit
    phases), per parameter, compiled on one CPU device."""
    from jaxspeed.optim.factory import build_optimizer  # optax and the optimizers: when priced

    optimizer = json.loads(optimizer_json)
    # QK-clip scales two leaves a layer by the model's logit maxima, which stand-ins lack
    optimizer.get("params", {}).pop("qk_clip", None)
    tx, _ = build_optimizer(SimpleNamespace(optimizer=optimizer, scheduler=None,
                                            gradient_clipping=clipping))
    params = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in _STAND_IN]
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        analysis = _update_fn(tx, phase).lower(params, jax.eval_shape(tx.init, params),
                                               params).compile().cost_analysis()
    elements = sum(math.prod(shape) for shape in _STAND_IN)
    return _bytes_accessed(analysis) / elements


def _bytes_accessed(analysis) -> float:
    if isinstance(analysis, list):  # jax 0.11 returns one dict per computation
        analysis = analysis[0]
    return float(analysis.get("bytes accessed", 0.0))


def _update_fn(tx, phase: str | None):
    """`tx.update` jitted, with a 1-bit optimizer's `phase` given statically."""
    from jaxspeed.optim.onebit import PHASE_ARG

    return jax.jit(functools.partial(tx.update, **({} if phase is None else {PHASE_ARG: phase})))


def update_probe(probe: tuple[dict, str | None], devices, elements: int
                 ) -> tuple[Callable[[], Any], float]:
    """One update of `probe` (`PLAIN_PROBE` or `COMPRESSED_PROBE`) on each of `devices` at
    once, each on its own `elements` params, as a call; and the bytes XLA counts for one
    device's update."""
    from jaxspeed.optim.factory import make_optimizer

    optimizer, phase = probe
    tx = make_optimizer(optimizer, learning_rate=1e-3)
    shape = (max(1, elements // 1024), 1024)
    runs = []
    for device in devices:
        params = jax.device_put(np.full(shape, 0.5, np.float32), device)
        grads = jax.device_put(np.full(shape, 1e-3, np.float32), device)
        runs.append((_update_fn(tx, phase), grads, jax.jit(tx.init)(params), params))
    fn, *args = runs[0]
    nbytes = _bytes_accessed(fn.lower(*args).compile().cost_analysis())
    return lambda: [fn(g, state, p)[0] for fn, g, state, p in runs], nbytes


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


def update_seconds(config: Any, *, params: float, cluster: Any,
                   optimizer: str | None = None, phase: str = "auto") -> float:
    """Seconds one step's optimizer update takes on a device of `cluster` that updates
    `params` parameters (its ZeRO shard): each priced phase's XLA bytes at the cluster's rate
    for it (module docstring).

    Args:
      config: the run config (its optimizer, gradient clipping and `steps`).
      params: parameters this device updates per step.
      cluster: a `Cluster` (`update_bandwidth` where calibrated, else `memory_bandwidth_gbps`).
      optimizer: price this optimizer type instead of the config's (`optimizer_section`).
      phase: as for `phase_weights`.
    """
    section = optimizer_section(config, optimizer)
    key = json.dumps(section.model_dump(mode="json"), sort_keys=True)
    rates = getattr(cluster, "update_bandwidth", None)
    seconds = 0.0
    for name, share in phase_weights(section, config.steps, phase).items():
        gbps = cluster.memory_bandwidth_gbps if rates is None else (
            rates.compressed_gbps if name in COMPRESSING_PHASES else rates.plain_gbps)
        nbytes = bytes_per_param(key, float(config.gradient_clipping or 0.0), name)
        seconds += share * nbytes * params / (gbps * 1e9)
    return seconds
