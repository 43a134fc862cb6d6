"""The text `jaxspeed plan` prints: memory per device, step cost, and the fit verdict."""

from __future__ import annotations

from typing import Any, TypedDict

from jaxspeed.cost.memory import COMPILED, MemoryReport
from jaxspeed.cost.hlo import COLLECTIVES
from jaxspeed.sharding.explain import format_bytes


class ProfileReport(TypedDict):
    """`Engine.profile()`: FLOPs, peak and collective bytes of one compiled train step
    (`jaxspeed.cost.flops.step_profile`)."""

    flops: int  #: global matmul FLOPs of the step (`jaxpr_flops`: loops counted)
    flops_per_device: float
    xla_flops_per_device: float  #: XLA's `cost_analysis()` (a loop body counted once)
    peak_flops_per_device: float | None  #: None when the device's peak is not known
    device_kind: str
    collective_bytes: dict[str, int]  #: per collective kind and `total`, per device
    #: the part of `collective_bytes` in collectives whose device groups span hosts
    cross_host_bytes: dict[str, int]
    #: messages the busiest device sends across hosts, all-to-all and collective-permute
    cross_host_messages: dict[str, int]


def _fmt(value) -> str:
    return "" if value is None else format_bytes(value)


#: Labels of the `device_model` rows (`jaxspeed.cost.memory`), indented under the device row.
DEVICE_MODEL_ROWS = {
    "compiled_total": "    = total",
    "host_state": "    - host-resident state",
    "fetched": "    + fetched for compute",
    "update": "    + fetched for the update",
    "streamed_grads": "    - streamed grads in host memory",
}
#: Printed under the memory table: what each value of the source column means.
SOURCE_LEGEND = (
    "source: compiled-gpu / compiled-cpu = read from XLA:GPU's / XLA:CPU's memory_analysis() of "
    "the compiled step; arrays = "
    "summed from the state's shardings and memory kinds (the estimate column always is); "
    "model = jaxspeed's arithmetic, not measured by XLA"
)


#: Printed first for `plan --target`: what a deviceless GPU compile is and is not.
TARGET_LINE = (
    "compiled for {devices} x {device_kind} without a GPU (source: compiled-gpu): the memory "
    "and the program are XLA:GPU's; nothing was autotuned, run or timed"
)


def format_memory(report: MemoryReport) -> list[str]:
    """The memory table: the estimate (arrays), the step's figure and where that figure is from."""
    est, comp, per = report["estimate"], report["compiled"], report["per_device_bytes"]
    compiled = report["source"]  # which compiler's analysis: compiled-gpu or compiled-cpu

    def label(source: str) -> str:
        return compiled if source == COMPILED else source

    src = {name: label(source) for name, source in report["sources"].items()}
    rows = [
        ("params", est["params"], None, src["params"]),
        ("grads", est["grads"], None, src["grads"]),
        ("opt_state", est["opt_state"], None, src["opt_state"]),
        ("arguments (state + batch)", None, comp["argument"], compiled),
        ("outputs", None, comp["output"], compiled),
        ("aliased (donated)", None, -comp["alias"], compiled),
        ("temp (activations, grads, buffers)", None, per["temp"], src["temp"]),
        ("total", est["state_total"], per["total"], src["total"]),
        ("  of which in host memory", est["host"], per["host"], src["host"]),
        ("  device memory needed", None, per["device"], src["device"]),
    ]
    rows += [
        (DEVICE_MODEL_ROWS[row["term"]], None, row["bytes"], label(row["source"]))
        for row in report["device_model"]
        if row["bytes"] or row["term"] in ("compiled_total", "host_state")
    ]
    lines = [f"{'per device':36s} {'estimate':>12s} {'step':>12s}  source"]
    lines += [f"{name:36s} {_fmt(e):>12s} {_fmt(c):>12s}  {s}" for name, e, c, s in rows]
    lines.append(SOURCE_LEGEND)
    lines += [f"note: {note}" for note in report["notes"]]
    return lines


def format_profile(profile: ProfileReport) -> list[str]:
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
    across = profile.get("cross_host_bytes") or {"total": 0}
    if across["total"]:
        lines.append("  of which in collectives across hosts:")
        messages = profile.get("cross_host_messages") or {}
        lines += [f"    {kind:32s} {format_bytes(across[kind]):>12s}"
                  + (f" in {messages[kind]} messages" if messages.get(kind) else "")
                  for kind in COLLECTIVES if across[kind]]
    return lines


def format_plan(report: dict[str, Any]) -> str:
    """The memory table, the step profile and, when a device memory is known, the verdict."""
    lines = format_memory(report) + [""] + format_profile(report["profile"])
    target = report.get("target")
    if target is not None:
        lines = [TARGET_LINE.format(**target), ""] + lines
    if report.get("fit") is not None:
        lines += ["", report["fit"]["message"]]
        source = report["sources"]["device"]
        if source != COMPILED:
            lines.append(f"(the verdict compares device memory needed, source: {source})")
    return "\n".join(lines)


def format_roofline(report: dict[str, Any]) -> list[str]:
    """The predicted step of `plan --target` (`jaxspeed.cost.roofline.predict`): its time,
    MFU and HFU, and its costliest ops."""
    mfu, hfu = report["predicted_mfu"], report["predicted_hfu"]
    by = report["seconds_by_bound"]
    lines = [
        f"predicted step {report['predicted_step_seconds'] * 1e3:.1f} ms (roofline per op, "
        f"matmuls at {report['matmul_efficiency']:.0%} of peak): "
        f"MFU {mfu:.1%} (model FLOPs), HFU {hfu:.1%} (the program's matmul FLOPs, recomputation "
        f"included), both against the dense bf16 peak "
        f"{report['peak_bf16_flops'] / 1e12:.0f} TFLOP/s",
        f"  compute-bound {by['compute'] * 1e3:.1f} ms, memory-bound {by['memory'] * 1e3:.1f} ms, "
        f"collectives {by['link'] * 1e3:.1f} ms",
        "  costliest ops (ms per step, x executions):",
    ]
    if report.get("unknown_trip_loops"):
        lines.insert(2, f"  {report['unknown_trip_loops']} while loops of unknown trip count are "
                        "priced at one trip each: the prediction is a lower bound")
    lines += [f"    {op['seconds'] * 1e3:8.2f}  x{op['executions']:<4d} {op['kind']:10s} "
              f"{op['bound']:7s} {op['name']}  {op['source'][-60:]}"
              for op in report["top_ops"]]
    return lines
