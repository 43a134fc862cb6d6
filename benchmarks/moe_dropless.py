"""The dropless MoE FFN on CPU: jaxspeed's native grouped matmul against `jax.lax.ragged_dot`.

Forward + backward (`jax.vjp`; gradients w.r.t. the tokens, the expert weights and the combine
weights) of `jaxspeed.moe.dropless_ffn`, the MegaBlocks-style path that never drops a token:
the `T * k` (token, choice) rows sorted by expert, two grouped matmuls. The same function is
traced twice, side by side in one run:
  - jaxspeed: the grouped matmuls on jaxspeed's native CPU kernels
    (`jaxspeed.native.grouped_matmul`: one OpenBLAS GEMM per expert over XLA's thread pool);
  - baseline: `jax.lax.ragged_dot`, as XLA:CPU compiles it (`JAXSPEED_NATIVE=0` while tracing).
Setup: the routing of benchmarks/moe_layer.py (T = 4096, M = 512, top-2, relu) with
`drop_tokens=False`, E x hidden = 64 x 256. Both are checked equal (output to 1e-4 max
relative; gradients to 1e-3 in norm, see moe_layer.py's `NATIVE_NORM_TOLERANCE`), then timed
interleaved, each timed call after an untimed one; medians.
Headline: ratio = ragged_dot time / native time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402
import moe_layer  # noqa: E402

NAME = "moe_dropless"
FULL = {**moe_layer.FULL, "experts": 64, "hidden": 256, "repeats": 3}
QUICK = {**moe_layer.QUICK, "experts": 8, "hidden": 32, "repeats": 1}


def dropless_step():
    """`step(x, kernel, params, cot)`: routing (no drops), `dropless_ffn`, its vjp; a new jit."""
    import jax

    from jaxspeed.moe import dropless_ffn, top_k_gating
    from jaxspeed.moe.gating import gate_logits

    def layer(x, kernel, params):
        routing = top_k_gating(gate_logits(x, kernel), 2, drop_tokens=False)
        return dropless_ffn(x, routing.expert_index, routing.weight, params, "relu")

    return moe_layer.fwd_bwd(layer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (tests)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps of each (median)")
    args = parser.parse_args(argv)
    devices = moe_layer.use_one_cpu_device()
    case = dict(QUICK if args.quick else FULL)
    repeats = args.repeats or case["repeats"]
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")

    import jax

    status = moe_layer.native_kernel_status()
    tokens = case["batch"] * case["seq"]
    print(f"dropless MoE FFN fwd+bwd on CPU ({devices}): native grouped matmul vs "
          f"jax.lax.ragged_dot; T={tokens}, M={case['d_model']}, E={case['experts']} x hidden "
          f"{case['hidden']}, top-2, relu, fp32; jaxspeed's kernels: {status}")
    inputs = moe_layer.make_inputs(case, case["experts"], case["hidden"])
    calls, first = {}, {}
    for name, native in (("native", True), ("ragged_dot", False)):
        with moe_layer.native_kernels(native):
            calls[name] = dropless_step().lower(*inputs).compile()
        first[name] = jax.block_until_ready(calls[name](*inputs))
    out_diff = moe_layer.max_rel_diff(first["native"], first["ragged_dot"])["out"]
    grad_diff = max(moe_layer.norm_rel_diff(first["native"], first["ragged_dot"]).values())
    if not (out_diff <= moe_layer.TOLERANCE["float32"]
            and grad_diff <= moe_layer.NATIVE_NORM_TOLERANCE):
        raise SystemExit(f"native and ragged_dot differ: out {out_diff}, gradients {grad_diff}")

    times = _common.interleaved_seconds(
        {name: functools.partial(call, *inputs) for name, call in calls.items()}, repeats)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    flops = 3 * 2 * 2 * tokens * 2 * case["d_model"] * case["hidden"]  # 2 GEMMs, fwd + 2 grads
    print()
    _common.print_table(
        ["path", "ms (median)", "GFLOP/s (expert matmuls)"],
        [[n, med[n], round(flops / med[n] / 1e6, 1)] for n in calls])
    print()
    _common.print_json(_common.result(
        NAME, case=(f"E={case['experts']} hidden={case['hidden']} T={tokens} M={case['d_model']} "
                    f"top2 dropless relu fp32 cpu"),
        jaxspeed=round(med["native"], 3), baseline=round(med["ragged_dot"], 3),
        unit="ms fwd+bwd (median)", ratio=_common.ratio(med["ragged_dot"], med["native"]),
        native_kernel=status, max_rel_diff_out=out_diff, norm_rel_diff_grads=grad_diff,
        min_ms={n: round(min(t) * 1e3, 1) for n, t in times.items()}, repeats=repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
