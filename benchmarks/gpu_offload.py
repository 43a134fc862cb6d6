"""ZeRO-Offload on one GPU: the same train step offloaded vs not, step time and device memory.

For an NVIDIA H200 (or any GPU): the reference GPT (~1.3B parameters by default, bf16 compute
with fp32 masters, AdamW, full remat) on one device. Each mode runs in its own process, so the
device's `peak_bytes_in_use` belongs to that mode alone:

- `device`: everything in device memory (16 bytes/param of state);
- `opt`: `offload_optimizer: cpu`, the update on the device (state streamed in and out);
- `opt_host`: `offload_optimizer: {device: cpu, update_on: host}` (CPU-Adam);
- `all_host`: `opt_host` plus `offload_param: cpu` (stage 3): fp32 masters on the host too,
  the layers streamed one at a time (their gradients to the host as the backward pass makes
  them). This is the mode that checks, on real device memory, what `memory_report` can only
  model on CPU.

Prints a table and one JSON line per mode; the headline (last line) is `all_host` with
ratio = device-mode peak memory / all_host peak memory, both from this run, and its step-time
cost alongside. Every mode's memory is read the same way: the device's `peak_bytes_in_use`
where every mode has it (a GPU), else (a CPU) the compiled step's device bytes.
`--modes` runs a subset (the baseline, `device`, always among them); `--quick` runs a tiny model
on one CPU device (a smoke test, not a measurement).

Run from the repository root: `python benchmarks/gpu_offload.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "gpu_offload"
MODES = {
    "device": {},
    "opt": {"offload_optimizer": {"device": "cpu"}},
    "opt_host": {"offload_optimizer": {"device": "cpu", "update_on": "host"}},
    "all_host": {
        "offload_optimizer": {"device": "cpu", "update_on": "host"},
        "offload_param": {"device": "cpu"},
    },
}
FULL_MODEL = {"d_model": 2048, "n_layers": 24, "n_heads": 16, "d_ff": 8192, "seq_len": 2048, "micro": 4}
QUICK_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 2, "d_ff": 256, "seq_len": 64, "micro": 2}


def bench_config(mode: str, model: dict):
    from jaxspeed.config import load_config

    return load_config({
        "mesh": {"pipe": 1, "data": 1, "expert": 1, "tensor": 1},
        "train_micro_batch_size_per_device": model["micro"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, **MODES[mode]},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "activation_checkpointing": {"policy": "full"},
        "model": {
            "type": "gpt", "vocab_size": 256, "d_model": model["d_model"],
            "n_layers": model["n_layers"], "n_heads": model["n_heads"], "d_ff": model["d_ff"],
            "max_seq_len": model["seq_len"],
        },
        "data": {"source": "stdlib", "seq_len": model["seq_len"]},
    })


def run_mode(mode: str, model: dict, steps: int) -> dict:
    """Inside the child process: compile, train `steps` steps, read time and memory."""
    import jax
    import numpy as np

    from jaxspeed.train.engine import initialize
    from jaxspeed.models.gpt import count_params

    engine = initialize(bench_config(mode, model))
    report = engine.memory_report()
    state = engine.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    shape = (engine.batch_sizes.train_batch_size, model["seq_len"])
    times = []
    for _ in range(steps + 2):
        tokens = rng.integers(0, 256, shape, dtype=np.int32)
        start = time.perf_counter()
        state, metrics = engine.train_step(state, {"inputs": tokens, "targets": tokens})
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    stats = jax.local_devices()[0].memory_stats() or {}
    return {
        "mode": mode,
        "n_params": count_params(state.params),
        "step_s": statistics.median(times[2:]),
        "loss": float(metrics["loss"]),
        "peak_bytes": stats.get("peak_bytes_in_use", 0),
        "compiled_device_bytes": report["per_device_bytes"]["device"],
        "host_bytes": report["host_bytes"],
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, one CPU device (smoke test)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="modes to run, 'device' (the baseline) among them (default: all)")
    parser.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)  # child
    args = parser.parse_args(argv)
    if "device" not in args.modes:
        parser.error(f"--modes must include 'device', the baseline; got {args.modes}")
    model = QUICK_MODEL if args.quick else FULL_MODEL
    if args.quick:  # one device, as on the GPU; the mode processes inherit the setting
        _common.use_cpu_devices(1)
    if args.mode:
        print(json.dumps(run_mode(args.mode, model, args.steps)), flush=True)
        return 0

    rows = []
    for mode in (m for m in MODES if m in args.modes):
        cmd = [sys.executable, __file__, "--mode", mode, "--steps", str(args.steps)]
        proc = subprocess.run(
            cmd + (["--quick"] if args.quick else []),
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                filter(None, [str(_HERE.parent), os.environ.get("PYTHONPATH")]))},
        )
        if proc.returncode != 0:
            print(f"{mode}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            rows.append({"mode": mode, "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    ok = {r["mode"]: r for r in rows if "error" not in r}
    mib = _common.mib
    _common.print_table(
        ["mode", "params", "step s", "peak MiB", "compiled device MiB", "host MiB", "loss"],
        [[r["mode"], r["n_params"], r["step_s"], mib(r["peak_bytes"]),
          mib(r["compiled_device_bytes"]), mib(r["host_bytes"]), r["loss"]] for r in ok.values()],
    )
    base = ok.get("device")
    # One source for every mode, so that each ratio divides like by like.
    source = "peak_bytes" if all(r["peak_bytes"] for r in ok.values()) else "compiled_device_bytes"
    for mode, r in ok.items():
        if base is None:
            break
        _common.print_json(_common.result(
            NAME,
            case=f"mode={mode} params={r['n_params']} {r['device_kind']}",
            jaxspeed=mib(r[source]),
            baseline=mib(base[source]),
            unit="MiB peak device memory",
            ratio=_common.ratio(base[source], r[source]),
            memory_source=source,
            step_time_ratio=_common.ratio(r["step_s"], base["step_s"]),
            step_s=r["step_s"],
            baseline_step_s=base["step_s"],
        ))
    return 0 if len(ok) == len(args.modes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
