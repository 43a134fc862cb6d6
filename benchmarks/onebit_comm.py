"""Gradient-path bytes per step: Adam against 1-bit Adam after the freeze, data=8, ~10M params.

Counted from the compiled HLO (`jaxspeed.profiler.collective_bytes`, per device, per step):
- Adam: the step's gradient all-reduce (XLA inserts it for the data-parallel mean);
- 1-bit Adam after `freeze_step`: the compressed step's all-to-all of packed sign bits and
  scales and its all-gather of the recompressed chunks (plus two scalar all-reduces for the loss
  and grad-norm metrics, counted too).

Two conventions: `buffer` bytes (the size of each collective's data, the profiler's figure) and
`wire` bytes of ring algorithms (all-reduce 2(N-1)/N of its buffer, all-to-all and all-gather
(N-1)/N). In buffer bytes 1-bit's all-to-all + all-gather of 1/32 of the fp32 gradient each give
at most 16x; on the wire an all-reduce moves its buffer twice, so the limit is 32x.
Also: whole-run reduction with a 20% warm-up, and step times side by side.
Headline: ratio = Adam wire bytes / 1-bit wire bytes per step after the freeze. XLA's
auto-partitioned Adam step moves a little more than the fp32 gradients (the tied embedding's
gradient); `gradient_allreduce_ratio` compares with the warm-up's exact fp32 all-reduce instead.
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
WARMUP_FRACTION = 0.2


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


def wire_bytes(moved: dict, devices: int) -> float:
    share = (devices - 1) / devices
    return (2 * moved["all-reduce"] + moved["all-to-all"] + moved["all-gather"]
            + moved["reduce-scatter"] + moved["collective-permute"]) * share


def step_time(engine, *, start: int, steps: int) -> float:
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
    _common.use_cpu_devices()
    from jaxspeed.engine import initialize
    from jaxspeed.models.gpt import count_params
    from jaxspeed.profiler import collective_bytes

    model = QUICK_MODEL if args.quick else FULL_MODEL
    freeze = 10
    adam = initialize(bench_config({"type": "Adam", "params": {"lr": 1e-3}}, model))
    onebit = initialize(bench_config(
        {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": freeze}}, model
    ))
    n = _common.DEVICES
    moved = {
        "adam": adam.profile()["collective_bytes"],
        "warmup": onebit.profile()["collective_bytes"],
        "compressed": collective_bytes(onebit.compile_train_step(step=freeze).as_text(), num_devices=n),
    }
    wire = {k: wire_bytes(v, n) for k, v in moved.items()}
    times = {
        "adam": step_time(adam, start=0, steps=args.steps),
        "compressed": step_time(onebit, start=freeze, steps=args.steps),
    }
    params = count_params(adam.abstract_state().params)
    whole_run = 1 / (WARMUP_FRACTION * wire["warmup"] / wire["adam"]
                     + (1 - WARMUP_FRACTION) * wire["compressed"] / wire["adam"])
    print(f"{params:,} params, data={n}, per device per step (fp32 gradients = {4 * params:,} B)")
    _common.print_table(
        ["step", "all-reduce B", "all-to-all B", "all-gather B", "buffer B", "wire B", "step ms"],
        [[k, v["all-reduce"], v["all-to-all"], v["all-gather"], v["total"], wire[k],
          1e3 * times[k] if k in times else ""] for k, v in moved.items()],
    )
    ratio = _common.ratio(wire["adam"], wire["compressed"])
    gradient_ratio = _common.ratio(wire["warmup"], wire["compressed"])
    print(f"after the freeze: {ratio}x fewer wire bytes "
          f"({_common.ratio(moved['adam']['total'], moved['compressed']['total'])}x buffer bytes); "
          f"whole run with a {WARMUP_FRACTION:.0%} warm-up: {whole_run:.2f}x; against the "
          f"1-bit warm-up's plain fp32 gradient all-reduce: {gradient_ratio}x")
    _common.print_json(_common.result(
        NAME,
        case=f"params={params} devices={n} after freeze",
        jaxspeed=wire["compressed"],
        baseline=wire["adam"],
        unit="wire bytes/step/device",
        ratio=ratio,
        buffer_ratio=_common.ratio(moved["adam"]["total"], moved["compressed"]["total"]),
        whole_run_ratio=round(whole_run, 3),
        gradient_allreduce_ratio=gradient_ratio,
        collective_bytes=moved,
        step_ms={k: round(1e3 * v, 2) for k, v in times.items()},
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
