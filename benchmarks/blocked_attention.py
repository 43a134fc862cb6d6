"""Blocked (FlashAttention) attention on CPU against the reference GPT's dense attention.

Forward + backward (`jax.vjp` of the attention, all three input gradients) of
`jaxspeed.attention.blocked_attention(..., causal=True)` against
`jaxspeed.models.gpt.causal_attention` (the `model.attention.impl: reference` path: fp32
`[batch, heads, length, length]` scores), side by side in one run, on one CPU device. Batch 1,
4 heads of 64, fp32, causal, blocks 512 x 512 (the config's default).
  - Memory: the compiled step's temporaries (`memory_analysis().temp_size_in_bytes`), and its
    arguments + outputs + temporaries. Target: reference temp / blocked temp >= 8.
  - Time: each step compiled ahead, run once, then timed interleaved (A B, B A, ...); median
    wall time. Target: blocked time <= 1.25 x reference time (ratio >= 0.8).
  - The dq, dk, dv of the two paths are compared.
Headline: seq 8192; `ratio` = reference temp bytes / blocked temp bytes (times less memory).
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
FULL = {"seq": 8192, "batch": 1, "heads": 4, "head_dim": 64, "block": 512, "repeats": 3}
QUICK = {"seq": 256, "batch": 1, "heads": 2, "head_dim": 32, "block": 64, "repeats": 1}
MEMORY_TARGET, TIME_TARGET = 8.0, 1.25


def steps(case: dict):
    """The two jitted forward+backward steps, `(q, k, v, do) -> (dq, dk, dv)`."""
    import jax

    from jaxspeed.attention import blocked_attention
    from jaxspeed.models.gpt import causal_attention

    def blocked(q, k, v, do):
        attend = lambda q, k, v: blocked_attention(
            q, k, v, causal=True, block_q=case["block"], block_kv=case["block"])
        return jax.vjp(attend, q, k, v)[1](do)

    def reference(q, k, v, do):
        return jax.vjp(causal_attention, q, k, v)[1](do)

    return {"blocked": jax.jit(blocked), "reference": jax.jit(reference)}


def run(case: dict, repeats: int) -> dict:
    """Compiles, checks and times both paths; returns the figures of the table."""
    import jax
    import jax.numpy as jnp

    shape = (case["batch"], case["seq"], case["heads"], case["head_dim"])
    args = [jax.random.normal(key, shape, jnp.float32)
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
    error = max(float(jnp.abs(a - b).max() / jnp.abs(b).max())
                for a, b in zip(first["blocked"], first["reference"]))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (tests)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length")
    parser.add_argument("--block", type=int, default=None, help="block_q = block_kv")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps of each (median)")
    args = parser.parse_args(argv)
    _common.use_cpu_devices(1)

    case = dict(QUICK if args.quick else FULL)
    for key in ("seq", "block", "repeats"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                raise SystemExit(f"--{key} must be >= 1, got {value}")
            case[key] = value

    print(
        f"Causal attention fwd+bwd on one CPU device: blocked (FlashAttention, blocks "
        f"{case['block']} x {case['block']}) vs the reference dense path; seq {case['seq']}, "
        f"batch {case['batch']}, {case['heads']} heads of {case['head_dim']}, fp32; median of "
        f"{case['repeats']} interleaved steps after one warm-up"
    )
    r = run(case, case["repeats"])
    print()
    _common.print_table(
        ["path", "ms", "temp MiB", "args+out+temp MiB", "compile s"],
        [[name, r["ms"][name], _common.mib(r["memory"][name]["temp"]),
          _common.mib(r["memory"][name]["total"]), r["compile_s"][name]]
         for name in ("blocked", "reference")],
    )
    time_factor = r["ms"]["blocked"] / r["ms"]["reference"]
    print(f"\nmemory: reference temp / blocked temp = {r['memory_ratio']:.1f}x "
          f"(target >= {MEMORY_TARGET:g}x); time: blocked / reference = {time_factor:.2f}x "
          f"(target <= {TIME_TARGET:g}x); max relative grad difference "
          f"{r['max_rel_grad_diff']:.1e}")
    print()
    _common.print_json(_common.result(
        NAME,
        case=(f"seq={case['seq']} causal heads={case['heads']} head_dim={case['head_dim']} "
              f"batch={case['batch']} block={case['block']} fp32 fwd+bwd"),
        jaxspeed=_common.mib(r["memory"]["blocked"]["temp"]),
        baseline=_common.mib(r["memory"]["reference"]["temp"]),
        unit="MiB temp (compiled)", ratio=r["memory_ratio"],
        memory_ratio=r["memory_ratio"], memory_target=MEMORY_TARGET,
        ms={name: round(ms, 1) for name, ms in r["ms"].items()}, min_ms=r["min_ms"],
        time_ratio=r["time_ratio"], time_target=round(1 / TIME_TARGET, 3),
        total_MiB={n: round(_common.mib(m["total"]), 1) for n, m in r["memory"].items()},
        compile_s=r["compile_s"], max_rel_grad_diff=float(f"{r['max_rel_grad_diff']:.3g}"),
        repeats=case["repeats"],
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
