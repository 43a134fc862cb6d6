"""What one run of a compiled program computes and moves: its matmul FLOPs (from the jaxpr
or from XLA's cost analysis), its memory traffic, and its time at a roofline per instruction.

`memory_traffic` and `roofline_seconds` walk the optimized HLO text as `jaxspeed.cost.hlo`
parses it; `step_profile` gathers a compiled step's FLOPs, its device's peak
(`jaxspeed.cost.peaks`) and its collective bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from jaxspeed.cost.hlo import (
    Dot, Instruction, array_bytes, branches, callees, collective_bytes, collective_kind,
    operands, parse, parse_dot, to_apply, trip_count,
)
from jaxspeed.cost.cross_host import cross_host_bytes, cross_host_messages
from jaxspeed.cost.peaks import peak_flops
from jaxspeed.cost.plan_table import ProfileReport

#: Instructions that move no data of their own (views, bookkeeping, control flow whose bodies
#: are counted where they run).
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
               "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier"}


def _updates_in_place(ins: Instruction, own: dict[str, list[Instruction]]) -> bool:
    """A dynamic-update-slice, or a fusion whose result is one: XLA writes the update into
    the buffer it was given."""
    if ins.op == "dynamic-update-slice":
        return True
    if ins.op != "fusion":
        return False
    body = next((c for role, c in callees(ins) if role == "calls"), None)
    return bool(own.get(body)) and own[body][-1].op == "dynamic-update-slice"


#: What `_fold` asks of an instruction: (instruction, every computation's instructions, its own
#: computation's result types by instruction name) → a tuple of figures.
_Cost = Callable[[Instruction, dict[str, list[Instruction]], dict[str, str]], tuple[float, ...]]


def _fold(hlo_text: str, cost: _Cost) -> tuple[float, ...]:
    """`cost` summed over every instruction one run of the program executes, from optimized
    HLO text: a loop body once per iteration (when XLA knows the trip count), the costliest
    branch of a conditional (one runs; costliest by the sum of its figures), a `call`'s body
    where it is called. Control flow and bookkeeping (`_NO_TRAFFIC`) cost nothing themselves."""
    own, _, entry = parse(hlo_text)
    memo: dict[str, tuple[float, ...]] = {}

    def total(computation: str, depth: int = 0) -> tuple[float, ...]:
        if computation in memo or depth > 64:
            return memo.get(computation, ())
        instructions = own.get(computation, [])
        types = {ins.name: ins.type_text for ins in instructions}
        parts: list[tuple[float, ...]] = []
        for ins in instructions:
            if ins.op == "while":
                trips = trip_count(ins)
                body = _add(*(total(c, depth + 1) for role, c in callees(ins)))
                parts.append(tuple((trips if trips is not None else 1) * x for x in body))
            elif ins.op == "conditional":
                taken = branches(ins) + [c for role, c in callees(ins)]
                parts.append(max((total(c, depth + 1) for c in taken), key=sum, default=()))
            elif ins.op == "call":
                parts += [total(c, depth + 1) for c in to_apply(ins)]
            elif ins.op not in _NO_TRAFFIC:
                parts.append(cost(ins, own, types))
        memo[computation] = _add(*parts)
        return memo[computation]

    return total(entry) if entry is not None else ()


def _add(*parts: tuple[float, ...]) -> tuple[float, ...]:
    """Element-wise sum of tuples (a shorter one counts as zeros)."""
    width = max(map(len, parts), default=0)
    return tuple(sum(p[i] for p in parts if i < len(p)) for i in range(width))


def bytes_moved(ins: Instruction, own: dict[str, list[Instruction]], types: dict[str, str]) -> int:
    """What an instruction reads and writes in device memory: its operands and its result (a
    fusion's inside stays in registers and cache), or for an in-place update its update only."""
    result = sum(array_bytes(ins.type_text))
    read = [sum(array_bytes(types.get(o, ""))) for o in operands(ins)]
    if _updates_in_place(ins, own):
        return 2 * sum(n for n in read if n != result)
    return result + sum(read)


def memory_traffic(hlo_text: str) -> int:
    """Bytes one run of the program reads and writes in device memory, from optimized HLO text.

    Each instruction outside a fusion reads its operands and writes its result (a fusion's
    inside stays in registers and cache), as XLA's `cost_analysis()["bytes accessed"]` counts;
    unlike it, a loop body counts once per iteration, and a conditional counts its costliest
    branch (one runs).
    """
    return int(sum(_fold(hlo_text, lambda ins, own, types: (bytes_moved(ins, own, types),))))


def fused_dots(ins: Instruction, own: dict[str, list[Instruction]], types: dict[str, str], depth: int = 0) -> list[Dot]:
    """The `dot`s an instruction runs: itself if it is one, else those its fusion calls (nested
    fusions included). `types`: the result types of the instruction's computation by name."""
    if ins.op == "dot":
        dot = parse_dot(ins, types)
        return [dot] if dot is not None else []
    found = []
    for role, callee in callees(ins) if ins.op == "fusion" and depth < 16 else ():
        body = own.get(callee, []) if role == "calls" else []
        inner = {i.name: i.type_text for i in body}
        found += [dot for i in body for dot in fused_dots(i, own, inner, depth + 1)]
    return found


def _matmul_flops(ins: Instruction, own: dict[str, list[Instruction]], types: dict[str, str]) -> int:
    """FLOPs of a `dot` (2 x output elements x contracted size), or of the dots a fusion calls."""
    return sum(dot.flops for dot in fused_dots(ins, own, types))


def roofline_seconds(hlo_text: str, *, flops_per_s: float, bytes_per_s: float) -> dict[str, float]:
    """The program's time on a device that runs one instruction at a time, each at its own
    roofline: the longer of its matmul FLOPs at `flops_per_s` and its memory traffic (as
    `memory_traffic` counts it) at `bytes_per_s`. Collectives are left out: they are costed
    on their links (`jaxspeed.autoplan.comm`).

    Summed per instruction, not taken for the program as a whole: a matmul-bound projection
    does not hide the memory-bound norm that runs after it.

    Returns:
      `{"compute": s, "memory": s, "flops": n}`: the seconds of the instructions bound by
      their FLOPs, of those bound by memory, and the matmul FLOPs found. Matmuls compiled to
      library calls (cuBLAS custom calls on GPU) are not seen; their FLOPs need counting apart.
    """
    def cost(ins, own, types):
        if collective_kind(ins.op):
            return (0.0, 0.0, 0.0)
        flops = _matmul_flops(ins, own, types)
        compute, memory = flops / flops_per_s, bytes_moved(ins, own, types) / bytes_per_s
        return (compute, 0.0, flops) if compute >= memory else (0.0, memory, flops)

    compute, memory, flops = _fold(hlo_text, cost) or (0.0, 0.0, 0.0)
    return {"compute": compute, "memory": memory, "flops": flops}


def compiled_flops(compiled) -> float:
    """FLOPs per device from `compiled.cost_analysis()` (0 when XLA gives none).

    XLA counts the body of a `while` loop once, whatever its trip count, so a scanned model
    or an accumulation loop is undercounted; `jaxpr_flops` does not have that problem.
    """
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


def _dot_flops(eqn) -> int:
    (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    out = math.prod(eqn.outvars[0].aval.shape)
    return 2 * out * math.prod(lhs[d] for d in lhs_contract)


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner


def _count_flops(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
        elif name == "ragged_dot":
            lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
            total += 2 * math.prod(lhs) * rhs[-1]
        elif name == "cond":
            total += max((_count_flops(j) for j in _sub_jaxprs(eqn)), default=0)
        elif name == "shard_map":  # the body is one device's share: once per device it runs on
            sizes = eqn.params["mesh"].shape
            devices = math.prod(sizes[a] for a in eqn.params.get("newly_manual_axes", ()))
            total += devices * sum(_count_flops(j) for j in _sub_jaxprs(eqn))
        else:
            inner = sum(_count_flops(j) for j in _sub_jaxprs(eqn))
            total += inner * (eqn.params.get("length", 1) if name == "scan" else 1)
    return total


def jaxpr_flops(fn, *args) -> int:
    """Matmul FLOPs of `fn(*args)` for the whole (global) computation, loops included.

    Counts `dot_general` (2·M·N·K) and `ragged_dot`, multiplies `scan` bodies by their
    length and `shard_map` bodies (one device's share) by the devices along their manual axes
    (work a body repeats on replicated inputs counts on each device), takes the larger branch
    of a `cond`. Elementwise work is not counted, which is
    the usual convention for model FLOPs; rematerialised forward passes are counted.
    """
    import jax

    return _count_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def _ffn_matmul_params(d_model: int, d_ff: int, activation: str) -> int:
    """Weights of one FFN: up and down projections, and the gate under SwiGLU."""
    return (3 if activation == "swiglu" else 2) * d_model * d_ff


def expert_matmul_params(model: Any) -> int:
    """Weights of one routed expert of `model.moe` (its `d_ff` and activation, else the
    model's)."""
    moe = model.moe
    return _ffn_matmul_params(model.d_model, moe.d_ff or model.d_ff, moe.activation or model.mlp)


def layer_matmul_params(model: Any) -> int:
    """Weights one token meets in all the transformer layers (a MoE layer: its router and the
    `k` experts it picks, plus its shared and residual FFNs)."""
    d, heads = model.d_model, model.n_heads
    kv = (model.n_kv_heads or heads) * (d // heads)
    attention = 2 * d * d + 2 * d * kv  # q and out projections; k and v (grouped-query)
    dense_ffn = _ffn_matmul_params(d, model.d_ff, model.mlp)
    moe = getattr(model, "moe", None)
    if moe is None:
        return model.n_layers * (attention + dense_ffn)
    expert = expert_matmul_params(model)
    routed = d * moe.num_experts + (moe.k + moe.num_shared_experts) * expert
    if moe.use_residual:
        routed += expert + 2 * d  # PR-MoE's dense FFN and its mixing coefficient
    n_moe = model.n_layers // moe.every_n_layers
    return model.n_layers * attention + n_moe * routed + (model.n_layers - n_moe) * dense_ffn


def model_train_flops(model: Any | None, *, tokens: int, seq_len: int, param_count: int) -> float:
    """Model FLOPs of training on `tokens` tokens (forward and backward), for MFU.

    The count of PaLM (Chowdhery et al. 2022, App. B) and Megatron-LM (Narayanan et al. 2021,
    App.), with attention halved by the causal mask as MaxText's
    `calculate_tflops_training_per_device` and FlashAttention's benchmarks count it:

        per token: 6·N + 12·L·d_attn·K

    N: weights of the matmuls a token goes through (attention and FFN projections, a MoE
    layer's router and its `k` chosen experts, and the `d_model × vocab` output head; not the
    embedding lookup, norms or biases); L layers; d_attn = n_heads · head size; K the keys a
    query attends on average: `seq_len / 2` under the causal mask, about `w - w²/(2·seq_len)`
    with a sliding window w (so `6·L·d_attn·seq_len` when causal: PaLM's `12·L·H·Q·T`,
    halved). Block-sparse attention layouts are counted as dense. Recomputed forward passes
    (remat) are not model FLOPs: that is the difference between MFU and HFU.

    Args:
      model: the reference GPT's `ModelConfig`, or None for another model: then `6·param_count`
        per token (Kaplan et al. 2020's C ≈ 6·N·D, without an attention term).
      tokens: tokens trained on (global batch × sequence length × steps).
      seq_len: the sequence length the attention spans.
      param_count: the model's parameters (used only when `model` is None).
    """
    if model is None:
        return 6.0 * param_count * tokens
    n = layer_matmul_params(model) + model.d_model * model.vocab_size
    window = getattr(model, "sliding_window", None)
    if window is None or window >= seq_len:
        keys = seq_len / 2
    else:
        keys = window - window**2 / (2 * seq_len)
    return (6.0 * n + 12.0 * model.n_layers * model.d_model * keys) * tokens


def step_profile(
    compiled, *, flops: int, num_devices: int, device_kind: str, peak_tflops: float | None = None,
    host_of: Sequence[int] | None = None,
) -> ProfileReport:
    """FLOPs, peak FLOP/s and collective bytes of one compiled step.

    Args:
      compiled: the compiled step.
      flops: global matmul FLOPs of the step (`jaxpr_flops`).
      num_devices: devices the step runs on.
      device_kind: `jax.Device.device_kind`, for the peak table.
      peak_tflops: the device's peak from config, overriding the table.
      host_of: the host of each device in mesh order (None: one host), for the bytes of the
        collectives that cross hosts.
    """
    text = compiled.as_text()
    return {
        "flops": flops,
        "flops_per_device": flops / num_devices,
        "xla_flops_per_device": compiled_flops(compiled),
        "peak_flops_per_device": peak_flops(device_kind, peak_tflops),
        "device_kind": device_kind,
        "collective_bytes": collective_bytes(text, num_devices=num_devices),
        "cross_host_bytes": cross_host_bytes(
            text, num_devices=num_devices, host_of=host_of or [0] * num_devices),
        "cross_host_messages": cross_host_messages(
            text, num_devices=num_devices, host_of=host_of or [0] * num_devices),
    }
