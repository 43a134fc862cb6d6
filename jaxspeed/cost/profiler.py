"""What a compiled step costs: FLOPs, MFU, the bytes of each collective it runs, its memory
traffic, and its time at a roofline per instruction.

Everything here reads the compiled program, before step 0: `compiled.cost_analysis()` for FLOPs
and the optimized HLO text for collectives, traffic and the roofline.

Collective bytes are per device and per step, counted as the size of the full buffer each
collective works on: all-reduce and all-to-all their operand, all-gather its (gathered)
output, reduce-scatter its (unscattered) input, collective-permute what it sends. Collectives
inside a `while` loop (a `scan`) count once per iteration when XLA knows the trip count; inside
a conditional, every branch counts (an upper bound). `collectives` lists each collective
instruction with its bytes and executions; `collective_bytes` sums them by kind.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

#: Dense bf16 peak FLOP/s per device (no sparsity), by `device_kind` substring.
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is lower, set hardware.peak_tflops for it
    "A100": 312e12,
    "L4": 121e12,
    "TPU v4": 275e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
}

_DTYPE_BYTES = {"pred": 1, "token": 0, "tuple": 0}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEE = re.compile(r"\b(body|calls|true_computation|false_computation)=%?([^\s,)]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TO_APPLY = re.compile(r"\bto_apply=%?([^\s,)]+)")
_DOT_DIMS = re.compile(r"\b(lhs|rhs)_(contracting|batch)_dims=\{([\d,]*)\}")
# The forms of a collective's device groups in XLA's HLO text (see `_groups`).
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*)\))?\s*\{([^}]*)\}"
)
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}")


def _dtype_bytes(name: str) -> int:
    """'f32' → 4, 'bf16' → 2, 'c64' → 8, 'f8e4m3fn' → 1, 's4' → 1 (rounded up), 'pred' → 1."""
    if name in _DTYPE_BYTES:
        return _DTYPE_BYTES[name]
    bits = re.match(r"[a-z]+(\d+)", name)
    return max(1, int(bits.group(1)) // 8) if bits else 0


def _array_bytes(type_text: str) -> list[int]:
    """Bytes of each array in an HLO type ("f32[4,8]{1,0}", or a tuple of them)."""
    return [
        _dtype_bytes(dtype) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(type_text)
    ]


def _split_type(rest: str) -> tuple[str, str]:
    """'(f32[2], f32[3]) all-reduce(...)' → ('(f32[2], f32[3])', 'all-reduce(...)')."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].strip()
    type_text, _, tail = rest.partition(" ")
    return type_text, tail.strip()


def _ints(text: str) -> list[int]:
    return [int(i) for i in re.findall(r"\d+", text)]


def _mesh_groups(axes_text: str, device_ids: str | None, refs_text: str) -> np.ndarray:
    """Groups of `mesh['data'=8,'tensor'=2] {'data':(1)2,'tensor'}`, as XLA flattens them.

    A reference `'axis':(p)s` is a sub-axis of size s below a major part of size p: index i
    along an axis of size n has coordinate `i // (n / (p·s)) % s` on it. Each mesh axis is
    reshaped into its referenced
    sub-axes (with filler dimensions between), the referenced ones are moved last in the order
    written, and every `group size` consecutive ids form a group
    (`MeshAxesReplicaGroupList::flattened_replica_groups` in XLA).
    """
    sizes = [(name, int(n)) for name, n in re.findall(r"'([^']+)'=(\d+)", axes_text)]
    names = [name for name, _ in sizes]
    refs = [
        (names.index(name), int(pre or 1), int(size) if size else None)
        for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", refs_text)
    ]
    dims: list[int] = []
    grouped = [0] * len(refs)
    for axis, (_, n) in enumerate(sizes):
        prefix = 1
        on_axis = [r for r, ref in enumerate(refs) if ref[0] == axis]
        for r in sorted(on_axis, key=lambda r: refs[r][1]):
            _, pre, size = refs[r]
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped[r] = len(dims)
            dims.append(size or n)
            prefix *= size or n
        if prefix != n:
            dims.append(n // prefix)
    ids = np.array(_ints(device_ids)) if device_ids else np.arange(math.prod(n for _, n in sizes))
    order = [d for d in range(len(dims)) if d not in grouped] + grouped
    size = math.prod(dims[d] for d in grouped)
    return ids.reshape(dims).transpose(order).reshape(-1, size)


def _groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of a collective: its replica groups, or its (source, target) pairs.

    Reads every form XLA prints: `mesh[...] {axes}` (what jax 0.12 emits for shard_map and most
    SPMD collectives), iota `[groups,size]<=[dims]T(perm)` (the ids `iota(prod(dims))` reshaped
    to `dims`, transposed by `perm`, reshaped to `[groups, size]`), explicit `{{0,1},{2,3}}`,
    and `source_target_pairs={{0,1},{1,2}}`. No groups (or `{}`) means all devices.
    """
    mesh = _MESH_GROUPS.search(line)
    if mesh:
        return tuple(map(tuple, _mesh_groups(*mesh.groups()).tolist()))
    iota = _IOTA_GROUPS.search(line)
    if iota:
        count, size, dims, perm = iota.groups()
        shape = _ints(dims)
        ids = np.arange(math.prod(shape)).reshape(shape)
        ids = ids.transpose(_ints(perm)) if perm else ids
        return tuple(map(tuple, ids.reshape(int(count), int(size)).tolist()))
    listed = _LIST_GROUPS.search(line)
    groups = re.findall(r"\{([\d,]*)\}", listed.group(1)) if listed else []
    if groups:
        return tuple(tuple(_ints(group)) for group in groups)
    return (tuple(range(num_devices)),)


def _collective(op: str) -> tuple[str, bool] | None:
    """('all-gather', is_async_start) for 'all-gather' / 'all-gather-start'; None otherwise."""
    for kind in COLLECTIVES:
        if op == kind:
            return kind, False
        if op == f"{kind}-start":
            return kind, True
    return None


def _instruction_bytes(kind: str, is_start: bool, type_text: str, group_size: int) -> int:
    sizes = _array_bytes(type_text)
    if is_start and kind != "all-reduce":
        # async starts return (operands..., outputs..., contexts...): drop the u32/s32 scalar
        # contexts, keep the outputs (the second half).
        sizes = [s for s in sizes if s > 4] or sizes
        sizes = sizes[len(sizes) // 2 :]
    total = sum(sizes)
    if kind == "reduce-scatter":
        total *= group_size
    return total


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program and how often one run executes it.

    `groups` is where it runs rather than what it moves, so it takes no part in equality: a
    `Collective` written without groups equals the parsed one.
    """

    kind: str  #: one of `COLLECTIVES`
    name: str  #: the HLO instruction, e.g. "all-reduce.52"
    computation: str  #: the HLO computation that holds it
    bytes: int  #: per device and per execution, in the convention of `collective_bytes`
    executions: int  #: per run: loop trip counts multiplied, each conditional branch once
    #: the replica groups of partition ids, or `(source, target)` pairs for collective-permute
    groups: tuple[tuple[int, ...], ...] | None = dataclasses.field(default=None, compare=False)


class _Instruction(NamedTuple):
    name: str
    type_text: str
    op: str
    tail: str


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instruction]], dict[str, int], str | None]:
    """HLO text -> (instructions per computation, runs of each computation per program run,
    the entry computation). Runs follow while trip counts (when XLA knows them) and count each
    conditional branch once."""
    own: dict[str, list[_Instruction]] = defaultdict(list)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry, current = None, None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "\t")) and line.rstrip().endswith("{"):
            header = _HEADER.match(line)
            current = header.group(1) if header else None
            if line.startswith("ENTRY"):
                entry = current
            continue
        match = _INSTRUCTION.match(line) if current else None
        if match is None:
            continue
        name, rest = match.groups()
        type_text, tail = _split_type(rest)
        op = tail.partition("(")[0]
        own[current].append(_Instruction(name, type_text, op, tail))
        trips = _TRIP_COUNT.search(tail)
        for role, callee in _CALLEE.findall(tail):
            calls[current].append((callee, int(trips.group(1)) if role == "body" and trips else 1))
        for branches in _BRANCHES.findall(tail):
            for callee in branches.split(","):
                calls[current].append((callee.strip().lstrip("%"), 1))
        if op == "call":  # a call runs its `to_apply` (a reduction's `to_apply` is no call)
            calls[current] += [(callee, 1) for callee in _TO_APPLY.findall(tail)]

    executions: dict[str, int] = defaultdict(int)  # computation → runs per program run

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64:  # malformed text; HLO call graphs are acyclic
            return
        executions[name] += times
        for callee, trips in calls.get(name, ()):
            visit(callee, times * trips, depth + 1)

    if entry is not None:
        visit(entry, 1)
    return own, executions, entry


def collectives(hlo_text: str, *, num_devices: int = 1) -> list[Collective]:
    """Every collective instruction that a run of the program reaches, from optimized HLO text.

    Args:
      hlo_text: `compiled.as_text()` of a jitted step.
      num_devices: devices of the program (for collectives without explicit replica groups).

    Returns:
      One `Collective` per instruction, in the order of the text, with its device groups;
      `bytes * executions` summed by kind is `collective_bytes`.
    """
    own, executions, _ = _parse(hlo_text)
    found = []
    for computation, instructions in own.items():
        if not executions.get(computation):
            continue
        for ins in instructions:
            kind = _collective(ins.op)
            if kind is None:
                continue
            groups = _groups(ins.tail, num_devices)
            nbytes = _instruction_bytes(*kind, ins.type_text, len(groups[0]))
            found.append(Collective(kind[0], ins.name, computation, nbytes, executions[computation], groups))
    return found


@dataclasses.dataclass(frozen=True)
class Dot:
    """One `dot` instruction of a compiled program: what it multiplies on each device, and how
    often one run executes it."""

    lhs: tuple[int, ...]  #: per-device shape of the left operand
    rhs: tuple[int, ...]  #: per-device shape of the right operand
    dtypes: tuple[str, str, str]  #: HLO element types of lhs, rhs and result, e.g. "f32"
    #: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`, as `lax.dot_general`
    #: takes them
    dimension_numbers: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    executions: int  #: per run: loop trip counts multiplied, each conditional branch once

    @property
    def flops(self) -> int:
        """FLOPs of one execution: 2 x every lhs element x the rhs's free (output) size."""
        (_, contracting), (_, batch) = self.dimension_numbers
        free = math.prod(d for i, d in enumerate(self.rhs) if i not in contracting + batch)
        return 2 * math.prod(self.lhs) * free


def _dot(ins: _Instruction, types: dict[str, str], executions: int = 1) -> Dot | None:
    """The `Dot` of a `dot` instruction; None where its operands' types are not in `types`."""
    operands = _operands(ins)[:2]
    arrays = [_ARRAY.search(types.get(o, "")) for o in operands] + [_ARRAY.search(ins.type_text)]
    if len(operands) < 2 or None in arrays:
        return None
    lhs, rhs, result = arrays
    dims = {(side, kind): tuple(_ints(numbers))
            for side, kind, numbers in _DOT_DIMS.findall(ins.tail)}
    return Dot(
        lhs=tuple(_dims(lhs.group(0))), rhs=tuple(_dims(rhs.group(0))),
        dtypes=(lhs.group(1), rhs.group(1), result.group(1)),
        dimension_numbers=(
            (dims.get(("lhs", "contracting"), ()), dims.get(("rhs", "contracting"), ())),
            (dims.get(("lhs", "batch"), ()), dims.get(("rhs", "batch"), ())),
        ),
        executions=executions,
    )


def dots(hlo_text: str) -> list[Dot]:
    """Every `dot` instruction a run of the program reaches (fused ones included), from
    optimized HLO text, in the order of the text. Matmuls compiled to library calls (cuBLAS
    custom calls on GPU) are not `dot`s and are not listed."""
    own, executions, _ = _parse(hlo_text)
    found = []
    for computation, instructions in own.items():
        if not executions.get(computation):
            continue
        types = {ins.name: ins.type_text for ins in instructions}
        found += [_dot(ins, types, executions[computation])
                  for ins in instructions if ins.op == "dot"]
    return [dot for dot in found if dot is not None]


#: Instructions that move no data of their own (views, bookkeeping, control flow whose bodies
#: are counted where they run).
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
               "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier"}
_OPERANDS = re.compile(r"%([^\s,()]+)")


def _updates_in_place(ins: _Instruction, own: dict[str, list[_Instruction]]) -> bool:
    """A dynamic-update-slice, or a fusion whose result is one: XLA writes the update into
    the buffer it was given."""
    if ins.op == "dynamic-update-slice":
        return True
    if ins.op != "fusion":
        return False
    body = next((c for role, c in _CALLEE.findall(ins.tail) if role == "calls"), None)
    return bool(own.get(body)) and own[body][-1].op == "dynamic-update-slice"


#: What `_fold` asks of an instruction: (instruction, every computation's instructions, its own
#: computation's result types by instruction name) → a tuple of figures.
_Cost = Callable[[_Instruction, dict[str, list[_Instruction]], dict[str, str]], tuple[float, ...]]


def _fold(hlo_text: str, cost: _Cost) -> tuple[float, ...]:
    """`cost` summed over every instruction one run of the program executes, from optimized
    HLO text: a loop body once per iteration (when XLA knows the trip count), the costliest
    branch of a conditional (one runs; costliest by the sum of its figures), a `call`'s body
    where it is called. Control flow and bookkeeping (`_NO_TRAFFIC`) cost nothing themselves."""
    own, _, entry = _parse(hlo_text)
    memo: dict[str, tuple[float, ...]] = {}

    def total(computation: str, depth: int = 0) -> tuple[float, ...]:
        if computation in memo or depth > 64:
            return memo.get(computation, ())
        instructions = own.get(computation, [])
        types = {ins.name: ins.type_text for ins in instructions}
        parts: list[tuple[float, ...]] = []
        for ins in instructions:
            if ins.op == "while":
                trips = _TRIP_COUNT.search(ins.tail)
                body = _add(*(total(c, depth + 1) for role, c in _CALLEE.findall(ins.tail)))
                parts.append(tuple((int(trips.group(1)) if trips else 1) * x for x in body))
            elif ins.op == "conditional":
                branches = [c.strip().lstrip("%") for b in _BRANCHES.findall(ins.tail) for c in b.split(",")]
                branches += [c for role, c in _CALLEE.findall(ins.tail)]
                parts.append(max((total(c, depth + 1) for c in branches), key=sum, default=()))
            elif ins.op == "call":
                parts += [total(c, depth + 1) for c in _TO_APPLY.findall(ins.tail)]
            elif ins.op not in _NO_TRAFFIC:
                parts.append(cost(ins, own, types))
        memo[computation] = _add(*parts)
        return memo[computation]

    return total(entry) if entry is not None else ()


def _add(*parts: tuple[float, ...]) -> tuple[float, ...]:
    """Element-wise sum of tuples (a shorter one counts as zeros)."""
    width = max(map(len, parts), default=0)
    return tuple(sum(p[i] for p in parts if i < len(p)) for i in range(width))


def _operands(ins: _Instruction) -> list[str]:
    return _OPERANDS.findall(ins.tail.partition(")")[0])


def _bytes_moved(ins: _Instruction, own: dict[str, list[_Instruction]], types: dict[str, str]) -> int:
    """What an instruction reads and writes in device memory: its operands and its result (a
    fusion's inside stays in registers and cache), or for an in-place update its update only."""
    result = sum(_array_bytes(ins.type_text))
    operands = [sum(_array_bytes(types.get(o, ""))) for o in _operands(ins)]
    if _updates_in_place(ins, own):
        return 2 * sum(n for n in operands if n != result)
    return result + sum(operands)


def memory_traffic(hlo_text: str) -> int:
    """Bytes one run of the program reads and writes in device memory, from optimized HLO text.

    Each instruction outside a fusion reads its operands and writes its result (a fusion's
    inside stays in registers and cache), as XLA's `cost_analysis()["bytes accessed"]` counts;
    unlike it, a loop body counts once per iteration, and a conditional counts its costliest
    branch (one runs).
    """
    return int(sum(_fold(hlo_text, lambda ins, own, types: (_bytes_moved(ins, own, types),))))


def _dims(type_text: str) -> list[int]:
    """The shape of the first array in an HLO type: "bf16[512,256]{1,0}" → [512, 256]."""
    array = _ARRAY.search(type_text)
    return [int(d) for d in array.group(2).split(",") if d] if array else []


def _matmul_flops(ins: _Instruction, own: dict[str, list[_Instruction]], types: dict[str, str], depth: int = 0) -> int:
    """FLOPs of a `dot` (2 x output elements x contracted size), or of the dots a fusion calls."""
    if ins.op == "dot":
        dot = _dot(ins, types)
        return dot.flops if dot is not None else 0
    flops = 0
    for role, callee in _CALLEE.findall(ins.tail) if ins.op == "fusion" and depth < 16 else ():
        body = own.get(callee, []) if role == "calls" else []
        inner = {i.name: i.type_text for i in body}
        flops += sum(_matmul_flops(i, own, inner, depth + 1) for i in body)
    return flops


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
        if _collective(ins.op):
            return (0.0, 0.0, 0.0)
        flops = _matmul_flops(ins, own, types)
        compute, memory = flops / flops_per_s, _bytes_moved(ins, own, types) / bytes_per_s
        return (compute, 0.0, flops) if compute >= memory else (0.0, memory, flops)

    compute, memory, flops = _fold(hlo_text, cost) or (0.0, 0.0, 0.0)
    return {"compute": compute, "memory": memory, "flops": flops}


def collective_bytes(hlo_text: str, *, num_devices: int = 1) -> dict[str, int]:
    """Per-device bytes moved per execution, by collective kind, from optimized HLO text.

    Args:
      hlo_text: `compiled.as_text()` of a jitted step.
      num_devices: devices of the program (for collectives without explicit replica groups).

    Returns:
      `{kind: bytes}` for every kind in `COLLECTIVES` (0 where absent), plus `total`.
    """
    totals = dict.fromkeys(COLLECTIVES, 0)
    for op in collectives(hlo_text, num_devices=num_devices):
        totals[op.kind] += op.bytes * op.executions
    totals["total"] = sum(totals[k] for k in COLLECTIVES)
    return totals


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
        else:
            inner = sum(_count_flops(j) for j in _sub_jaxprs(eqn))
            total += inner * (eqn.params.get("length", 1) if name == "scan" else 1)
    return total


def jaxpr_flops(fn, *args) -> int:
    """Matmul FLOPs of `fn(*args)` for the whole (global) computation, loops included.

    Counts `dot_general` (2·M·N·K) and `ragged_dot`, multiplies `scan` bodies by their
    length, takes the larger branch of a `cond`. Elementwise work is not counted, which is
    the usual convention for model FLOPs; rematerialised forward passes are counted.
    """
    import jax

    return _count_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def peak_flops(device_kind: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: `override_tflops` (config) or the `PEAK_FLOPS` table."""
    if override_tflops:
        return override_tflops * 1e12
    for name, peak in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return peak
    return None


def mfu(flops_per_device: float, step_seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s per device over the device's peak."""
    if not peak or step_seconds <= 0:
        return None
    return flops_per_device / step_seconds / peak


def step_profile(
    compiled, *, flops: int, num_devices: int, device_kind: str, peak_tflops: float | None = None
) -> dict[str, Any]:
    """FLOPs, peak FLOP/s and collective bytes of one compiled step.

    Args:
      compiled: the compiled step.
      flops: global matmul FLOPs of the step (`jaxpr_flops`).
      num_devices: devices the step runs on.
      device_kind: `jax.Device.device_kind`, for the peak table.
      peak_tflops: the device's peak from config, overriding the table.
    """
    return {
        "flops": flops,
        "flops_per_device": flops / num_devices,
        "xla_flops_per_device": compiled_flops(compiled),
        "peak_flops_per_device": peak_flops(device_kind, peak_tflops),
        "device_kind": device_kind,
        "collective_bytes": collective_bytes(compiled.as_text(), num_devices=num_devices),
    }
