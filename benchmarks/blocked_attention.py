"""Blocked (FlashAttention) attention on CPU against the reference GPT's dense attention.

Forward + backward (`jax.vjp` of the attention, all three input gradients) of
`jaxspeed.attention.blocked_attention(..., causal=True)` against
`jaxspeed.models.dense_attention.causal_attention` (the `model.attention.impl: reference` path: fp32
`[batch, heads, length, length]` scores), side by side in one run, on one CPU device. Batch 1,
4 heads of 64, fp32, causal, blocks 512 x 512 (the config's default).
  - Memory: the compiled step's temporaries (`memory_analysis().temp_size_in_bytes`), and its
    arguments + outputs + temporaries. Target: reference temp / blocked temp >= 8.
  - Time: each step compiled ahead, run once, then timed interleaved (A B, B A, ...); median
    wall time. Target: blocked time <= 1.25 x reference time (ratio >= 0.8).
  - The dq, dk, dv of the two paths are compared.
Headline: seq 8192; `ratio` = reference temp bytes / blocked temp bytes (times less memory).

`--gpu` (benchmarks/gpu_suite.sh) runs on the machine's first GPU instead: seq 32768, bf16, and
a third path, `fused` (`jax.nn.dot_product_attention`, `implementation=None`: in jax 0.11-0.12
XLA's dense attention, not cuDNN's kernel), timed beside the other two. With `--gpu --cpu-check` the same three
run on one CPU device at a small size (`fused` is then XLA's own), to check the script.
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

NAME = "blocked_attention"
FULL = {"seq": 8192, "batch": 1, "heads": 4, "head_dim": 64, "block": 512, "repeats": 3,
        "dtype": "float32", "paths": ("blocked", "reference")}
QUICK = {**FULL, "seq": 256, "heads": 2, "head_dim": 32, "block": 64, "repeats": 1}
GPU = {**FULL, "seq": 32768, "dtype": "bfloat16", "repeats": 5,
       "paths": ("fused", "blocked", "reference")}
MEMORY_TARGET, TIME_TARGET = 8.0, 1.25


def steps(case: dict):
    """The two jitted forward+backward steps, `(q, k, v, do) -> (dq, dk, dv)`."""
    import jax

    from jaxspeed.attention import blocked_attention
    from jaxspeed.models.dense_attention import causal_attention

    def blocked(q, k, v, do):
        attend = lambda q, k, v: blocked_attention(
            q, k, v, causal=True, block_q=case["block"], block_kv=case["block"])
        return jax.vjp(attend, q, k, v)[1](do)

    def reference(q, k, v, do):
        return jax.vjp(causal_attention, q, k, v)[1](do)

    def fused(q, k, v, do):
        attend = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation=None)
        return jax.vjp(attend, q, k, v)[1](do)

    paths = {"fused": fused, "blocked": blocked, "reference": reference}
    return {name: jax.jit(paths[name]) for name in case["paths"]}


def run(case: dict, repeats: int) -> dict:
    """Compiles, checks and times both paths; returns the figures of the table."""
    import jax
    import jax.numpy as jnp

    shape = (case["batch"], case["seq"], case["heads"], case["head_dim"])
    args = [jax.random.normal(key, shape, jnp.float32).astype(case["dtype"])
            for key in jax.random.split(jax.random.key(0), 4)]
    compiled, compile_s, first, memory = {}, {}, {}, {}
    for name, fn in steps(case).items():
        start = time.perf_counter()
        compiled[name] = fn.lower(*args).compile()
        compile_s[name] = round(time.perf_counter() - start, 2)
        m = compiled[name].memory_analysis()
        memory[name] = {
            "temp": m.temp_size_in_bytes,
            "total": (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                      - m.alias_size_in_bytes),
        }
        first[name] = jax.block_until_ready(compiled[name](*args))
    error = {name: max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()
                             / jnp.abs(b.astype(jnp.float32)).max())
                       for a, b in zip(first[name], first["reference"]))
             for name in first if name != "reference"}
    calls = {name: (lambda c=c: c(*args)) for name, c in compiled.items()}
    del first
    times = _common.interleaved_seconds(calls, repeats)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "ms": ms,
        "min_ms": {name: round(min(t) * 1e3, 1) for name, t in times.items()},
        "memory": memory,
        "memory_ratio": _common.ratio(memory["reference"]["temp"], memory["blocked"]["temp"]),
        "time_ratio": _common.ratio(ms["reference"], ms["blocked"]),
        "compile_s": compile_s,
        "max_rel_grad_diff": error,
    }


def gpu_case(cpu_check: bool) -> dict:
    """`GPU`, or with `cpu_check` its paths and dtype at `QUICK`'s size on one CPU device."""
    import jax

    if cpu_check:
        _common.use_cpu_devices(1)
        return {**QUICK, "dtype": GPU["dtype"], "paths": GPU["paths"]}
    if jax.devices()[0].platform != "gpu":
        raise SystemExit(f"--gpu needs a GPU; JAX sees {jax.devices()} (use --cpu-check)")
    return dict(GPU)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (tests)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length")
    parser.add_argument("--block", type=int, default=None, help="block_q = block_kv")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps of each (median)")
    parser.add_argument("--gpu", action="store_true",
                        help="on the GPU: seq 32768, bf16, fused vs blocked vs reference")
    parser.add_argument("--cpu-check", action="store_true",
                        help="with --gpu: the same paths at a tiny size on one CPU device")
    args = parser.parse_args(argv)
    if args.gpu:
        case = gpu_case(args.cpu_check)
    else:
        _common.use_cpu_devices(1)
        case = dict(QUICK if args.quick else FULL)
    for key in ("seq", "block", "repeats"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                raise SystemExit(f"--{key} must be >= 1, got {value}")
            case[key] = value

    import jax

    print(
        f"Causal attention fwd+bwd on {jax.devices()[0].device_kind}: "
        f"{', '.join(case['paths'])} (blocked: FlashAttention, blocks {case['block']} x "
        f"{case['block']}; reference: dense fp32 scores); seq {case['seq']}, batch "
        f"{case['batch']}, {case['heads']} heads of {case['head_dim']}, {case['dtype']}; median "
        f"of {case['repeats']} interleaved steps after one warm-up"
    )
    r = run(case, case["repeats"])
    print()
    _common.print_table(
        ["path", "ms", "temp MiB", "args+out+temp MiB", "compile s"],
        [[name, r["ms"][name], _common.mib(r["memory"][name]["temp"]),
          _common.mib(r["memory"][name]["total"]), r["compile_s"][name]]
         for name in case["paths"]],
    )
    time_factor = r["ms"]["blocked"] / r["ms"]["reference"]
    diffs = ", ".join(f"{name} {d:.1e}" for name, d in r["max_rel_grad_diff"].items())
    print(f"\nmemory: reference temp / blocked temp = {r['memory_ratio']:.1f}x "
          f"(target >= {MEMORY_TARGET:g}x); time: blocked / reference = {time_factor:.2f}x "
          f"(target <= {TIME_TARGET:g}x); max relative grad difference from reference: {diffs}")
    print()
    _common.print_json(_common.result(
        NAME,
        case=(f"seq={case['seq']} causal heads={case['heads']} head_dim={case['head_dim']} "
              f"batch={case['batch']} block={case['block']} {case['dtype']} fwd+bwd "
              f"on {jax.devices()[0].platform}"),
        jaxspeed=_common.mib(r["memory"]["blocked"]["temp"]),
        baseline=_common.mib(r["memory"]["reference"]["temp"]),
        unit="MiB temp (compiled)", ratio=r["memory_ratio"],
        memory_ratio=r["memory_ratio"], memory_target=MEMORY_TARGET,
        ms={name: round(ms, 1) for name, ms in r["ms"].items()}, min_ms=r["min_ms"],
        time_ratio=r["time_ratio"], time_target=round(1 / TIME_TARGET, 3),
        total_MiB={n: round(_common.mib(m["total"]), 1) for n, m in r["memory"].items()},
        compile_s=r["compile_s"],
        max_rel_grad_diff={n: float(f"{d:.3g}") for n, d in r["max_rel_grad_diff"].items()},
        repeats=case["repeats"],
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
