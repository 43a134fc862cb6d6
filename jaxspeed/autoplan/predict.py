"""The predicted step of a config as given on a cluster: what `plan --cluster --json` reports
as `predicted`, and what the 1-bit variant of its optimizer would change.

Both are the analytic model (`estimate`): the compute at the cluster's calibrated rate, the
step's collectives from the byte model (`traffic`) on the cluster's links with its collective
algorithms (`comm`), no overlap between them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspeed.autoplan import traffic
from jaxspeed.autoplan.estimate import Estimate, estimate
from jaxspeed.autoplan.space import Candidate, from_config
from jaxspeed.config.optimizer import ONEBIT_TYPES

#: The keys of `predicted` that every `plan --cluster --json` has (seconds, tokens/s, bytes).
PREDICTED_KEYS = ("step_seconds", "tokens_per_second", "cross_host_bytes", "compute_seconds",
                  "comm_seconds")


def predicted(est: Estimate, *, cluster: Any, phase: str) -> dict[str, Any]:
    """`est` as the `predicted` JSON object (`PREDICTED_KEYS` first, then the details)."""
    return {
        "step_seconds": est.step_s,
        "tokens_per_second": est.tokens_per_second,
        "cross_host_bytes": est.cross_host_bytes,
        "compute_seconds": est.compute_s,
        "comm_seconds": est.comm_s,
        "host_seconds": est.host_s,
        "comm_seconds_by_kind": est.comm_by_kind,
        "cluster": cluster.name,
        "collectives": getattr(cluster, "collectives", "nccl"),
        "phase": phase,
        "byte_model": "jaxspeed.autoplan.traffic",
    }


def predict(config: Any, mesh_shape: dict[str, int], cluster: Any) -> dict[str, Any]:
    """The predicted step of `config` as given, on a mesh of `mesh_shape` (axis → size, `host`
    included), on `cluster`: `PREDICTED_KEYS` and details (`predicted`).

    A 1-bit optimizer is priced in the phase a run of `config.steps` ends in
    (`traffic.exchange_fractions`).
    """
    plan = from_config(config, mesh_shape)
    phase = _phase_name(config)
    return predicted(estimate(config, plan, cluster), cluster=cluster, phase=phase)


def _phase_name(config: Any) -> str:
    if config.optimizer.type not in ONEBIT_TYPES:
        return "every step"
    full, onebit = traffic.exchange_fractions(config, config.optimizer.type)
    return ("compressed" if not full else "warm-up" if not onebit
            else f"{full:.2f} full + {onebit:.2f} 1-bit exchanges per step")


def onebit_alternatives(config: Any, plan: Candidate, cluster: Any) -> list[dict[str, Any]]:
    """What each 1-bit variant of `config`'s Adam-family optimizer would do to `plan`'s step,
    after its freeze (priced at ZeRO-0, which the 1-bit optimizers need); empty for other
    optimizers. The optimizer is never changed: this is a report.
    """
    variants = traffic.ONEBIT_VARIANTS.get(config.optimizer.type, ())
    if not variants:
        return []
    base = estimate(config, plan, cluster)
    stage0 = dataclasses.replace(plan, stage=0, offload="none", quantized_weights=False,
                                 quantized_gradients=False, hpz=False)
    out = []
    for variant in variants:
        est = estimate(config, stage0, cluster, optimizer=variant, phase="compressed")
        out.append({
            "optimizer": variant, "zero_stage": 0, "step_seconds": est.step_s,
            "tokens_per_second": est.tokens_per_second, "comm_seconds": est.comm_s,
            "cross_host_bytes": est.cross_host_bytes,
            "base_step_seconds": base.step_s,  # the plan's own step, analytic as well
            "speedup": base.step_s / est.step_s if est.step_s else 0.0,
            "device_bytes": est.device_bytes,
        })
    return out


def format_predicted(pred: dict[str, Any]) -> list[str]:
    """The text lines `plan --cluster` prints for `predicted`."""
    return [
        f"predicted on cluster {pred['cluster']} (collectives: {pred['collectives']}; "
        f"1-bit phase: {pred['phase']}; no overlap of compute and communication):",
        f"  step {_s(pred['step_seconds'])} = compute {_s(pred['compute_seconds'])} "
        f"+ communication {_s(pred['comm_seconds'])}"
        + (f" + host copies {_s(pred['host_seconds'])}" if pred["host_seconds"] else ""),
        f"  tokens/s {pred['tokens_per_second']:,.0f}",
        f"  cross-host bytes per step (what the busiest host sends to others): "
        f"{pred['cross_host_bytes'] / 2**20:,.2f} MiB",
    ]


def _s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"
