"""The optimized HLO text of a compiled program, read: its instructions, how often one run
executes each, its collectives and its dots.

`parse` splits the text into computations of `Instruction`s and counts how many times one
run of the program runs each computation; `collectives`, `collective_bytes` and `dots` are
read from that. FLOP counts, memory traffic and the roofline over the same instructions are
in `jaxspeed.cost.flops`.

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
from typing import NamedTuple

import numpy as np

from jaxspeed.network.links import COLLECTIVES  # the collective kinds (`jaxspeed.network`)

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
_OPERANDS = re.compile(r"%([^\s,()]+)")


def _dtype_bytes(name: str) -> int:
    """'f32' → 4, 'bf16' → 2, 'c64' → 8, 'f8e4m3fn' → 1, 's4' → 1 (rounded up), 'pred' → 1."""
    if name in _DTYPE_BYTES:
        return _DTYPE_BYTES[name]
    bits = re.match(r"[a-z]+(\d+)", name)
    return max(1, int(bits.group(1)) // 8) if bits else 0


def array_bytes(type_text: str) -> list[int]:
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


def collective_kind(op: str) -> tuple[str, bool] | None:
    """('all-gather', is_async_start) for 'all-gather' / 'all-gather-start'; None otherwise."""
    for kind in COLLECTIVES:
        if op == kind:
            return kind, False
        if op == f"{kind}-start":
            return kind, True
    return None


def _instruction_bytes(kind: str, is_start: bool, type_text: str, group_size: int) -> int:
    sizes = array_bytes(type_text)
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


class Instruction(NamedTuple):
    """One line of a computation: `name = type_text op(operands), attributes`."""

    name: str  #: e.g. "all-reduce.52"
    type_text: str  #: its result type, e.g. "f32[4,8]{1,0}" or a tuple of them
    op: str  #: e.g. "fusion", "all-reduce-start"
    tail: str  #: everything after the type: the op, its operands and attributes


def trip_count(ins: Instruction) -> int | None:
    """A `while`'s iterations, when XLA knows them (`known_trip_count`); None otherwise."""
    trips = _TRIP_COUNT.search(ins.tail)
    return int(trips.group(1)) if trips else None


def callees(ins: Instruction) -> list[tuple[str, str]]:
    """`(role, computation)` for each computation an instruction names as its `body`, `calls`,
    `true_computation` or `false_computation`."""
    return _CALLEE.findall(ins.tail)


def branches(ins: Instruction) -> list[str]:
    """The computations of a conditional's `branch_computations={...}`."""
    return [c.strip().lstrip("%") for b in _BRANCHES.findall(ins.tail) for c in b.split(",")]


def to_apply(ins: Instruction) -> list[str]:
    """The computations an instruction names as its `to_apply`."""
    return _TO_APPLY.findall(ins.tail)


def operands(ins: Instruction) -> list[str]:
    """The names of an instruction's operands."""
    return _OPERANDS.findall(ins.tail.partition(")")[0])


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], dict[str, int], str | None]:
    """HLO text -> (instructions per computation, runs of each computation per program run,
    the entry computation). Runs follow while trip counts (when XLA knows them) and count each
    conditional branch once."""
    own: dict[str, list[Instruction]] = defaultdict(list)
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
        ins = Instruction(name, type_text, tail.partition("(")[0], tail)
        own[current].append(ins)
        trips = trip_count(ins)
        for role, callee in callees(ins):
            calls[current].append((callee, trips if role == "body" and trips is not None else 1))
        calls[current] += [(callee, 1) for callee in branches(ins)]
        if ins.op == "call":  # a call runs its `to_apply` (a reduction's `to_apply` is no call)
            calls[current] += [(callee, 1) for callee in to_apply(ins)]

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
    own, executions, _ = parse(hlo_text)
    found = []
    for computation, instructions in own.items():
        if not executions.get(computation):
            continue
        for ins in instructions:
            kind = collective_kind(ins.op)
            if kind is None:
                continue
            groups = _groups(ins.tail, num_devices)
            nbytes = _instruction_bytes(*kind, ins.type_text, len(groups[0]))
            found.append(Collective(kind[0], ins.name, computation, nbytes, executions[computation], groups))
    return found


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


def parse_dot(ins: Instruction, types: dict[str, str], executions: int = 1) -> Dot | None:
    """The `Dot` of a `dot` instruction; None where its operands' types are not in `types`."""
    dims = {(side, kind): tuple(_ints(numbers))
            for side, kind, numbers in _DOT_DIMS.findall(ins.tail)}
    return _dot(ins, types, dims, executions)


def _dot(ins: Instruction, types: dict[str, str], dims: dict, executions: int) -> Dot | None:
    """The `Dot` of a matmul instruction whose first two operands are the matrices."""
    names = operands(ins)[:2]
    arrays = [_ARRAY.search(types.get(o, "")) for o in names] + [_ARRAY.search(ins.type_text)]
    if len(names) < 2 or None in arrays:
        return None
    lhs, rhs, result = arrays
    return Dot(
        lhs=tuple(_dims(lhs.group(0))), rhs=tuple(_dims(rhs.group(0))),
        dtypes=(lhs.group(1), rhs.group(1), result.group(1)),
        dimension_numbers=(
            (dims.get(("lhs", "contracting"), ()), dims.get(("rhs", "contracting"), ())),
            (dims.get(("lhs", "batch"), ()), dims.get(("rhs", "batch"), ())),
        ),
        executions=executions,
    )


_GEMM_DIMS = re.compile(r'"(lhs|rhs)_(contracting|batch)_dimensions":\[([^\]]*)\]')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def custom_call_target(ins: Instruction) -> str | None:
    """A custom call's target (`__cublas$gemm`, `__cudnn$fmhaSoftmax`, ...); None otherwise."""
    target = _TARGET.search(ins.tail) if ins.op == "custom-call" else None
    return target.group(1) if target else None


def parse_gemm(ins: Instruction, types: dict[str, str], executions: int = 1) -> Dot | None:
    """The `Dot` of a library matmul: a cuBLAS/cuBLASLt custom call (`__cublas$gemm`,
    `__cublas$lt$matmul`, `__cublas$lt$matmul$f8`), whose first two operands are the matrices
    and whose `backend_config` holds the dimension numbers; or the first matmul (`bmm1`, Q·Kᵀ)
    of a cuDNN fused attention (`__cudnn$fmha...`). None for other instructions, or where the
    operands' types are not in `types`."""
    target = custom_call_target(ins) or ""
    if not target.startswith(("__cublas$", "__cudnn$fmha")):
        return None
    config = ins.tail
    if target.startswith("__cudnn$fmha"):
        found = re.search(r'"bmm1(?:_grad_gemm1)?_dot_dimension_numbers":\{([^}]*)\}', config)
        if found is None:
            return None
        config = found.group(1)
    dims = {(side, kind): tuple(int(d) for d in re.findall(r"\d+", numbers))
            for side, kind, numbers in _GEMM_DIMS.findall(config)}
    return _dot(ins, types, dims, executions)


def dots(hlo_text: str) -> list[Dot]:
    """Every `dot` instruction a run of the program reaches (fused ones included), from
    optimized HLO text, in the order of the text. Matmuls compiled to library calls (cuBLAS
    custom calls on GPU) are not `dot`s and are not listed."""
    own, executions, _ = parse(hlo_text)
    found = []
    for computation, instructions in own.items():
        if not executions.get(computation):
            continue
        types = {ins.name: ins.type_text for ins in instructions}
        found += [parse_dot(ins, types, executions[computation])
                  for ins in instructions if ins.op == "dot"]
    return [dot for dot in found if dot is not None]


def _dims(type_text: str) -> list[int]:
    """The shape of the first array in an HLO type: "bf16[512,256]{1,0}" → [512, 256]."""
    array = _ARRAY.search(type_text)
    return [int(d) for d in array.group(2).split(",") if d] if array else []
