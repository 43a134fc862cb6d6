"""The engine on one GPU: step time vs a hand-written `jax.jit` step, and training tokens/s.

Run on a machine with a GPU: `python benchmarks/gpu_engine.py`. Two cases, each side by side in
one run:
  1. overhead: `engine.train_step` vs the hand-written step of `overhead.py`, on a GPT of about
     150M params (d_model 1024, 12 layers, seq 1024, 16 sequences), fp32 weights and compute;
  2. throughput: `jaxspeed train` on `configs/bench_tiny_llama.yaml` (8 sequences of 256, bf16,
     full remat, ZeRO-3 on a mesh of one device), aggregated like `throughput.py`.
The last line is the overhead headline (ratio = baseline step time / jaxspeed step time).
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

GPU_CASE = {
    "model": {"vocab_size": 32768, "d_model": 1024, "n_layers": 12, "n_heads": 16, "d_ff": 4096,
              "max_seq_len": 1024},
    "seq_len": 1024, "micro": 16, "steps": 20, "warmup": 3,
}


def overhead_case(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import overhead
    from jaxspeed.engine import initialize
    from jaxspeed.models import build_gpt

    config = overhead.bench_config(case)
    engine = initialize(config)
    rows, seq_len = engine.batch_sizes.train_batch_size, case["seq_len"]
    tokens = np.random.default_rng(0).integers(0, case["model"]["vocab_size"], (rows, seq_len + 1))
    batch = engine.shard_batch({"inputs": tokens[:, :-1].astype(np.int32),
                                "targets": tokens[:, 1:].astype(np.int32)})
    state = engine.init(jax.random.key(0))
    tx, step = overhead.baseline_step(build_gpt(config.model))
    base_state = jax.tree.map(jnp.copy, state.params), None
    base_state = base_state[0], tx.init(base_state[0])
    base = jax.jit(step, donate_argnums=(0, 1))
    holder = {"js": state, "base": base_state}

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
    tokens_per_s = rows * seq_len / (med["js"] / 1e3)
    return _common.result(
        "gpu_overhead", case=f"gpt d_model=1024 layers=12 seq=1024 batch={rows} fp32 1 GPU",
        jaxspeed=med["js"], baseline=med["base"], unit="ms/step (median)",
        ratio=_common.ratio(med["base"], med["js"]), first_loss=first,
        jaxspeed_tokens_per_s=round(tokens_per_s), device=str(jax.devices()[0]),
    )


def throughput_case(steps: int = 20, skip: int = 5) -> dict:
    import jax

    import throughput
    from jaxspeed.config import load_config
    from jaxspeed.train_loop import train

    config = load_config(throughput.CONFIG, overrides=[
        "logging.every_n_steps=1", "mesh.data=1", "train_micro_batch_size_per_device=8",
    ])
    with tempfile.TemporaryDirectory() as out:
        train(config, output_dir=out, steps=steps, progress=False)
        records = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    tokens_per_s, _ = throughput.aggregate(records, tokens_per_step=8 * 256, skip=skip)
    return _common.result(
        "gpu_throughput", case="bench_tiny_llama, 8x256 tokens/step, bf16, full remat, 1 GPU",
        jaxspeed=tokens_per_s, baseline=throughput.MAXTEXT_TOKENS_PER_S, unit="tokens/s",
        ratio=_common.ratio(tokens_per_s, throughput.MAXTEXT_TOKENS_PER_S),
        baseline_source="MaxText's CPU figure from the issue (no GPU baseline measured)",
        device=str(jax.devices()[0]),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small overhead case")
    args = parser.parse_args(argv)
    import jax

    from pallas_kernels import _backend

    if not _backend.on_gpu():
        raise SystemExit(f"gpu_engine needs a GPU; JAX sees {jax.devices()}")
    case = dict(GPU_CASE)
    if args.quick:
        case.update(model={**case["model"], "n_layers": 2, "d_model": 256, "n_heads": 4,
                           "d_ff": 1024}, steps=5, warmup=1)
    results = [throughput_case(), overhead_case(case)]
    _common.print_table(
        ["case", "jaxspeed", "baseline", "unit", "ratio"],
        [[r["benchmark"], r["jaxspeed"], r["baseline"], r["unit"], r["ratio"]] for r in results],
    )
    for r in results:
        _common.print_json(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
