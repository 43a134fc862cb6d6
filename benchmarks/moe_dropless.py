"""The dropless MoE FFN on CPU: jaxspeed's padded-block batched dot against `jax.lax.ragged_dot`.

Forward + backward (`jax.vjp`; gradients w.r.t. the tokens, the gate kernel and the expert
weights) of a top-2 MoE FFN that never drops a token, the same routing
(`top_k_gating(..., drop_tokens=False)`) two ways, side by side in one run:
  - jaxspeed: `jaxspeed.moe.dropless_ffn`: the `T * k` (token, choice) rows sorted by expert,
    gathered into per-expert blocks padded to the busiest expert's rows (a few static sizes,
    picked at run time), two batched dots (`jaxspeed.moe.grouped.grouped_matmul`);
  - baseline: the MegaBlocks-style dropless FFN written plainly here with XLA's grouped matmul,
    `jax.lax.ragged_dot`, on the rows sorted by expert.
Setup: the routing of benchmarks/moe_layer.py (T = 4096, M = 512, top-2, relu, fp32) with
`drop_tokens=False`, E x hidden = 64 x 256. Both are checked equal first (output and every
gradient, max relative difference 1e-4), then timed interleaved, each timed call after an
untimed one; medians.
Headline: ratio = ragged_dot time / jaxspeed time.
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


def route(x, kernel, k: int):
    """The gating both paths share: fp32 logits, `top_k_gating` without drops."""
    from jaxspeed.moe import top_k_gating
    from jaxspeed.moe.gating import gate_logits

    return top_k_gating(gate_logits(x, kernel), k, drop_tokens=False)


def jaxspeed_layer(x, kernel, params, *, k: int):
    from jaxspeed.moe import dropless_ffn

    routing = route(x, kernel, k)
    return dropless_ffn(x, routing.expert_index, routing.weight, params, "relu")


def ragged_dot_layer(x, kernel, params, *, k: int):
    """The dropless relu FFN with `jax.lax.ragged_dot`: rows sorted by expert, two grouped
    matmuls, rows put back and weighted."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    routing = route(x, kernel, k)
    tokens, num_experts = x.shape[0], params.w_in.shape[0]
    expert = routing.expert_index.reshape(-1)
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.bincount(expert, length=num_experts).astype(jnp.int32)
    rows = x[order // k]
    h = jax.lax.ragged_dot(rows, params.w_in, sizes, preferred_element_type=f32)
    h = jax.nn.relu(h).astype(x.dtype)
    out = jax.lax.ragged_dot(h, params.w_out, sizes, preferred_element_type=f32)
    back = jnp.zeros_like(out).at[order].set(out).reshape(tokens, k, -1)
    return jnp.sum(routing.weight[..., None] * back, axis=1).astype(x.dtype)


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

    from jaxspeed.moe.grouped import block_capacities

    tokens, k, experts = case["batch"] * case["seq"], case["k"], case["experts"]
    print(f"dropless MoE FFN fwd+bwd on CPU ({devices}): jaxspeed's padded-block batched dot vs "
          f"jax.lax.ragged_dot; T={tokens}, M={case['d_model']}, E={experts} x hidden "
          f"{case['hidden']}, top-{k}, relu, fp32")
    inputs = moe_layer.make_inputs(case, experts, case["hidden"])
    busiest = int(jax.jit(lambda x, g: route(x, g, k).expert_counts.max())(*inputs[:2]))
    capacity = min([c for c in block_capacities(tokens * k, experts) if c >= busiest],
                   default=None)
    layers = {"jaxspeed": jaxspeed_layer, "ragged_dot": ragged_dot_layer}
    calls, first = {}, {}
    for name, layer in layers.items():
        calls[name] = moe_layer.fwd_bwd(functools.partial(layer, k=k)).lower(*inputs).compile()
        first[name] = jax.block_until_ready(calls[name](*inputs))
    diffs = moe_layer.max_rel_diff(first["jaxspeed"], first["ragged_dot"])
    if not max(diffs.values()) <= moe_layer.TOLERANCE["float32"]:
        raise SystemExit(f"jaxspeed and ragged_dot differ: {diffs}")

    times = _common.interleaved_seconds(
        {name: functools.partial(call, *inputs) for name, call in calls.items()}, repeats)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    flops = 3 * 2 * 2 * tokens * k * case["d_model"] * case["hidden"]  # 2 GEMMs, fwd + 2 grads
    print(f"busiest expert: {busiest} rows (mean {tokens * k / experts:g}); block size "
          f"{capacity if capacity else 'split (larger than every block size)'}")
    print()
    _common.print_table(
        ["path", "ms (median)", "GFLOP/s (expert matmuls, unpadded)", "MiB"],
        [[n, med[n], round(flops / med[n] / 1e6, 1), _common.mib(moe_layer.step_bytes(c))]
         for n, c in calls.items()])
    print()
    _common.print_json(_common.result(
        NAME, case=(f"E={experts} hidden={case['hidden']} T={tokens} M={case['d_model']} "
                    f"top{k} dropless relu fp32 cpu"),
        jaxspeed=round(med["jaxspeed"], 3), baseline=round(med["ragged_dot"], 3),
        unit="ms fwd+bwd (median)", ratio=_common.ratio(med["ragged_dot"], med["jaxspeed"]),
        busiest_expert_rows=busiest, block_rows=capacity, max_rel_diff=max(diffs.values()),
        peak_MiB={n: round(_common.mib(moe_layer.step_bytes(c)), 1) for n, c in calls.items()},
        min_ms={n: round(min(t) * 1e3, 1) for n, t in times.items()}, repeats=repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
