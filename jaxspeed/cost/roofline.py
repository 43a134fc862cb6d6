"""A compiled GPU program's step time at a roofline per op, before step 0.

The model, for optimized HLO text (`compiled.as_text()`, deviceless included: there XLA's
`cost_analysis()` is None, so the text is read with `jaxspeed.cost.hlo`):

- Each top-level op (a fusion, a library call, an unfused instruction; not the inside of a
  fusion) takes `max(flops / peak(dtype), bytes / hbm_bandwidth)`. `bytes` are its operands
  and its result (`jaxspeed.cost.flops` counts them; an in-place update its update only,
  cuBLAS's workspace not at all). `flops` are its matmuls': the `dot`s it fuses, a cuBLAS /
  cuBLASLt gemm, a cuDNN fused attention (2 matmuls forward, 5 backward, half of them under
  a causal mask), or what a Pallas kernel declares (`pl.CostEstimate`, which Mosaic GPU keeps
  in its custom call; a kernel that declares none is priced by its bytes alone). The peak follows the operands: FP8 (`f8e4m3fn`, `f8e5m2`) at the FP8 peak,
  fp32 at TF32 (XLA's default precision), else bf16 (`jaxspeed.cost.peaks.GPU_PEAKS`).
- A collective takes its bytes (`jaxspeed.cost.hlo.collectives`; an all-reduce twice, as a
  ring sends its buffer out and back) over the GPU's NVLink rate, one direction.
- The step is the sum over the program: a `while` body times its trip count (once where XLA
  does not know it, as for `attention.impl: blocked`'s causal loops: `unknown_trip_loops`
  counts them, and the prediction is then a lower bound), every branch of
  a conditional (an upper bound), ops one after another (no overlap of collectives with
  compute, no concurrent kernels), no launch gaps.

Assumptions that make it optimistic: every matmul at `efficiency` x peak, every other op at the
full HBM bandwidth, no launch overhead. Pessimistic: nothing overlaps. `efficiency` is the one
calibrated factor (`MATMUL_EFFICIENCY`, from the two H200 measurements in
`benchmarks/README.md`); 1.0 is the raw roofline.
"""

from __future__ import annotations

import dataclasses
import re

from jaxspeed.cost.flops import bytes_moved, fused_dots
from jaxspeed.cost.hlo import (
    Dot, Instruction, array_bytes, callees, collective_kind, collectives, custom_call_target,
    operands, parse, parse_gemm, trip_count,
)
from jaxspeed.cost.peaks import GpuPeaks

#: Achievable fraction of the matmul peak, calibrated on the H200 steps of `gpu_engine` and
#: `gpu_offload` (benchmarks/README.md, "The roofline's error"); 1.0 is the raw roofline.
MATMUL_EFFICIENCY = 0.43
#: Ops that are bookkeeping or control flow (their bodies are priced where they run), or the
#: second half of an async pair (the start is priced).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
         "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
         "async-start", "async-update", "async-done", "copy-start", "copy-done",
         "send", "send-done", "recv", "recv-done"}
_FP8 = re.compile(r"^f8e\d")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
#: The FLOPs a Pallas kernel declares (`pl.CostEstimate`), which Mosaic GPU writes into its
#: custom call's backend config as JSON with escaped quotes: `cost_estimate_json = "{\22flops\22: N`.
_DECLARED_FLOPS = re.compile(r'cost_estimate_json = "\{\\22flops\\22: (\d+)')


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One top-level op of the program at its roofline, per execution."""

    name: str  #: the HLO instruction, e.g. "gemm_fusion_dot.20"
    kind: str  #: "matmul", "attention", "collective" or the op ("fusion", "custom-call", ...)
    flops: float
    bytes: float
    seconds: float
    bound: str  #: "compute", "memory" or "link"
    executions: int  #: per step: loop trip counts multiplied
    source: str  #: the jax op it came from (`metadata.op_name`), "" when XLA names none

    @property
    def total_seconds(self) -> float:
        return self.seconds * self.executions


def matmul_peak(dot: Dot, peaks: GpuPeaks) -> float:
    """FLOP/s of a matmul on `peaks`' GPU by its operand types: FP8 where both are FP8 (one is
    enough for cuBLASLt's mixed e4m3 x e5m2), TF32 where one is fp32, else bf16."""
    lhs, rhs, _ = dot.dtypes
    if peaks.fp8 and (_FP8.match(lhs) or _FP8.match(rhs)):
        return peaks.fp8
    return peaks.tf32 if "f32" in (lhs, rhs) else peaks.bf16


def attention_flops(ins: Instruction, types: dict[str, str]) -> float:
    """FLOPs of a cuDNN fused attention custom call from its first matmul (Q·Kᵀ, `bmm1`):
    forward Q·Kᵀ and P·V (2x); backward recomputes Q·Kᵀ and runs dV, dP, dQ, dK (5x); a causal
    mask (`mask_type` CAUSAL) halves it, as FlashAttention's kernels skip the masked blocks."""
    bmm1 = parse_gemm(ins, types)
    if bmm1 is None:
        return 0.0
    target = custom_call_target(ins) or ""
    flops = bmm1.flops * (5 if "Backward" in target else 2)
    return flops / 2 if re.search(r'"mask_type":"CAUSAL', ins.tail) else flops


def _split_tuple(type_text: str) -> list[str]:
    """'((a, b), c[2], u32[])' → ['(a, b)', 'c[2]', 'u32[]']: a tuple type's elements."""
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(type_text):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(type_text[start:i].strip())
            start = i + 1
    return parts


def op_bytes(ins: Instruction, own: dict[str, list[Instruction]], types: dict[str, str]) -> int:
    """What an op reads and writes in device memory. As `jaxspeed.cost.flops.bytes_moved`
    (operands and result; an in-place update its update only), and further: a fusion reads
    only the slices its `dynamic-slice`s take of an operand (a scanned layer's weights, not the
    whole stack), a fusion whose root is a `dynamic-update-slice` writes only its update in
    place, an async `fusion-start` counts as its fusion, a library call's scratch workspace
    (the tuple's later elements) is not counted."""
    if ins.op == "dynamic-slice":
        return 2 * sum(array_bytes(ins.type_text))
    if custom_call_target(ins) and ins.type_text.startswith("("):
        return bytes_moved(ins._replace(type_text=_split_tuple(ins.type_text)[0]), own, types)
    body = next((own.get(c, []) for role, c in callees(ins) if role == "calls"), [])
    if ins.op not in ("fusion", "fusion-start") or not body:
        return bytes_moved(ins, own, types)
    result = _split_tuple(ins.type_text)[1] if ins.op == "fusion-start" else ins.type_text
    names = operands(ins)
    users: dict[str, list[Instruction]] = {}
    for inner in body:
        for name in operands(inner):
            users.setdefault(name, []).append(inner)
    root = body[-1]
    in_place = root.op == "dynamic-update-slice"
    inner_types = {i.name: i.type_text for i in body}
    total = sum(array_bytes(inner_types.get(operands(root)[1], ""))) if in_place else sum(
        array_bytes(result))
    for param in (i for i in body if i.op == "parameter"):
        index = int(re.search(r"parameter\((\d+)\)", param.tail).group(1))
        uses = users.get(param.name, [])
        if in_place and uses == [root] and operands(root)[0] == param.name:
            continue  # the buffer updated in place
        if uses and all(u.op == "dynamic-slice" and operands(u)[0] == param.name for u in uses):
            total += sum(sum(array_bytes(u.type_text)) for u in uses)
        elif index < len(names):
            total += sum(array_bytes(types.get(names[index], "")))
    return total


def price_op(ins: Instruction, own: dict[str, list[Instruction]], types: dict[str, str],
             peaks: GpuPeaks, hbm: float, efficiency: float = MATMUL_EFFICIENCY) -> OpCost:
    """One op (not a collective) at its roofline on a GPU of `peaks` and `hbm` bytes/s."""
    target = custom_call_target(ins) or ""
    declared = _DECLARED_FLOPS.search(ins.tail) if target else None
    if target.startswith("__cudnn$fmha"):
        kind, flops, rate = "attention", attention_flops(ins, types), peaks.bf16
    elif declared:  # a Pallas kernel's own count (16-bit operands: jaxspeed's kernels)
        kind, flops, rate = "kernel", float(declared.group(1)), peaks.bf16
    else:
        gemm = parse_gemm(ins, types)
        found = [gemm] if gemm is not None else fused_dots(ins, own, types)
        flops = sum(dot.flops for dot in found)
        kind = "matmul" if found else ins.op
        # the FLOP-weighted peak of the op's matmuls (one, nearly always)
        rate = flops / sum(d.flops / matmul_peak(d, peaks) for d in found) if flops else peaks.bf16
    moved = op_bytes(ins, own, types)
    compute, memory = flops / (rate * efficiency), moved / hbm
    source = _OP_NAME.search(ins.tail)
    return OpCost(ins.name, kind, flops, moved, max(compute, memory),
                  "compute" if compute >= memory else "memory", 1,
                  source.group(1) if source else "")


def op_costs(hlo_text: str, *, peaks: GpuPeaks, hbm: float, num_devices: int = 1,
             efficiency: float = MATMUL_EFFICIENCY) -> list[OpCost]:
    """Every top-level op one step runs, at its roofline, with its executions per step.

    Args:
      hlo_text: the optimized HLO of the step (one device's program).
      peaks: the GPU's FLOP/s and NVLink rate (`jaxspeed.cost.peaks.gpu_peaks`).
      hbm: the GPU's memory bandwidth, bytes/s.
      num_devices: devices of the program (for collectives without explicit groups).
      efficiency: the fraction of the matmul peak matmuls reach.
    """
    own, executions, _ = parse(hlo_text)
    fused = {c for instructions in own.values() for ins in instructions if ins.op == "fusion"
             for role, c in callees(ins) if role == "calls"}
    found = []
    for computation, instructions in own.items():
        runs = executions.get(computation, 0)
        if not runs or computation in fused:
            continue
        types = {ins.name: ins.type_text for ins in instructions}
        for ins in instructions:
            if ins.op in _FREE or collective_kind(ins.op) or ins.op.endswith("-done"):
                continue
            cost = price_op(ins, own, types, peaks, hbm, efficiency)
            found.append(dataclasses.replace(cost, executions=runs))
    for op in collectives(hlo_text, num_devices=num_devices):
        moved = op.bytes * (2 if op.kind == "all-reduce" else 1)
        found.append(OpCost(op.name, "collective", 0.0, float(op.bytes), moved / peaks.link,
                            "link", op.executions, op.kind))
    return found


def predict(hlo_text: str, *, peaks: GpuPeaks, hbm: float, model_flops: float,
            num_devices: int = 1, efficiency: float = MATMUL_EFFICIENCY, top: int = 10) -> dict:
    """The predicted step time of a compiled program, its MFU and HFU, and its costliest ops.

    Args:
      hlo_text, peaks, hbm, num_devices, efficiency: as `op_costs` takes them.
      model_flops: model FLOPs of one step per device (`jaxspeed.cost.flops.model_train_flops`
        over the devices): 6·N plus causal attention per token, no recomputation.
      top: how many of the costliest ops to list.

    Returns:
      `predicted_step_seconds`; `predicted_mfu` (model FLOPs over the step at the bf16 peak);
      `predicted_hfu` (the matmul FLOPs found in the program, recomputation included, likewise);
      the seconds bound by compute, memory and links; the program's FLOPs and bytes; `top_ops`
      (name, kind, bound, seconds per step, the jax op); `unknown_trip_loops`, the `while`
      loops whose trip count XLA does not know (each priced as one trip: then the prediction
      is a lower bound); and the model's figures.
    """
    ops = op_costs(hlo_text, peaks=peaks, hbm=hbm, num_devices=num_devices, efficiency=efficiency)
    own, executions, _ = parse(hlo_text)
    unknown_trips = sum(1 for computation, instructions in own.items()
                        if executions.get(computation) for ins in instructions
                        if ins.op == "while" and trip_count(ins) is None)
    seconds = sum(op.total_seconds for op in ops)
    bound = {b: sum(op.total_seconds for op in ops if op.bound == b)
             for b in ("compute", "memory", "link")}
    flops = sum(op.flops * op.executions for op in ops)
    costliest = sorted(ops, key=lambda op: -op.total_seconds)[:top]
    return {
        "predicted_step_seconds": seconds,
        "predicted_mfu": model_flops / seconds / peaks.bf16 if seconds else None,
        "predicted_hfu": flops / seconds / peaks.bf16 if seconds else None,
        "seconds_by_bound": bound,
        "program_flops": flops,
        "model_flops": model_flops,
        "bytes": sum(op.bytes * op.executions for op in ops if op.kind != "collective"),
        "ops": len(ops),
        "unknown_trip_loops": unknown_trips,
        "top_ops": [{"name": op.name, "kind": op.kind, "bound": op.bound,
                     "seconds": op.total_seconds, "executions": op.executions,
                     "source": op.source} for op in costliest],
        "peak_bf16_flops": peaks.bf16, "hbm_bytes_per_s": hbm, "matmul_efficiency": efficiency,
    }
