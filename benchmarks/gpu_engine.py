"""The engine on one GPU: step time against a hand-written step, and training MFU.

Run on a machine with a GPU: `python benchmarks/gpu_engine.py`. Every figure and its baseline
are measured in the same run:
  1. overhead: `engine.train_step` vs the hand-written `jax.jit` step of `overhead.py`, on a
     GPT of about 150M params (d_model 1024, 12 layers, seq 1024, 16 sequences), fp32 weights
     and compute, timed interleaved; ratio = baseline step time / jaxspeed step time.
  2. throughput: `jaxspeed train` on `configs/bench_tiny_llama.yaml` (8 sequences of 256,
     bf16, full remat, ZeRO-3 on a one-device mesh), tokens/s aggregated like `throughput.py`
     and turned into model FLOP/s: the matmul FLOPs of one step without remat's recomputed
     forward (`Engine.step_flops` of the same config with remat off, the MFU convention of
     PaLM, Chowdhery et al. 2022, App. B) times steps per second. Baseline: the best bf16
     matmul rate this GPU reaches in the same run (square products, up to 16384).
     ratio = model FLOP/s / measured matmul FLOP/s: MFU against a peak this chip reaches.
     `mfu_vs_spec` divides by the spec sheet's dense bf16 peak (`jaxspeed.cost.peaks.PEAK_FLOPS`,
     e.g. 989 TFLOP/s for an H100/H200 SXM; null for a chip not in the table), and
     `hfu_vs_measured` counts the recomputed forward too.
The last line is the overhead headline. `--cpu-check` (or `--quick`) runs both cases at tiny
sizes on one CPU device: a smoke test of the code, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "gpu_engine"
GPU_CASE = {
    "overhead": {"model": {"vocab_size": 32768, "d_model": 1024, "n_layers": 12, "n_heads": 16,
                           "d_ff": 4096, "max_seq_len": 1024},
                 "seq_len": 1024, "micro": 16, "steps": 20, "warmup": 3},
    "throughput": {"micro": 8, "steps": 20, "skip": 5, "overrides": []},
    "matmul": {"sizes": (4096, 8192, 16384), "iters": 10, "rounds": 3},
}
CPU_CHECK = {
    "overhead": {"model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4,
                           "d_ff": 256, "max_seq_len": 32},
                 "seq_len": 32, "micro": 1, "steps": 3, "warmup": 1},
    "throughput": {"micro": 2, "steps": 4, "skip": 2,
                   "overrides": ["data.seq_len=64", "data.max_bytes=400000"]},
    "matmul": {"sizes": (256,), "iters": 2, "rounds": 1},
}


def ratio_of(better: float, worse: float) -> float:
    """`better / worse` to 4 significant digits (`_common.ratio` keeps 3 decimals, which
    rounds a small utilisation to 0)."""
    return float(f"{better / worse:.4g}") if worse else float("nan")


def matmul_peak(*, sizes: tuple[int, ...], iters: int, rounds: int) -> dict[int, float]:
    """FLOP/s of square bf16 matmuls `[n, n] @ [n, n]` (fp32 accumulation), by `n`.

    Timed as every figure here is (`_common.timed`: median over rounds of back-to-back calls).
    """
    import jax
    import jax.numpy as jnp

    matmul = jax.jit(jnp.matmul)
    rates = {}
    for n in sizes:
        a, b = (jax.random.normal(key, (n, n), jnp.bfloat16)
                for key in jax.random.split(jax.random.key(n)))
        ms = _common.timed(matmul, (a, b), iters=iters, rounds=rounds)
        rates[n] = 2 * n**3 / (ms * 1e-3)
    return rates


def overhead_case(case: dict) -> dict:
    """`engine.train_step` and the hand-written step, same params and batch, timed interleaved."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import overhead
    from jaxspeed.train.engine import initialize
    from jaxspeed.models import build_gpt

    config = overhead.bench_config(case)
    engine = initialize(config)
    rows, seq_len = engine.batch_sizes.train_batch_size, case["seq_len"]
    tokens = np.random.default_rng(0).integers(0, case["model"]["vocab_size"], (rows, seq_len + 1))
    batch = engine.shard_batch({"inputs": tokens[:, :-1].astype(np.int32),
                                "targets": tokens[:, 1:].astype(np.int32)})
    state = engine.init(jax.random.key(0))
    tx, step = overhead.baseline_step(build_gpt(config.model))
    params = jax.tree.map(jnp.copy, state.params)
    holder = {"js": state, "base": (params, tx.init(params))}
    base = jax.jit(step, donate_argnums=(0, 1))

    def run_js():
        holder["js"], m = engine.train_step(holder["js"], batch)
        return m["loss"]

    def run_base():
        p, o, loss = base(*holder["base"], batch)
        holder["base"] = (p, o)
        return loss

    first = {"js": float(run_js()), "base": float(run_base())}
    for _ in range(case["warmup"]):
        jax.block_until_ready((run_js(), run_base()))
    times = {"js": [], "base": []}
    for i in range(case["steps"]):
        order = (("js", run_js), ("base", run_base))
        for key, fn in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[key].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    flops = engine.step_flops()  # no remat in this config: model FLOPs
    m = case["model"]
    return _common.result(
        NAME, case=(f"overhead gpt d_model={m['d_model']} layers={m['n_layers']} seq={seq_len} "
                    f"batch={rows} fp32 {jax.devices()[0].device_kind}"),
        jaxspeed=med["js"], baseline=med["base"], unit="ms/step (median)",
        ratio=_common.ratio(med["base"], med["js"]), first_loss=first,
        jaxspeed_tokens_per_s=round(rows * seq_len / (med["js"] / 1e3)),
        model_tflops={"jaxspeed": round(flops / med["js"] / 1e9, 3),
                      "baseline": round(flops / med["base"] / 1e9, 3)},
        device=str(jax.devices()[0]),
    )


def throughput_config(case: dict, *overrides: str):
    """`bench_tiny_llama.yaml` on one device, `case["micro"]` sequences per step."""
    import throughput
    from jaxspeed.config import load_config

    return load_config(throughput.CONFIG, overrides=[
        "logging.every_n_steps=1", "mesh.data=1",
        f"train_micro_batch_size_per_device={case['micro']}", *case["overrides"], *overrides,
    ])


def throughput_case(case: dict, matmul: dict[int, float]) -> dict:
    """`jaxspeed train` tokens/s as model FLOP/s, against the measured matmul peak `matmul`."""
    import jax

    import throughput
    from jaxspeed.train.engine import initialize
    from jaxspeed.cost.peaks import peak_flops
    from jaxspeed.train.loop import train

    config = throughput_config(case)
    engine = initialize(config)
    tokens_per_step = engine.batch_sizes.train_batch_size * config.data.seq_len
    hardware_flops = engine.step_flops()  # with the remat policy's recomputed forward
    model_flops = initialize(throughput_config(
        case, "activation_checkpointing.policy=none")).step_flops()
    with tempfile.TemporaryDirectory(prefix="jaxspeed-gpu-engine-") as out:
        train(config, output_dir=out, steps=case["steps"], progress=False)
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    tokens_per_s, counted = throughput.aggregate(
        records, tokens_per_step=tokens_per_step, skip=case["skip"])
    steps_per_s = tokens_per_s / tokens_per_step
    achieved, measured = model_flops * steps_per_s, max(matmul.values())
    device = jax.devices()[0]
    spec = peak_flops(device.device_kind)
    m = config.model
    return _common.result(
        NAME,
        case=(f"throughput tiny llama d_model={m.d_model} layers={m.n_layers} "
              f"{tokens_per_step} tokens/step bf16 remat={config.activation_checkpointing.policy} "
              f"{device.device_kind}"),
        jaxspeed=achieved / 1e12, baseline=measured / 1e12, unit="TFLOP/s",
        ratio=ratio_of(achieved, measured),
        baseline_source="best bf16 matmul in this run",
        mfu_vs_spec=None if spec is None else ratio_of(achieved, spec),
        spec_peak_tflops=None if spec is None else spec / 1e12,
        hfu_vs_measured=ratio_of(hardware_flops * steps_per_s, measured),
        matmul_tflops={n: round(r / 1e12, 3) for n, r in matmul.items()},
        tokens_per_s=round(tokens_per_s, 1), steps_counted=counted,
        model_flops_per_step=model_flops, hardware_flops_per_step=hardware_flops,
        device=str(device),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-check", action="store_true",
                        help="tiny sizes on one CPU device (a smoke test, not a measurement)")
    parser.add_argument("--quick", action="store_true", help="the same as --cpu-check")
    args = parser.parse_args(argv)
    cpu_check = args.cpu_check or args.quick
    if cpu_check:
        _common.use_cpu_devices(1)

    import jax

    from pallas_kernels import backend as _backend

    if not _backend.on_gpu() and not cpu_check:
        raise SystemExit(f"gpu_engine needs a GPU (JAX sees {jax.devices()}); `--cpu-check` "
                         "runs it at tiny sizes on one CPU device")
    case = CPU_CHECK if cpu_check else GPU_CASE
    device = jax.devices()[0]
    print(f"The engine on {device.device_kind} ({device.platform})"
          + ("; CPU check at tiny sizes, not a measurement" if cpu_check else ""))
    matmul = matmul_peak(**case["matmul"])
    results = [throughput_case(case["throughput"], matmul), overhead_case(case["overhead"])]
    _common.print_table(
        ["case", "jaxspeed", "baseline", "unit", "ratio"],
        [[r["case"].split()[0], r["jaxspeed"], r["baseline"], r["unit"], r["ratio"]]
         for r in results],
    )
    spec = results[0]["mfu_vs_spec"]
    print(f"MFU of the throughput case: {results[0]['ratio']:.2%} of the measured bf16 matmul "
          f"peak ({results[0]['baseline']} TFLOP/s), "
          + (f"{spec:.2%} of the spec peak ({results[0]['spec_peak_tflops']} TFLOP/s)"
             if spec is not None else "no spec peak known for this chip"))
    print()
    for r in results:
        _common.print_json(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
