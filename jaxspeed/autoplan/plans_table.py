"""What `plan --auto` prints and writes: the table of the best plans, and the winner's config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from jaxspeed.autoplan.search import Ranked
from jaxspeed.autoplan.space import apply
from jaxspeed.config import Config
from jaxspeed.sharding.explain import format_bytes

_HEADER = ("#", "mesh", "zero", "zero++", "remat", "micro x accum", "schedule", "offload",
           "memory/device", "step", "tokens/s", "cross-host/step", "MFU", "HFU", "bound", "source")


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def rows(ranked: list[Ranked]) -> list[tuple[str, ...]]:
    out = []
    for i, r in enumerate(ranked, 1):
        p = r.plan
        mesh = " ".join(f"{a}={n}" for a, n in p.mesh if n > 1) or "1 device"
        zeropp = "+".join(n for n, on in (("qwZ", p.quantized_weights), ("qgZ", p.quantized_gradients),
                                          ("hpZ", p.hpz)) if on) or "-"
        out.append((str(i), mesh, str(p.stage), zeropp, p.remat, f"{p.micro_batch} x {p.accumulation}",
                    p.schedule or "-", p.offload, format_bytes(r.device_bytes), _seconds(r.step_s),
                    f"{r.tokens_per_s:,.0f}", format_bytes(int(r.analytic.cross_host_bytes)),
                    f"{r.mfu:.1%}", f"{r.hfu:.1%}", r.bound, r.source))
    return out


def format_table(ranked: list[Ranked], cluster: Any) -> str:
    """The top plans as an aligned text table, with the cluster and the model's assumptions."""
    table = [_HEADER, *rows(ranked)]
    widths = [max(len(row[i]) for row in table) for i in range(len(_HEADER))]
    lines = [
        f"cluster {cluster.name}: {cluster.hosts} x {cluster.devices_per_host} devices, "
        f"{format_bytes(cluster.device_memory_bytes)} each; efficiency {cluster.efficiency:.2f} of peak; "
        "communication not overlapped with compute (the model's one stated assumption); "
        "MFU: model FLOPs (6N + causal attention per token), HFU: the FLOPs the step runs "
        "(remat's recomputation included), both per device over the step and the peak",
    ]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(lines)


def to_dict(ranked: Ranked) -> dict[str, Any]:
    return {"plan": ranked.plan.describe(), "overrides": ranked.plan.overrides(),
            "device_bytes": ranked.device_bytes, "step_s": ranked.step_s,
            "tokens_per_s": ranked.tokens_per_s, "mfu": ranked.mfu, "hfu": ranked.hfu,
            "bound": ranked.bound,
            "source": ranked.source, "analytic_step_s": ranked.analytic.step_s,
            "analytic_comm_s": ranked.analytic.comm_by_kind,
            "cross_host_bytes": ranked.analytic.cross_host_bytes,
            "zeropp": {"zero_quantized_weights": ranked.plan.quantized_weights,
                       "zero_quantized_gradients": ranked.plan.quantized_gradients,
                       "hpz": ranked.plan.hpz}}


def format_alternatives(alternatives: list[dict[str, Any]], optimizer: str) -> list[str]:
    """Lines on what the 1-bit variants of `optimizer` would do to the best plan's step: each
    variant's analytic step against the best plan's analytic step (one basis: the table's
    step may be compiled, and is not compared)."""
    if not alternatives:
        return []
    base = alternatives[0]["base_step_seconds"]
    lines = [f"the config's optimizer ({optimizer}) is kept; its 1-bit variants after their "
             f"freeze, at ZeRO-0, analytic, against plan #1's analytic step "
             f"({_seconds(base)}; the table's step may be compiled):"]
    lines += [f"  {a['optimizer']:12s} {a['tokens_per_second']:>12,.0f} tokens/s  "
              f"step {_seconds(a['step_seconds'])}  {a['speedup']:.2f}x plan #1's analytic "
              f"step  cross-host {format_bytes(int(a['cross_host_bytes']))}/step"
              for a in alternatives]
    return lines


def write_config(config: Config, ranked: Ranked, cluster: Any, path: str | Path) -> Path:
    """Writes the winning plan as a config `jaxspeed train` runs as is (with the cluster's
    device memory, so that `plan` and `train` check the fit)."""
    chosen = apply(config, ranked.plan)
    raw = chosen.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["hardware"] = {**raw.get("hardware", {}), "device_memory": cluster.device_memory_bytes}
    path = Path(path)
    header = (f"# written by `jaxspeed plan --auto --cluster {cluster.name}`: {ranked.plan.describe()}\n"
              f"# predicted {_seconds(ranked.step_s)} per step, {ranked.tokens_per_s:,.0f} tokens/s "
              f"({ranked.source})\n")
    path.write_text(header + yaml.safe_dump(raw, sort_keys=False))
    return path
