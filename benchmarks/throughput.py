"""Training tokens/s of `jaxspeed train` on a llama-style tiny model, with MaxText run beside it.

`configs/bench_tiny_llama.yaml`: 4 layers, d_model 256, 4 heads of 64, SwiGLU d_ff 1024, vocab
512, untied output, RMSNorm, rotary; one sequence of 256 tokens per device on 8 emulated CPU
devices, fp32 weights. Three configurations of it (`CONFIGS`):
  1. fsdp8: ZeRO-3 over data 8 (MaxText's FSDP 8), bf16 activations, full remat (the headline);
  2. data8_zero1: ZeRO-1 over data 8 (MaxText's data 8 + `shard_optimizer_over_data`), fp32,
     no remat;
  3. fsdp4_tensor2: ZeRO-3 over data 4 x tensor 2 (MaxText's FSDP 4 x tensor 2), bf16, full
     remat, two sequences per data replica.
Every configuration trains 8 sequences (2,048 tokens) per step.
jaxspeed runs `jaxspeed.train.loop.train(...)` with a metrics line every step. With
`--maxtext PYTHON` (a Python with MaxText installed: `make maxtext`), MaxText trains the same
model, mesh, precision and remat (`maxtext_peer.options`) on synthetic tokens. The two run
alternately, `--rounds` times each (jaxspeed, MaxText, jaxspeed, MaxText), each run a fresh
training of 20 steps. Tokens/s of a run is total tokens / total time over steps 5-19 (0-based,
after 5 steps of compile and warm-up), the same statistic for both; a configuration's figure is
its best run (a shared machine only ever slows a run down).
Headline: fsdp8, ratio = jaxspeed tokens/s / MaxText tokens/s, both measured here. Without
`--maxtext` nothing is compared and the lines carry no ratio.

Both trainers run under one host allocator: this process keeps freed memory
(`jaxspeed.keep_freed_memory`, as the `jaxspeed` command does), and MaxText's process gets the
same settings as glibc tunables (`host_allocator` and `baseline_host_allocator` in the JSON), so
the ratio compares trainers, not allocators. `--maxtext-system-allocator` also times MaxText
under glibc's defaults, as it runs on its own (`baseline_system_allocator`,
`ratio_system_allocator`).

Each line also reports the machine's matmul peak, measured in the same run: the best square
fp32 matmul rate (XLA's and OpenBLAS's, all cores). XLA's rates are timed after every jaxspeed
run and OpenBLAS's once at the end, and each library's best is kept, as each trainer's best
run is: the VM's speed drifts from minute to minute (the fp32 peak has measured 330 GFLOP/s
in one run and 470 in another), so a peak timed once can land in a slow moment
(`matmul_peak_gflops_xla_samples` lists XLA's fp32 timings). `peak_fraction` = the matmul
FLOP/s jaxspeed achieves (tokens/s x the step's matmul FLOPs per token, `Engine.step_flops`,
rematerialised passes included) / that peak, and `ceiling_tokens_per_s` = peak / FLOPs per
token: no trainer runs faster on this machine, whatever its overheads. Where the CPU has bf16
matmul units (AVX-512 BF16), a bf16 matmul runs faster than an fp32 one, so the bf16
configurations also report `peak_fraction_bf16`, against XLA's best bf16 matmul measured in the
same run. On a CPU without bf16 matmul units, jaxspeed's bf16 dots take fp32 operands
(`jaxspeed.ops.matmul`; the JSON's `bf16_dot_operands` says which ran); MaxText's dots run as XLA
gives them.

`dots_alone_fraction` says how much of the gap to the peak is the matmuls' own: the step's
dots, read from its compiled program and run alone on the same devices (`_step_dots`), as a
fraction of the same peak. `of_dots_alone` = jaxspeed's matmul FLOP/s / that rate; the rest of
the gap is the step's other work (norms, softmax, casts, collectives, the optimizer).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402
import _step_dots  # noqa: E402
import maxtext_peer  # noqa: E402

NAME = "throughput"
CONFIG = _common.ROOT / "configs" / "bench_tiny_llama.yaml"
#: name: (what it is, overrides of CONFIG). The last is printed last: the headline.
CONFIGS = {
    "data8_zero1": ("data 8 (ZeRO-1), fp32, no remat", [
        "zero_optimization.stage=1", "bf16.enabled=false", "activation_checkpointing.policy=none"]),
    # Two sequences per data replica: the same 8 x 256 tokens per step as the others.
    "fsdp4_tensor2": ("FSDP 4 x tensor 2 (ZeRO-3), bf16, full remat",
                      ["mesh.data=4", "mesh.tensor=2", "train_micro_batch_size_per_device=2"]),
    "fsdp8": ("FSDP 8 (ZeRO-3), bf16, full remat", []),
}
FULL = {"steps": 20, "skip": 5, "rounds": 2, "overrides": [], "peak_sizes": (2048, 4096),
        "configs": tuple(CONFIGS)}
# A shorter sequence, a smaller slice of the corpus and fewer steps: same code path, seconds.
QUICK = {
    "steps": 4, "skip": 2, "rounds": 1, "overrides": ["data.seq_len=64", "data.max_bytes=400000"],
    "peak_sizes": (256,), "configs": ("fsdp8",),
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


#: What `matmul_peak_gflops` can time.
LIBRARIES = ("xla", "openblas", "xla_bf16")
#: What is timed again after every jaxspeed run (OpenBLAS once, at the end: see `main`).
XLA_PEAKS = ("xla", "xla_bf16")


def matmul_peak_gflops(sizes: tuple[int, ...], *, repeats: int = 3,
                       libraries: tuple[str, ...] = LIBRARIES) -> dict[str, float]:
    """The best square matmul rate on this machine, in GFLOP/s, over `sizes`.

    fp32: XLA's dot (one device; XLA:CPU spreads it over all cores) and numpy's OpenBLAS (all
    cores); bf16: XLA's dot with fp32 accumulation, as the bf16 configurations compute. Each
    at its best of `repeats` calls after one untimed call; only `libraries` are timed.
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

    rates = dict.fromkeys(libraries, 0.0)
    matmul = jax.jit(functools.partial(jnp.matmul, preferred_element_type=jnp.float32))
    rng = np.random.default_rng(0)
    for n in sizes:
        a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
        flops = 2 * n**3
        for name, dtype in (("xla", jnp.float32), ("xla_bf16", jnp.bfloat16)):
            if name not in rates:
                continue
            ja, jb = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
            rates[name] = max(rates[name], flops / best_seconds(
                lambda: matmul(ja, jb).block_until_ready()) / 1e9)
        if "openblas" in rates:
            rates["openblas"] = max(rates["openblas"], flops / best_seconds(lambda: a @ b) / 1e9)
    return rates


def best_of(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each library's best rate over the samples that timed it."""
    return {name: max(s[name] for s in samples if name in s) for name in LIBRARIES}


def roofline(*, flops_per_token: float, peak_gflops: float, tokens_per_s: float) -> dict:
    """What the machine allows: tokens/s at `peak_gflops`, and the share of it achieved."""
    achieved = tokens_per_s * flops_per_token / 1e9
    return {
        "flops_per_token": flops_per_token,
        "matmul_peak_gflops": round(peak_gflops, 1),
        "ceiling_tokens_per_s": round(peak_gflops * 1e9 / flops_per_token, 1),
        "achieved_gflops": round(achieved, 1),
        "peak_fraction": round(achieved / peak_gflops, 3),
    }


def maxtext_records(step_seconds: dict[int, float], tokens_per_step: int) -> list[dict]:
    """MaxText's {0-based step: seconds} as the records `aggregate` reads (one per step)."""
    return [{"step": step + 1, "tokens_per_second": tokens_per_step / seconds}
            for step, seconds in sorted(step_seconds.items())]


def train_jaxspeed(config, *, steps: int) -> list[dict]:
    """Trains `config` for `steps` steps in a scratch folder; returns its metrics records."""
    from jaxspeed.train.loop import train

    with tempfile.TemporaryDirectory(prefix="jaxspeed-throughput-") as out:
        train(config, output_dir=out, steps=steps, progress=False)
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fsdp8 only, seq 64, 4 steps (tests)")
    parser.add_argument("--maxtext", metavar="PYTHON", default=None,
                        help="a Python with MaxText installed (`make maxtext`): run it beside us")
    parser.add_argument("--maxtext-system-allocator", action="store_true",
                        help="with --maxtext: also time MaxText under glibc's default allocator")
    parser.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=None,
                        help="configurations to run (default: all three; --quick: fsdp8)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="runs of each trainer per configuration, alternating (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps to train (default 20)")
    parser.add_argument(
        "--skip", type=int, default=None, help="first steps left out of the average (default 5)"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key in every configuration (e.g. --set data.seq_len=128)",
    )
    args = parser.parse_args(argv)
    case = QUICK if args.quick else FULL
    steps = args.steps or case["steps"]
    skip = case["skip"] if args.skip is None else args.skip
    rounds = args.rounds or case["rounds"]
    names = [n for n in CONFIGS if n in (args.configs or case["configs"])]
    if not 0 <= skip < steps:
        raise SystemExit(f"--skip must be in [0, steps={steps}), got {skip}")
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")
    if args.maxtext:  # before any training, not after the first round
        try:
            maxtext_peer.base_config(args.maxtext)
        except RuntimeError as err:
            parser.error(f"--maxtext: {err}")
    _common.use_cpu_devices()

    import jax

    from jaxspeed.config import load_config, resolve_batch
    from jaxspeed.train.engine import initialize
    from jaxspeed.runtime.host_allocator import keep_freed_memory
    from jaxspeed.ops.matmul import widens_bf16
    from jaxspeed.runtime.mesh import data_parallel_size, make_mesh

    rows = []
    peak_samples: list[dict[str, float]] = []
    for name in names:
        about, config_overrides = CONFIGS[name]
        overrides = ["logging.every_n_steps=1", *case["overrides"], *config_overrides,
                     *args.overrides]
        config = load_config(CONFIG, overrides=overrides)
        mesh = make_mesh(config.mesh)
        batch = resolve_batch(config, data_parallel_size(mesh))
        tokens_per_step = batch.train_batch_size * config.data.seq_len
        engine = initialize(config)
        flops_per_token = engine.step_flops() / tokens_per_step
        peer = maxtext_peer.options(config) if args.maxtext else None
        if peer is not None:  # both trainers must train the same tokens per step
            peer_tokens = (float(peer["per_device_batch_size"]) * jax.device_count()
                           * int(peer["gradient_accumulation_steps"])
                           * int(peer["max_target_length"]))
            assert peer_tokens == tokens_per_step, (peer_tokens, tokens_per_step)
        runs = {"jaxspeed": [], "maxtext": [], "maxtext_system_allocator": []}
        for r in range(rounds):
            print(f"[{name}] round {r + 1}/{rounds}: jaxspeed", file=sys.stderr, flush=True)
            records = train_jaxspeed(config, steps=steps)
            runs["jaxspeed"].append(aggregate(records, tokens_per_step=tokens_per_step,
                                              skip=skip)[0])
            peak_samples.append(matmul_peak_gflops(case["peak_sizes"], libraries=XLA_PEAKS))
            if peer is not None:
                print(f"[{name}] round {r + 1}/{rounds}: MaxText", file=sys.stderr, flush=True)
                for key, same in (("maxtext", True), ("maxtext_system_allocator", False)):
                    if same or args.maxtext_system_allocator:
                        seconds = maxtext_peer.run(args.maxtext, peer, steps=steps,
                                                   same_allocator=same)
                        runs[key].append(aggregate(maxtext_records(seconds, tokens_per_step),
                                                   tokens_per_step=tokens_per_step, skip=skip)[0])
        dots = _step_dots.rate(engine.compile_train_step().as_text(), engine.mesh)
        rows.append({"name": name, "about": about, "config": config, "runs": runs, "peer": peer,
                     "dots_alone_gflops": dots["gflops"],
                     "mesh": " x ".join(f"{k} {v}" for k, v in mesh.shape.items() if v > 1),
                     "tokens_per_step": tokens_per_step, "flops_per_token": flops_per_token})
    # OpenBLAS after training, so that its idle worker threads cannot slow the timed steps.
    peak_samples.append(matmul_peak_gflops(case["peak_sizes"]))
    peaks = best_of(peak_samples)
    peak = max(peaks["xla"], peaks["openblas"])  # fp32: the peak every figure is held to

    print(
        f"Training throughput: {CONFIG.relative_to(_common.ROOT)}, llama-style, "
        f"{jax.device_count()} devices; {steps} steps per run, tokens/s over steps {skip}-"
        f"{steps - 1} = total tokens / total time, best of {rounds} run(s) per trainer, "
        + ("jaxspeed and MaxText alternating." if args.maxtext else
           "jaxspeed only (no --maxtext: nothing compared).")
        + (f" Overrides: {' '.join(args.overrides)}." if args.overrides else "")
    )
    if args.maxtext:
        print(f"Host allocator: jaxspeed {keep_freed_memory()}; MaxText "
              f"{maxtext_peer.allocator(same_allocator=True)}"
              + (", and glibc defaults (baseline_system_allocator)"
                 if args.maxtext_system_allocator else "") + ".")
    print(f"Matmul peak here (same run, best of {len(peak_samples)} timings, sizes "
          f"{', '.join(map(str, case['peak_sizes']))}): fp32 "
          f"XLA {peaks['xla']:.1f}, OpenBLAS {peaks['openblas']:.1f} GFLOP/s; bf16 XLA "
          f"{peaks['xla_bf16']:.1f} GFLOP/s. 'of matmul peak' is of the fp32 peak; "
          "'of bf16 peak' holds the bf16 configurations to the bf16 rate.\n")
    table = []
    for row in rows:
        best = {k: max(v) if v else None for k, v in row["runs"].items()}
        row["best"] = best
        row["roof"] = roofline(flops_per_token=row["flops_per_token"], peak_gflops=peak,
                               tokens_per_s=best["jaxspeed"])
        row["roof"].update(
            dots_alone_gflops=round(row["dots_alone_gflops"], 1),
            dots_alone_fraction=round(row["dots_alone_gflops"] / peak, 3),
            of_dots_alone=round(row["roof"]["achieved_gflops"] / row["dots_alone_gflops"], 3))
        if row["config"].bf16.enabled:
            row["roof"]["peak_fraction_bf16"] = round(
                row["roof"]["achieved_gflops"] / peaks["xla_bf16"], 3)
        table.append([
            f"{row['name']}: {row['about']}", best["jaxspeed"], best["maxtext"] or "-",
            _common.ratio(best["jaxspeed"], best["maxtext"]) if best["maxtext"] else "-",
            f"{row['roof']['peak_fraction']:.0%}",
            f"{row['roof']['peak_fraction_bf16']:.0%}" if "peak_fraction_bf16" in row["roof"]
            else "-", f"{row['roof']['dots_alone_fraction']:.0%}",
            row["roof"]["ceiling_tokens_per_s"],
        ])
    _common.print_table(["configuration", "jaxspeed tok/s", "MaxText tok/s", "ratio",
                         "of matmul peak", "of bf16 peak", "its dots alone", "ceiling tok/s"],
                        table)
    print()
    for row in rows:
        config, best = row["config"], row["best"]
        m = config.model
        case_text = (f"{row['name']}: tiny llama d_model={m.d_model} layers={m.n_layers} "
                     f"seq={config.data.seq_len} devices={jax.device_count()} "
                     f"mesh=({row['mesh']}) "
                     f"zero={config.zero_optimization.stage} bf16={config.bf16.enabled} "
                     f"remat={config.activation_checkpointing.policy}"
                     + (f" [{' '.join(args.overrides)}]" if args.overrides else ""))
        fields = dict(
            benchmark=NAME, case=case_text, jaxspeed=_common.round_figure(best["jaxspeed"]),
            unit="tokens/s", steps=steps, steps_counted=steps - skip,
            tokens_per_step=row["tokens_per_step"],
            runs={k: [round(v, 1) for v in vs] for k, vs in row["runs"].items() if vs},
            matmul_peak_gflops_by_library={k: round(v, 1) for k, v in peaks.items()},
            matmul_peak_gflops_xla_samples=[round(p["xla"], 1) for p in peak_samples],
            host_allocator=keep_freed_memory(),
            bf16_dot_operands="fp32 (widened)" if widens_bf16() else "bf16",
            **row["roof"],
        )
        if best["maxtext"]:
            fields.update(baseline=_common.round_figure(best["maxtext"]),
                          ratio=_common.ratio(best["jaxspeed"], best["maxtext"]),
                          baseline_source=f"MaxText {maxtext_peer.VERSION}, run alternately "
                                          f"with jaxspeed in this run ({args.maxtext})",
                          maxtext_options=row["peer"],
                          baseline_host_allocator=maxtext_peer.allocator(same_allocator=True))
        if best["maxtext_system_allocator"]:
            fields.update(
                baseline_system_allocator=_common.round_figure(best["maxtext_system_allocator"]),
                ratio_system_allocator=_common.ratio(best["jaxspeed"],
                                                    best["maxtext_system_allocator"]))
        _common.print_json(fields)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
