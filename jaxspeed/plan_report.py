"""The text `jaxspeed plan` prints: memory per device, step cost, and the fit verdict."""

from __future__ import annotations

from typing import Any

from jaxspeed.profiler import COLLECTIVES
from jaxspeed.sharding.explain import format_bytes


def _fmt(value) -> str:
    return "" if value is None else format_bytes(value)


def format_memory(report: dict[str, Any]) -> list[str]:
    est, comp, per = report["estimate"], report["compiled"], report["per_device_bytes"]
    rows = [
        ("params", est["params"], None),
        ("grads", est["grads"], None),
        ("opt_state", est["opt_state"], None),
        ("arguments (state + batch)", None, comp["argument"]),
        ("outputs", None, comp["output"]),
        ("aliased (donated)", None, -comp["alias"]),
        ("temp (activations, grads, buffers)", None, comp["temp"]),
        ("total", est["state_total"], per["total"]),
        ("  of which in host memory", est["host"], per["host"]),
        ("  device memory needed", None, per["device"]),
    ]
    lines = [f"{'per device':36s} {'estimate':>12s} {'compiled':>12s}"]
    lines += [f"{name:36s} {_fmt(e):>12s} {_fmt(c):>12s}" for name, e, c in rows]
    lines += [f"note: {note}" for note in report.get("notes", [])]
    return lines


def format_profile(profile: dict[str, Any]) -> list[str]:
    lines = [
        f"step FLOPs (matmul, all devices)    {profile['flops']:.3e}",
        f"step FLOPs per device               {profile['flops_per_device']:.3e}",
    ]
    peak = profile["peak_flops_per_device"]
    if peak:
        lines.append(
            f"{profile['device_kind']} peak {peak / 1e12:.0f} TFLOP/s: "
            f"step takes >= {profile['flops_per_device'] / peak * 1e3:.2f} ms at 100% MFU"
        )
    lines.append("collective bytes per device per step:")
    moved = profile["collective_bytes"]
    lines += [
        f"  {kind:34s} {format_bytes(moved[kind]):>12s}" for kind in COLLECTIVES if moved[kind]
    ]
    if not moved["total"]:
        lines.append("  (none)")
    return lines


def format_plan(report: dict[str, Any]) -> str:
    """The memory table, the step profile and, when a device memory is known, the verdict."""
    lines = format_memory(report) + [""] + format_profile(report["profile"])
    if report.get("fit") is not None:
        lines += ["", report["fit"]["message"]]
    return "\n".join(lines)
