"""Pipeline schedules as data: which stage runs which forward/backward at each time step.

A schedule is a table `[step][stage]` of `Instruction`s (or `None` for an idle slot). One
step is the time one stage (one virtual stage, for `interleaved`) takes for one microbatch's
forward or backward; both are counted as one unit, as in the textbook bubble formulas.

- `gpipe` (Huang et al. 2019): all forwards, then all backwards.
  Bubble (S-1)/(M+S-1).
- `1f1b` (PipeDream-Flush, Narayanan et al. 2021): stage s runs S-s-1 warm-up forwards,
  then alternates one forward and one backward, then drains the backwards. Same bubble as
  GPipe, but at most S-s microbatches are in flight on stage s.
- `interleaved` (Narayanan et al. 2021, sec. 2.2): each device holds v virtual stages,
  placed circularly (virtual stage c*S + d lives on device d), microbatches go round in
  groups of S. Bubble (S-1)/(v*M+S-1).

The table is built by running each device's instruction order (the order that defines the
schedule) greedily against the data dependencies; a result computed at step t reaches the
neighbouring stage at step t+1. `execution_plan` compiles a table into the integer arrays and
ring-buffer slots that the SPMD loop in `interpreter.py` indexes, so the program runs exactly the
table.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")


class Instruction(NamedTuple):
    """One slot of a schedule table.

    Attributes:
      kind: "F" (forward) or "B" (backward).
      microbatch: microbatch index in [0, M).
      chunk: which of the device's virtual stages (0 unless `interleaved`); the virtual
        (model-order) stage is `chunk * stages + device`.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Table = tuple[tuple[Instruction | None, ...], ...]


def check_schedule_args(
    schedule: str, stages: int, microbatches: int, virtual_stages: int = 1
) -> None:
    """Raises a `ValueError` naming the argument when a schedule cannot run these sizes."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not supported; accepted: {list(SCHEDULES)}")
    for name, value in (
        ("stages", stages),
        ("microbatches", microbatches),
        ("virtual_stages", virtual_stages),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved'; "
            f"schedule={schedule!r} accepts only virtual_stages=1"
        )
    if schedule == "1f1b" and microbatches < stages:
        raise ValueError(
            f"schedule='1f1b' needs microbatches >= stages, got microbatches={microbatches} "
            f"< stages={stages}; use more microbatches or schedule='gpipe'"
        )
    if schedule == "interleaved" and microbatches % stages:
        raise ValueError(
            f"schedule='interleaved' needs microbatches divisible by stages, got "
            f"microbatches={microbatches}, stages={stages}"
        )


def _forward_order(schedule: str, stages: int, microbatches: int, v: int) -> list[Instruction]:
    """The forwards in the order every device runs them (the same on each device)."""
    if schedule != "interleaved":
        return [Instruction("F", i) for i in range(microbatches)]
    # Groups of S microbatches go through chunk 0, then chunk 1, ... (Megatron-LM order).
    return [
        Instruction("F", group + i, chunk)
        for group in range(0, microbatches, stages)
        for chunk in range(v)
        for i in range(stages)
    ]


def _device_order(
    schedule: str, stages: int, microbatches: int, v: int, device: int, forward_only: bool
) -> list[Instruction]:
    """The instructions of one device, in the order the schedule runs them."""
    forwards = _forward_order(schedule, stages, microbatches, v)
    if forward_only:
        return forwards
    backwards = [Instruction("B", f.microbatch, v - 1 - f.chunk) for f in forwards]
    if schedule == "gpipe":
        return forwards + backwards
    if schedule == "1f1b" or v == 1:
        warmup = stages - device - 1
    else:
        warmup = 2 * (stages - device - 1) + (v - 1) * stages
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for j in range(len(forwards) - warmup):
        order += [forwards[warmup + j], backwards[j]]
    return order + backwards[len(forwards) - warmup :]


def _dependency(ins: Instruction, device: int, stages: int, v: int) -> tuple[Instruction, int]:
    """The instruction (and its device) whose result `ins` on `device` consumes."""
    virtual = ins.chunk * stages + device
    last = stages * v - 1
    if ins.kind == "F":
        prev = virtual - 1
        return Instruction("F", ins.microbatch, prev // stages), prev % stages
    if virtual == last:
        return Instruction("F", ins.microbatch, ins.chunk), device
    nxt = virtual + 1
    return Instruction("B", ins.microbatch, nxt // stages), nxt % stages


def schedule_table(
    schedule: str,
    stages: int,
    microbatches: int,
    *,
    virtual_stages: int = 1,
    forward_only: bool = False,
) -> Table:
    """The per-step, per-stage instruction table of a pipeline schedule.

    Args:
      schedule: "gpipe", "1f1b" or "interleaved".
      stages: number of pipeline stages S (devices along the pipe axis).
      microbatches: number of microbatches M.
      virtual_stages: stages per device v (only `interleaved` accepts v > 1).
      forward_only: only the forwards (as run when autodiff provides the backward).

    Returns:
      `table[step][stage]`: an `Instruction` or None (idle); `len(table)` steps.

    Raises:
      ValueError: unknown schedule, non-positive sizes, `1f1b` with M < S, `interleaved`
        with M not divisible by S, or v > 1 for a schedule without virtual stages.
    """
    check_schedule_args(schedule, stages, microbatches, virtual_stages)
    v = virtual_stages
    orders = [
        _device_order(schedule, stages, microbatches, v, d, forward_only) for d in range(stages)
    ]
    done: dict[tuple[Instruction, int], int] = {}  # (instruction, device) -> step it ran
    cursor = [0] * stages
    rows: list[tuple[Instruction | None, ...]] = []
    while any(cursor[d] < len(orders[d]) for d in range(stages)):
        step = len(rows)
        row: list[Instruction | None] = [None] * stages
        for d in range(stages):
            if cursor[d] == len(orders[d]):
                continue
            ins = orders[d][cursor[d]]
            ready = ins.kind == "F" and ins.chunk * stages + d == 0
            if not ready:
                ran = done.get(_dependency(ins, d, stages, v))
                ready = ran is not None and ran < step
            if ready:
                row[d] = ins
        for d, ins in enumerate(row):
            if ins is not None:
                done[(ins, d)] = step
                cursor[d] += 1
        if not any(row):
            raise RuntimeError(f"schedule {schedule!r} deadlocked at step {step}")  # a bug
        rows.append(tuple(row))
    return tuple(rows)


def bubble_fraction(table: Table) -> float:
    """Fraction of idle (stage, step) slots in a schedule table."""
    slots = sum(len(row) for row in table)
    idle = sum(ins is None for row in table for ins in row)
    return idle / slots if slots else 0.0


def format_table(table: Table) -> str:
    """The table as text: one line per stage, one column per step ('.' = idle)."""
    stages = len(table[0]) if table else 0
    cells = [[str(row[d]) if row[d] is not None else "." for row in table] for d in range(stages)]
    width = max((len(c) for line in cells for c in line), default=1)
    return "\n".join(" ".join(c.rjust(width) for c in line) for line in cells)


# --- Execution plan: the table compiled into per-step integer arrays for the SPMD loop. -----

IDLE, FORWARD, FORWARD_LAST, BACKWARD = 0, 1, 2, 3


class ExecutionPlan(NamedTuple):
    """A schedule table as `[steps, stages]` int32 arrays, with buffer slots assigned.

    Slots are indices into small per-device ring buffers; -1 means "nothing this step".

    Attributes:
      kind: IDLE, FORWARD, FORWARD_LAST (forward of the last virtual stage) or BACKWARD.
      microbatch, chunk: the instruction's microbatch and chunk (0 when idle).
      first: 1 where the instruction belongs to virtual stage 0 (reads the inputs / writes
        the input cotangent).
      act_read: slot of the received activation a forward consumes.
      act_recv: slot that stores the activation arriving from the previous device at the
        end of the step.
      res_slot: slot of the stage input a forward stores and its backward consumes (the
        backward recomputes the stage forward from it).
      grad_read: slot of the output cotangent a backward consumes.
      grad_recv: slot that stores the cotangent arriving from the next device.
      grad_self: slot where a last-stage forward stores the loss cotangent.
      act_slots, res_slots, grad_slots: buffer sizes (at least 1).
    """

    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    first: np.ndarray
    act_read: np.ndarray
    act_recv: np.ndarray
    res_slot: np.ndarray
    grad_read: np.ndarray
    grad_recv: np.ndarray
    grad_self: np.ndarray
    act_slots: int
    res_slots: int
    grad_slots: int


def _assign_slots(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Greedy interval colouring: (write step, last read step, key) -> slot per key.

    A slot read at step t may be written again at step t (reads happen before writes).
    """
    free_at: list[int] = []
    slots = {}
    for start, end, key in sorted(intervals, key=lambda item: item[:2]):
        slot = next((s for s, t in enumerate(free_at) if t <= start), len(free_at))
        if slot == len(free_at):
            free_at.append(end)
        free_at[slot] = end
        slots[key] = slot
    return slots, len(free_at)


def execution_plan(table: Table, *, stages: int, virtual_stages: int = 1) -> ExecutionPlan:
    """Compiles a schedule table into the integer arrays the SPMD pipeline loop indexes.

    Args:
      table: from `schedule_table` (with or without backwards).
      stages: number of devices S along the pipe axis.
      virtual_stages: v.

    Returns:
      An `ExecutionPlan` whose arrays are `[len(table), stages]` int32.
    """
    shape = (len(table), stages)
    arrays = {name: np.full(shape, -1, np.int32) for name in ExecutionPlan._fields[4:10]}
    kind, mb, chunk, first = (np.zeros(shape, np.int32) for _ in range(4))
    when = {(ins, d): t for t, row in enumerate(table) for d, ins in enumerate(row) if ins}
    last = stages * virtual_stages - 1
    act, res, grad = ([[] for _ in range(stages)] for _ in range(3))
    for (ins, d), t in when.items():
        virtual = ins.chunk * stages + d
        mb[t, d], chunk[t, d], first[t, d] = ins.microbatch, ins.chunk, virtual == 0
        if ins.kind == "F":
            kind[t, d] = FORWARD_LAST if virtual == last else FORWARD
            if virtual > 0:
                src = when[_dependency(ins, d, stages, virtual_stages)]
                act[d].append((src, t, (ins, d)))
            backward = (Instruction("B", ins.microbatch, ins.chunk), d)
            if backward in when:
                res[d].append((t, when[backward], backward))
        else:
            kind[t, d] = BACKWARD
            grad[d].append((when[_dependency(ins, d, stages, virtual_stages)], t, (ins, d)))
    sizes = {}
    for name, per_device in (("act", act), ("res", res), ("grad", grad)):
        sizes[name] = 1
        for d in range(stages):
            slots, count = _assign_slots(per_device[d])
            sizes[name] = max(sizes[name], count)
            for start, end, key in per_device[d]:
                slot = slots[key]
                if name == "act":
                    arrays["act_read"][end, d], arrays["act_recv"][start, d] = slot, slot
                elif name == "res":
                    arrays["res_slot"][start, d] = arrays["res_slot"][end, d] = slot
                else:
                    arrays["grad_read"][end, d] = slot
                    self_made = key[0].chunk * stages + d == last
                    arrays["grad_self" if self_made else "grad_recv"][start, d] = slot
    return ExecutionPlan(
        kind, mb, chunk, first, **arrays,
        act_slots=sizes["act"], res_slots=sizes["res"], grad_slots=sizes["grad"],
    )
