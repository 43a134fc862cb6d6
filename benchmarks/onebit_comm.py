"""Collective bytes per step in the compiled HLO: Adam against 1-bit Adam after the freeze, data=8.

Measured: every collective instruction of three compiled train steps, read from their optimized
HLO by `jaxspeed.cost.hlo.collectives` (per device, per step): its kind, how many times a step
runs it, and its bytes in the profiler's convention, the size of the buffer it works on
(all-reduce and all-to-all their operand, all-gather its gathered output). The steps:
- Adam: the engine's step; XLA inserts the gradient all-reduce of the data-parallel mean;
- 1-bit Adam's warm-up step (before `freeze_step`): an fp32 all-reduce of the gradients;
- 1-bit Adam's compressed step (after `freeze_step`): an all-to-all of packed sign bits and
  scales, an all-gather of the recompressed chunks, and an all-reduce of two metric scalars.

Headline: ratio = Adam's collective bytes per step ÷ 1-bit Adam's after the freeze, each summed
over every collective of its compiled step. No model of how an algorithm (ring, tree) uses the
links enters it: an all-reduce counts its buffer once, as an all-to-all or an all-gather does.
Also, each labelled with its source in the JSON (`sources`):
- `gradient_allreduce_ratio`: the warm-up step's bytes ÷ the compressed step's (both measured);
- `whole_run_ratio`: the measured per-step bytes combined for a run that spends
  `WARMUP_FRACTION` of its steps in the warm-up (an assumed schedule, not a measured run);
- `step_ms`: wall-clock medians on emulated CPU devices, where a collective is a memory copy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "onebit_comm"
FULL_MODEL = {"d_model": 384, "n_layers": 6, "n_heads": 6, "d_ff": 1536, "seq_len": 128}
QUICK_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 256, "seq_len": 32}
FREEZE_STEP = 10
WARMUP_FRACTION = 0.2
STEPS = ("adam", "warmup", "compressed")
SOURCES = {
    "ratio": "Adam's collective bytes ÷ compressed 1-bit Adam's, each summed over every "
             "collective of its compiled step's HLO (jaxspeed.cost.hlo)",
    "collective_bytes": "jaxspeed.cost.hlo.collective_bytes of each compiled step, by kind",
    "collectives": "jaxspeed.cost.hlo.collectives of each compiled step, by kind: "
                   "instructions run per step and their bytes",
    "collective_ops": "jaxspeed.cost.hlo.collectives of each compiled step: every instruction, "
                      "runs per step and bytes per step",
    "gradient_allreduce_ratio": "1-bit warm-up step's collective bytes ÷ compressed step's",
    "whole_run_ratio": "1 / (f·warm-up/Adam + (1−f)·compressed/Adam) of the measured bytes, "
                       "f = warmup_fraction (an assumed schedule)",
    "step_ms": "wall clock, median of the timed steps, emulated CPU devices",
}


def bench_config(optimizer: dict, model: dict):
    from jaxspeed.config import load_config

    return load_config({
        "mesh": {"data": -1},
        "train_micro_batch_size_per_device": 1,
        "gradient_clipping": 0.0,
        "optimizer": optimizer,
        "model": {"type": "gpt", "vocab_size": 256, "max_seq_len": model["seq_len"],
                  **{k: model[k] for k in ("d_model", "n_layers", "n_heads", "d_ff")}},
        "data": {"source": "stdlib", "seq_len": model["seq_len"]},
    })


def step_collectives(compiled, num_devices: int) -> dict:
    """A compiled step's collectives: the profiler's totals by kind, by kind, and each op."""
    from jaxspeed.cost.hlo import collective_bytes, collectives

    text = compiled.as_text()
    ops = collectives(text, num_devices=num_devices)
    by_kind: dict[str, dict[str, int]] = {}
    for op in ops:
        row = by_kind.setdefault(op.kind, {"count": 0, "bytes": 0})
        row["count"] += op.executions
        row["bytes"] += op.bytes * op.executions
    return {
        "collective_bytes": collective_bytes(text, num_devices=num_devices),
        "collectives": by_kind,
        "collective_ops": [
            {"kind": op.kind, "name": op.name, "count": op.executions,
             "bytes": op.bytes * op.executions}
            for op in ops
        ],
    }


def step_time(engine, *, start: int, steps: int) -> float:
    """Median wall seconds of `steps` train steps from step `start` (after one untimed step)."""
    import jax
    import numpy as np

    state = engine.init(jax.random.key(0))
    state = state.replace(step=state.step + start)  # 1-bit: the phase follows the step count
    rng = np.random.default_rng(0)
    shape = (engine.batch_sizes.train_batch_size, engine.config.data.seq_len)
    times = []
    for _ in range(steps + 1):
        tokens = rng.integers(0, 256, shape, dtype=np.int32)
        t0 = time.perf_counter()
        state, metrics = engine.train_step(state, {"inputs": tokens, "targets": tokens})
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model (for tests)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    _common.use_cpu_devices()
    from jaxspeed.train.engine import initialize
    from jaxspeed.models.gpt import count_params

    model = QUICK_MODEL if args.quick else FULL_MODEL
    adam = initialize(bench_config({"type": "Adam", "params": {"lr": 1e-3}}, model))
    onebit = initialize(bench_config(
        {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": FREEZE_STEP}}, model
    ))
    n = _common.DEVICES
    compiled = {
        "adam": adam.compile_train_step(),
        "warmup": onebit.compile_train_step(step=0),
        "compressed": onebit.compile_train_step(step=FREEZE_STEP),
    }
    measured = {k: step_collectives(c, n) for k, c in compiled.items()}
    total = {k: measured[k]["collective_bytes"]["total"] for k in STEPS}
    times = {
        "adam": step_time(adam, start=0, steps=args.steps),
        "compressed": step_time(onebit, start=FREEZE_STEP, steps=args.steps),
    }
    params = count_params(adam.abstract_state().params)
    whole_run = 1 / (WARMUP_FRACTION * total["warmup"] / total["adam"]
                     + (1 - WARMUP_FRACTION) * total["compressed"] / total["adam"])

    print(f"{params:,} params, data={n}, per device per step (fp32 gradients = {4 * params:,} B)")
    rows = []
    for step in STEPS:
        by_kind = measured[step]["collectives"]
        rows += [[step, kind, row["count"], row["bytes"]] for kind, row in by_kind.items()]
        rows.append([step, "total", sum(row["count"] for row in by_kind.values()), total[step]])
    _common.print_table(["step", "collective", "count", "bytes"], rows)
    ratio = _common.ratio(total["adam"], total["compressed"])
    gradient_ratio = _common.ratio(total["warmup"], total["compressed"])
    print(f"after the freeze: {ratio}x fewer collective bytes than Adam; "
          f"{gradient_ratio}x fewer than the 1-bit warm-up's fp32 gradient all-reduce; "
          f"whole run with a {WARMUP_FRACTION:.0%} warm-up: {whole_run:.2f}x; "
          f"step ms (emulated CPU devices): Adam {1e3 * times['adam']:.1f}, "
          f"compressed 1-bit {1e3 * times['compressed']:.1f}")
    _common.print_json(_common.result(
        NAME,
        case=f"params={params} devices={n} after freeze",
        jaxspeed=total["compressed"],
        baseline=total["adam"],
        unit="collective bytes/step/device (compiled HLO)",
        ratio=ratio,
        gradient_allreduce_ratio=gradient_ratio,
        whole_run_ratio=round(whole_run, 3),
        warmup_fraction=WARMUP_FRACTION,
        collective_bytes={k: measured[k]["collective_bytes"] for k in STEPS},
        collectives={k: measured[k]["collectives"] for k in STEPS},
        collective_ops={k: measured[k]["collective_ops"] for k in STEPS},
        step_ms={k: round(1e3 * v, 2) for k, v in times.items()},
        sources=SOURCES,
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
