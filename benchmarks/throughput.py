"""Training tokens/s of `jaxspeed train` on a llama-style tiny model, against MaxText's figure.

`configs/bench_tiny_llama.yaml`: 4 layers, d_model 256, 4 heads of 64, SwiGLU d_ff 1024, vocab
512, untied output, RMSNorm, rotary; one sequence of 256 tokens per device, 8 emulated CPU
devices, ZeRO-3, fp32 weights, bf16 activations, full remat. The run is
`jaxspeed.train_loop.train(...)` with a metrics line every step; tokens/s is aggregated over
steps 5–19 (0-based, i.e. after 5 steps of compile and warm-up) as total tokens / total time.

The baseline is MaxText's published figure for this model on these machines, 5,100 tokens/s.
MaxText is not installed here, so it is not re-run: the figure is a constant. Headline:
ratio = jaxspeed tokens/s / 5,100.

The run also reports the machine's ceiling for this model: the best fp32 matmul rate measured
here (XLA's and OpenBLAS's, all cores) over the step's matmul FLOPs per token
(`Engine.step_flops`, rematerialised passes included). No trainer can run faster than that on
this machine, whatever its overheads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "throughput"
CONFIG = _common.ROOT / "configs" / "bench_tiny_llama.yaml"
MAXTEXT_TOKENS_PER_S = 5100.0
FULL = {"steps": 20, "skip": 5, "overrides": [], "peak_sizes": (2048, 4096)}
# A shorter sequence, a smaller slice of the corpus and fewer steps: same code path, seconds.
QUICK = {
    "steps": 4, "skip": 2, "overrides": ["data.seq_len=64", "data.max_bytes=400000"],
    "peak_sizes": (256,),
}


def aggregate(records: list[dict], *, tokens_per_step: int, skip: int) -> tuple[float, int]:
    """Tokens/s over the records after the first `skip` steps: total tokens / total time.

    Each record's `tokens_per_second` covers the steps since the previous record, so its time is
    tokens / rate; summing times (not averaging rates) weights every step by its duration.

    Returns:
      (tokens per second, number of steps aggregated).
    """
    seconds, steps, last = 0.0, 0, 0
    for record in records:
        done = int(record["step"])
        span = done - last
        if last >= skip:
            seconds += tokens_per_step * span / float(record["tokens_per_second"])
            steps += span
        last = done
    if not steps:
        raise SystemExit(f"no logged steps after the first {skip}; run more steps")
    return tokens_per_step * steps / seconds, steps


def matmul_peak_gflops(sizes: tuple[int, ...], *, repeats: int = 3) -> dict[str, float]:
    """The best square fp32 matmul rate on this machine, in GFLOP/s, over `sizes`.

    Both XLA's dot (one device; XLA:CPU spreads it over all cores) and numpy's OpenBLAS (all
    cores) are timed, each at its best of `repeats` calls after one untimed call.
    """
    import jax
    import jax.numpy as jnp

    def best_seconds(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    rates = {"xla": 0.0, "openblas": 0.0}
    matmul = jax.jit(jnp.matmul)
    rng = np.random.default_rng(0)
    for n in sizes:
        a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        flops = 2 * n**3
        rates["xla"] = max(rates["xla"], flops / best_seconds(
            lambda: matmul(ja, jb).block_until_ready()) / 1e9)
        rates["openblas"] = max(rates["openblas"], flops / best_seconds(lambda: a @ b) / 1e9)
    return rates


def roofline(*, flops_per_token: float, peak_gflops: float, tokens_per_s: float) -> dict:
    """What the machine allows: tokens/s at `peak_gflops`, and the rates the figures need."""
    return {
        "flops_per_token": flops_per_token,
        "matmul_peak_gflops": round(peak_gflops, 1),
        "ceiling_tokens_per_s": round(peak_gflops * 1e9 / flops_per_token, 1),
        "achieved_gflops": round(tokens_per_s * flops_per_token / 1e9, 1),
        "baseline_needs_gflops": round(MAXTEXT_TOKENS_PER_S * flops_per_token / 1e9, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 64, 4 steps (tests)")
    parser.add_argument("--steps", type=int, default=None, help="steps to train (default 20)")
    parser.add_argument(
        "--skip", type=int, default=None, help="first steps left out of the average (default 5)"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key (e.g. --set bf16.enabled=false) to profile a variant",
    )
    args = parser.parse_args(argv)
    _common.use_cpu_devices()

    import jax

    from jaxspeed.config import load_config, resolve_batch
    from jaxspeed.engine import initialize
    from jaxspeed.mesh import data_parallel_size, make_mesh
    from jaxspeed.train_loop import train

    case = QUICK if args.quick else FULL
    steps = args.steps or case["steps"]
    skip = case["skip"] if args.skip is None else args.skip
    if not 0 <= skip < steps:
        raise SystemExit(f"--skip must be in [0, steps={steps}), got {skip}")
    overrides = ["logging.every_n_steps=1", *case["overrides"], *args.overrides]
    config = load_config(CONFIG, overrides=overrides)
    batch = resolve_batch(config, data_parallel_size(make_mesh(config.mesh)))
    tokens_per_step = batch.train_batch_size * config.data.seq_len
    flops_per_token = initialize(config).step_flops() / tokens_per_step

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxspeed-throughput-") as out:
        train(config, output_dir=out, steps=steps, progress=False)
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    wall = time.perf_counter() - start
    # After training, so that OpenBLAS's idle worker threads cannot slow the timed steps.
    peaks = matmul_peak_gflops(case["peak_sizes"])
    records = [json.loads(line) for line in lines if line.strip()]
    tokens_per_s, counted = aggregate(records, tokens_per_step=tokens_per_step, skip=skip)
    first_s = tokens_per_step / float(records[0]["tokens_per_second"])
    r = _common.ratio(tokens_per_s, MAXTEXT_TOKENS_PER_S)
    roof = roofline(
        flops_per_token=flops_per_token, peak_gflops=max(peaks.values()), tokens_per_s=tokens_per_s
    )

    m = config.model
    variant = " ".join(args.overrides) or "as configured"
    print(
        f"Training throughput: {CONFIG.relative_to(_common.ROOT)} ({variant}); llama-style "
        f"{m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, {m.mlp} d_ff {m.d_ff}, "
        f"vocab {m.vocab_size}; {jax.device_count()} devices, "
        f"ZeRO-{config.zero_optimization.stage}, "
        f"bf16 {config.bf16.enabled}, remat {config.activation_checkpointing.policy}, "
        f"{batch.train_batch_size} x {config.data.seq_len} tokens per step"
    )
    print(
        f"{steps} steps in {wall:.1f} s (first step incl. compile {first_s:.1f} s); tokens/s over "
        f"steps {skip}-{steps - 1} ({counted} steps) = total tokens / total time. Baseline: "
        "MaxText's published figure on these machines (MaxText is not installed here; not re-run)."
    )
    print()
    _common.print_table(
        ["training throughput", "tokens/s"],
        [
            ["jaxspeed train", tokens_per_s],
            ["MaxText (published)", MAXTEXT_TOKENS_PER_S],
            ["ratio (jaxspeed / MaxText)", r],
            ["machine ceiling (matmul peak / FLOPs per token)", roof["ceiling_tokens_per_s"]],
        ],
    )
    print(
        f"\nRoofline: {flops_per_token / 1e6:.2f} MFLOP per token (matmuls, remat included). "
        f"Best fp32 matmul here: XLA {peaks['xla']:.1f}, OpenBLAS {peaks['openblas']:.1f} "
        f"GFLOP/s (sizes {', '.join(map(str, case['peak_sizes']))}). jaxspeed runs at "
        f"{roof['achieved_gflops']} GFLOP/s; {MAXTEXT_TOKENS_PER_S:,.0f} tokens/s would need "
        f"{roof['baseline_needs_gflops']} GFLOP/s."
    )
    print()
    _common.print_json(_common.result(
        NAME,
        case=(f"tiny llama d_model={m.d_model} layers={m.n_layers} seq={config.data.seq_len} "
              f"devices={jax.device_count()} zero={config.zero_optimization.stage} "
              f"bf16={config.bf16.enabled} remat={config.activation_checkpointing.policy}"
              + (f" [{variant}]" if args.overrides else "")),
        jaxspeed=tokens_per_s, baseline=MAXTEXT_TOKENS_PER_S, unit="tokens/s", ratio=r,
        steps=steps, steps_counted=counted, tokens_per_step=tokens_per_step,
        step_ms=round(1e3 * tokens_per_step / tokens_per_s, 2), first_step_s=round(first_s, 2),
        baseline_source="MaxText published figure (not re-run; MaxText not installed)",
        matmul_peak_gflops_by_library={k: round(v, 1) for k, v in peaks.items()},
        **roof,
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
