"""Per-device model-state memory of ZeRO stages 0–3 against ZeRO's ideal (Rajbhandari 2020).

The reference GPT at ~100M parameters (GPT-2 small's shape with a 20,480-token tied vocabulary)
on 8 emulated CPU devices, mesh data=8, AdamW. Shapes only: the state comes from
`engine.abstract_state()` (`jax.eval_shape`) and the compiled train step's `memory_analysis()`;
nothing is allocated.

ZeRO's accounting (paper §3, "model states"): with Ψ parameters on N data-parallel devices and K
bytes of optimizer state per parameter, DeepSpeed's mixed-precision Adam keeps 2Ψ fp16 params,
2Ψ fp16 grads and KΨ = 12Ψ (fp32 master, m, v), and

    stage 0: (2+2+K)Ψ   stage 1: (2+2)Ψ + KΨ/N   stage 2: 2Ψ + (2+K)Ψ/N   stage 3: (2+2+K)Ψ/N

jaxspeed keeps fp32 params (they are the masters), fp32 grads and Adam's m, v: 4 + 4 + 8 bytes,
also 16 per parameter. The ideal here is ZeRO's formula with jaxspeed's widths (4, 4, K=8); the
measured figure is params + grads + optimizer state per device, read from the shardings.
Headline: stage 3, ratio = ideal / measured (1.0 = every byte of state sharded 8 ways).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "zero_memory"
STAGES = (0, 1, 2, 3)
#: (param bytes, grad bytes, optimizer-state bytes K) per parameter.
JAXSPEED_WIDTHS = (4, 4, 8)
DEEPSPEED_WIDTHS = (2, 2, 12)

FULL_MODEL = {
    "vocab_size": 20480, "d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 3072,
    "max_seq_len": 128, "tie_embeddings": True,
}
QUICK_MODEL = {
    "vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256,
    "max_seq_len": 32, "tie_embeddings": True,
}


def ideal_bytes(stage: int, params: int, devices: int, widths: tuple[int, int, int]) -> float:
    """ZeRO's per-device model-state bytes for `stage` (paper §3, Figure 1)."""
    p, g, k = widths
    n = devices
    return {
        0: (p + g + k) * params,
        1: (p + g) * params + k * params / n,
        2: p * params + (g + k) * params / n,
        3: (p + g + k) * params / n,
    }[stage] * 1.0


def bench_config(model: dict, *, stage: int, seq_len: int):
    """The benchmark's config: mesh data=8, micro 1, AdamW, bf16 compute, ZeRO `stage`."""
    from jaxspeed.config import load_config

    return load_config({
        "mesh": {"pipe": 1, "data": -1, "expert": 1, "tensor": 1},
        "train_micro_batch_size_per_device": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "model": {"type": "gpt", **model},
        "data": {"source": "stdlib", "seq_len": seq_len},
    })


def measure(stage: int, model: dict, *, seq_len: int, compile_step: bool) -> dict:
    """Per-device bytes of one stage: from the shardings, and from the compiled step."""
    import jax

    from jaxspeed.engine import initialize
    from jaxspeed.memory import sharded_bytes
    from jaxspeed.models.gpt import count_params

    engine = initialize(bench_config(model, stage=stage, seq_len=seq_len))
    state = engine.abstract_state()
    row = {
        "stage": stage,
        "n_params": count_params(state.params),
        "devices": jax.device_count(),
        "params": sharded_bytes(state.params),
        "grads": engine.plan.bytes_per_device("grad"),
        "opt_state": sharded_bytes(state.opt_state),
        "batch": sharded_bytes(engine.abstract_batch()),
    }
    row["model_state"] = row["params"] + row["grads"] + row["opt_state"]
    if compile_step:
        start = time.perf_counter()
        analysis = engine.compile_train_step().memory_analysis()
        row["compile_s"] = time.perf_counter() - start
        row["argument"] = int(analysis.argument_size_in_bytes)
        row["temp"] = int(analysis.temp_size_in_bytes)
        row["alias"] = int(analysis.alias_size_in_bytes)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true",
        help="a tiny model, shardings only (seconds, for tests); add --compile to compile too",
    )
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None,
        help="compile the train step of each stage for memory_analysis() (default: on, off "
        "with --quick); --no-compile leaves the compiled columns empty",
    )
    args = parser.parse_args(argv)
    compile_step = not args.quick if args.compile is None else args.compile
    _common.use_cpu_devices()

    model = QUICK_MODEL if args.quick else FULL_MODEL
    seq_len = model["max_seq_len"]
    rows = [measure(s, model, seq_len=seq_len, compile_step=compile_step) for s in STAGES]
    psi, n = rows[0]["n_params"], rows[0]["devices"]
    mib = _common.mib
    print(
        f"ZeRO model-state memory per device: reference GPT, {psi:,} params (Ψ), "
        f"d_model {model['d_model']}, {model['n_layers']} layers, vocab {model['vocab_size']} "
        f"tied; N={n} devices (mesh data={n}); AdamW; micro 1 x seq {seq_len}; bf16 compute"
    )
    print(
        "jaxspeed keeps fp32 params (= masters) + fp32 grads + Adam m, v: 4+4+8 bytes/param; "
        "DeepSpeed mixed precision: 2+2+12. ideal = ZeRO's formula with jaxspeed's widths."
    )
    print()
    table = []
    for r in rows:
        s = r["stage"]
        r["ideal"] = ideal_bytes(s, psi, n, JAXSPEED_WIDTHS)
        r["deepspeed"] = ideal_bytes(s, psi, n, DEEPSPEED_WIDTHS)
        r["ratio"] = _common.ratio(r["ideal"], r["model_state"])
        compiled = [
            mib(r["argument"]), mib(r["argument"] - r["params"] - r["opt_state"]),
            mib(r["temp"]), r["compile_s"],
        ] if "argument" in r else ["", "", "", ""]
        table.append([
            f"stage {s}", mib(r["params"]), mib(r["grads"]), mib(r["opt_state"]),
            mib(r["model_state"]), r["model_state"] / psi, mib(r["ideal"]), r["ratio"],
            mib(r["deepspeed"]), *compiled,
        ])
    _common.print_table(
        ["per device (MiB)", "params", "grads", "opt", "state", "B/param", "ideal", "ideal/ours",
         "DeepSpeed", "compiled args", "args-state", "temp", "compile s"],
        table,
    )
    print()
    print(
        "state = params + grads + opt (from the shardings); compiled args = the step's "
        "arguments (state + batch, from memory_analysis); args-state = arguments not in "
        "params/opt (batch, step, rng); temp = compiled scratch (gathered params, grads, "
        "activations)."
    )
    for r in rows:
        _common.print_json(_result(r, psi, n, model))
    return 0


def _result(r: dict, psi: int, n: int, model: dict) -> dict:
    extra = {
        "n_params": psi,
        "devices": n,
        "bytes_per_param_per_device": round(r["model_state"] / psi, 4),
        "bytes": {k: r[k] for k in ("params", "grads", "opt_state", "model_state")},
        "ideal_bytes": r["ideal"],
        "deepspeed_mixed_precision_bytes": r["deepspeed"],
    }
    if "argument" in r:
        extra["compiled"] = {
            "argument": r["argument"], "temp": r["temp"], "alias": r["alias"],
            "compile_s": round(r["compile_s"], 2),
        }
    return _common.result(
        NAME,
        case=f"stage={r['stage']} params={psi} devices={n} d_model={model['d_model']}",
        jaxspeed=_common.mib(r["model_state"]),
        baseline=_common.mib(r["ideal"]),
        unit="MiB/device",
        ratio=r["ratio"],
        **extra,
    )


if __name__ == "__main__":
    raise SystemExit(main())
