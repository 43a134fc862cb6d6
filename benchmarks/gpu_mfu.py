"""llama_1b on one GPU: tokens/s, MFU and HFU in bf16 and in FP8, and the roofline's prediction.

Run on a machine with one GPU: `python benchmarks/gpu_mfu.py`. `configs/llama_1b.yaml`
(Llama-3.2-1B's shape, seq 4096) trains 50 steps in bf16, then 50 in FP8 (the same config with
`--set fp8.enabled=true fp8.recipe=tensorwise`), then both again with cuDNN's fused attention
(`model.attention.impl=cudnn`, which no deviceless compile can predict), each with `jaxspeed
train` in a process of its own (a case that fails is named and the others still run, and each
starts with the whole GPU memory); every figure and its baseline come from this run:
  - tokens/s over the steps after the first 5 (`throughput.aggregate`);
  - MFU: model FLOPs (6·N plus causal attention per token, `cost.flops.model_train_flops`, as
    `metrics.jsonl` counts them) per second, against the spec sheet's dense bf16 peak
    (`jaxspeed.cost.peaks`) and against the best bf16 matmul this GPU reaches in the same run
    (`gpu_engine.matmul_peak`); FP8 is measured against the same bf16 peaks, so its MFU says
    how much faster it trains, not how busy the FP8 cores are;
  - HFU: the step's traced matmul FLOPs (remat's recomputation included) likewise;
  - the loss after 50 steps of each.
Targets printed beside them: bf16 MFU >= 45% of the spec peak; FP8 >= 1.3x bf16's tokens/s.
Lines: bf16, fp8, bf16 cudnn, fp8 cudnn (model TFLOP/s against the measured matmul: ratio = MFU
vs measured), cuDNN's attention against the config's (pallas) in each precision, then the
headline: FP8 tokens/s against bf16's (ratio = the speed-up), with the config's attention.

`--dry-run` needs no GPU: it compiles both steps with XLA:GPU for one H100 without a GPU (the
gpu-compile extra; without it, one line says so and it exits 0) and prints the roofline's
predicted step, MFU and HFU (`jaxspeed plan --target h100`'s figures) against the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "gpu_mfu"
CONFIG = _common.ROOT / "configs" / "llama_1b.yaml"
PRECISIONS = {"bf16": [], "fp8": ["fp8.enabled=true", "fp8.recipe=tensorwise"]}
#: Variants measured on a GPU only: cuDNN's attention does not compile without one.
VARIANTS = {"": [], "cudnn": ["model.attention.impl=cudnn"]}
STEPS, SKIP = 50, 5
#: One case's process on an H100: start, 1B compile, 50 steps of ~0.5 s (~90 s expected).
CASE_TIMEOUT_S = 150
TARGET_MFU, TARGET_FP8_SPEEDUP = 0.45, 1.3
DRY_RUN_TARGET = "h100"


def load(precision: str, *overrides: str, variant: str = ""):
    from jaxspeed.config import load_config

    return load_config(CONFIG, overrides=["logging.every_n_steps=1", *PRECISIONS[precision],
                                          *VARIANTS[variant], *overrides])


def case_name(precision: str, variant: str) -> str:
    return f"{precision} {variant}".strip()


def model_flops(config, tokens: int) -> float:
    """Model FLOPs of `tokens` tokens of `config`'s model (what `metrics.jsonl`'s MFU counts)."""
    from jaxspeed.cost.flops import model_train_flops

    return model_train_flops(config.model, tokens=tokens, seq_len=config.data.seq_len,
                             param_count=0)


def measure(precision: str, variant: str, matmul_peak: float, spec: float | None) -> dict:
    """Trains `STEPS` steps of `precision` (and `variant`) on this GPU; tokens/s, MFU, HFU and
    the last loss."""
    import throughput
    from gpu_engine import ratio_of
    from jaxspeed.train.engine import initialize
    from jaxspeed.train.loop import train

    config = load(precision, variant=variant)
    engine = initialize(config)
    tokens_per_step = engine.batch_sizes.train_batch_size * config.data.seq_len
    hardware = engine.step_flops()
    with tempfile.TemporaryDirectory(prefix="jaxspeed-gpu-mfu-") as out:
        train(config, output_dir=out, steps=STEPS, progress=False)
        records = [json.loads(line) for line in
                   (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tokens_per_s, counted = throughput.aggregate(records, tokens_per_step=tokens_per_step,
                                                 skip=SKIP)
    steps_per_s = tokens_per_s / tokens_per_step
    achieved = model_flops(config, tokens_per_step) * steps_per_s
    mfu = None if spec is None else ratio_of(achieved, spec)
    return _common.result(
        NAME, case=f"{case_name(precision, variant)} llama_1b seq {config.data.seq_len} micro "
                   f"{config.train_micro_batch_size_per_device} remat "
                   f"{config.activation_checkpointing.policy}",
        jaxspeed=achieved / 1e12, baseline=matmul_peak / 1e12, unit="TFLOP/s",
        ratio=ratio_of(achieved, matmul_peak), baseline_source="best bf16 matmul in this run",
        tokens_per_s=round(tokens_per_s, 1), steps_counted=counted,
        mfu_vs_spec=mfu, mfu_vs_measured=ratio_of(achieved, matmul_peak),
        hfu_vs_spec=None if spec is None else ratio_of(hardware * steps_per_s, spec),
        spec_peak_tflops=None if spec is None else spec / 1e12,
        loss_after_steps=records[-1]["loss"], steps=STEPS, target_mfu=TARGET_MFU,
        attention=config.model.attention.impl,
    )


def measure_apart(precision: str, variant: str, matmul_peak: float) -> dict | None:
    """`measure` in a process of its own (the whole GPU memory, and a crash stays there); its
    result line, or None after saying why there is none."""
    name = case_name(precision, variant)
    argv = [sys.executable, __file__, "--measure", precision, "--variant", variant,
            "--matmul-peak", str(matmul_peak)]
    # The environment passes on (PYTHONPATH's carried wheels), but not this process's
    # allocator setting: the case preallocates 90% of the GPU's memory, as a training run would.
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=CASE_TIMEOUT_S,
                              check=False, env=env)
    except subprocess.TimeoutExpired:
        print(f"gpu_mfu: case {name!r} ran past {CASE_TIMEOUT_S} s", flush=True)
        return None
    found = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not found:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        print(f"gpu_mfu: case {name!r} failed (exit {proc.returncode}):\n{tail}", flush=True)
        return None
    print(f"gpu_mfu: case {name!r} done", flush=True)
    return json.loads(found[-1])


def predict(precision: str) -> dict:
    """The roofline prediction of `precision`'s step, compiled for one H100 without a GPU."""
    config = load(precision)
    predicted = _common.predict_deviceless(config, DRY_RUN_TARGET)
    tokens = config.train_micro_batch_size_per_device * config.data.seq_len
    return _common.result(
        NAME, case=f"{precision} llama_1b predicted for {DRY_RUN_TARGET} (deviceless compile)",
        jaxspeed=predicted["predicted_mfu"] * 100, baseline=TARGET_MFU * 100,
        unit="% MFU predicted vs target",
        ratio=round(predicted["predicted_mfu"] / TARGET_MFU, 3),
        predicted_step_seconds=predicted["predicted_step_seconds"],
        predicted_tokens_per_s=round(tokens / predicted["predicted_step_seconds"], 1),
        predicted_mfu=predicted["predicted_mfu"], predicted_hfu=predicted["predicted_hfu"],
        device_gib=round(predicted["device_bytes"] / 2**30, 2),
        seconds_by_bound=predicted["seconds_by_bound"],
        top_ops=[f"{op['kind']} {op['name']} {op['seconds'] * 1e3:.1f} ms ({op['source'][-48:]})"
                 for op in predicted["top_ops"][:5]],
    )


def target(line: dict) -> str:
    """The target a precision's line is held to."""
    if line["case"].startswith("bf16"):
        return f"MFU >= {TARGET_MFU:.0%}"
    return f">= {TARGET_FP8_SPEEDUP}x bf16 tokens/s"


def headline(bf16: dict, fp8: dict, key: str, unit: str) -> dict:
    """FP8's tokens/s against bf16's (measured, or predicted with `key`)."""
    fast, base = fp8[key], bf16[key]
    return _common.result(
        NAME, case=f"fp8 vs bf16 llama_1b {unit}", jaxspeed=fast, baseline=base, unit=unit,
        ratio=_common.ratio(fast, base), target_ratio=TARGET_FP8_SPEEDUP,
        meets_target=fast / base >= TARGET_FP8_SPEEDUP,
        loss_after_steps={"bf16": bf16.get("loss_after_steps"), "fp8": fp8.get("loss_after_steps")},
    )


def attention_line(precision: str, plain: dict, cudnn: dict) -> dict:
    """cuDNN's fused attention against the config's, in one precision (measured tokens/s)."""
    return _common.result(
        NAME, case=f"{precision} cudnn attention vs {plain['attention']} llama_1b tokens/s",
        jaxspeed=cudnn["tokens_per_s"], baseline=plain["tokens_per_s"], unit="tokens/s",
        ratio=_common.ratio(cudnn["tokens_per_s"], plain["tokens_per_s"]),
        loss_after_steps={"plain": plain["loss_after_steps"], "cudnn": cudnn["loss_after_steps"]},
    )


def dry_run() -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxspeed.gpu import deviceless

    if deviceless.missing():
        print(f"gpu_mfu --dry-run: skipped, no deviceless GPU compile here: {deviceless.missing()}")
        return 0
    lines = [predict(p) for p in PRECISIONS]
    _common.print_table(
        ["precision", "step ms", "tokens/s", "MFU", "HFU", "target"],
        [[r["case"].split()[0], round(r["predicted_step_seconds"] * 1e3, 1),
          r["predicted_tokens_per_s"], f"{r['predicted_mfu']:.1%}", f"{r['predicted_hfu']:.1%}",
          target(r)] for r in lines])
    lines.append(headline(*lines, key="predicted_tokens_per_s", unit="tokens/s predicted"))
    for r in lines:
        _common.print_json(r)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="compile for an H100 without a GPU and print the predicted figures")
    parser.add_argument("--measure", choices=list(PRECISIONS), help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=list(VARIANTS), default="", help=argparse.SUPPRESS)
    parser.add_argument("--matmul-peak", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run()
    if not args.measure:
        # This process measures the matmul peak and waits for the cases' processes: it takes
        # GPU memory as it goes (a few GiB) instead of JAX's default 75% up front.
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

    import jax

    from gpu_engine import matmul_peak
    from jaxspeed.cost.peaks import peak_flops
    from pallas_kernels import backend as _backend

    if not _backend.on_gpu():
        raise SystemExit(f"gpu_mfu needs a GPU (JAX sees {jax.devices()}); `--dry-run` "
                         "predicts it without one")
    device = jax.devices()[0]
    spec = peak_flops(device.device_kind)
    if args.measure:  # one case, in the process `measure_apart` started
        _common.print_json(measure(args.measure, args.variant, args.matmul_peak, spec))
        return 0
    best = max(matmul_peak(sizes=(8192,), iters=10, rounds=3).values())
    print(f"llama_1b on one {device.device_kind}: {STEPS} steps each; bf16, FP8, then both "
          "with cuDNN's attention", flush=True)
    measured = {(p, v): measure_apart(p, v, best) for v in VARIANTS for p in PRECISIONS}
    lines = [r for r in measured.values() if r is not None]
    _common.print_table(
        ["case", "attention", "tokens/s", "MFU (spec)", "MFU (measured matmul)", "HFU (spec)",
         "loss", "target"],
        [[r["case"].split(" llama_1b")[0], r["attention"], r["tokens_per_s"], r["mfu_vs_spec"],
          r["mfu_vs_measured"], r["hfu_vs_spec"], r["loss_after_steps"], target(r)]
         for r in lines])
    for p in PRECISIONS:
        if measured[p, ""] and measured[p, "cudnn"]:
            lines.append(attention_line(p, measured[p, ""], measured[p, "cudnn"]))
    if measured["bf16", ""] and measured["fp8", ""]:
        lines.append(headline(measured["bf16", ""], measured["fp8", ""], key="tokens_per_s",
                              unit="tokens/s"))
    for r in lines:
        _common.print_json(r)
    return 0 if all(measured.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
