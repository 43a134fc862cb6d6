"""One MoE layer on CPU: jaxspeed's index dispatch/combine against GShard's one-hot einsums.

Forward + backward (`jax.vjp` of the layer; gradients w.r.t. the tokens, the gate kernel and
the expert weights, cotangent a fixed random `[T, M]`) of one top-2 MoE layer, two ways, side
by side in one run and with the SAME gating (`jaxspeed.moe.gating.gate_logits` +
`jaxspeed.moe.top_k_gating`, capacity_factor 1.0, fp32):
  - jaxspeed: `jaxspeed.moe.dispatch` (`impl="xla"`: index scatter/gather, no `[T, E, C]`
    tensor), `jaxspeed.moe.expert_ffn` (relu; its expert matmuls are XLA's batched dot),
    `jaxspeed.moe.combine`;
  - baseline: GShard / DeepSpeed-MoE, written plainly here: the routing turned into a
    `[T, E, C]` one-hot dispatch mask and combine-weight tensor, `einsum("tec,tm->ecm")` to
    dispatch, the same two-matmul relu FFN, `einsum("tec,ecm->tm")` to combine.
Setup (issue 7): T = 4096 tokens (batch 8 x seq 512), M = 512, E x hidden in {8 x 2048,
32 x 512, 64 x 256} (16.8M expert parameters each). Checked before timing: the jaxspeed layer
equals the einsum layer (output and every gradient, max relative difference 1e-4).
  - Time: each step compiled ahead, run once, then timed interleaved (A B, B A, ...); the
    median (and min) wall time, on one CPU device. Each timed call follows an untimed call of
    the same step, as in a training loop: otherwise a step pays for the pages the previous
    (other) step freed, and the einsum layer frees 100s of MiB.
  - Memory: the compiled step's arguments + outputs + temporaries (`memory_analysis()`).
  - FFN alone: jaxspeed's `expert_ffn` forward+backward on `[E, C, M]` buffers, timed with
    them. `ratio_bound` = einsum time / FFN time is the most any dispatch/combine could reach
    with these matmuls.
Target: ratio = einsum time / jaxspeed time >= 10 at E = 64 (Tutel's CPU build: about 10x).
Headline: E = 64.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "moe_layer"
FULL = {"batch": 8, "seq": 512, "d_model": 512, "k": 2, "capacity_factor": 1.0,
        "experts": ((8, 2048), (32, 512), (64, 256)), "repeats": 5, "target": 10.0}
QUICK = {"batch": 2, "seq": 64, "d_model": 32, "k": 2, "capacity_factor": 1.0,
         "experts": ((4, 64), (8, 32)), "repeats": 1, "target": 10.0}
#: Largest relative difference (to the baseline's max |value|) accepted by the check.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def make_inputs(case: dict, num_experts: int, hidden: int, dtype="float32", *, seed: int = 0):
    """Tokens `[T, M]`, gate kernel `[M, E]`, `ExpertParams` and the output cotangent `[T, M]`."""
    import jax
    import jax.numpy as jnp

    from jaxspeed.moe import init_expert_params

    tokens, width = case["batch"] * case["seq"], case["d_model"]
    kx, kg, kp, kc = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (tokens, width), jnp.float32).astype(dtype)
    kernel = (jax.random.normal(kg, (width, num_experts), jnp.float32) / width**0.5).astype(dtype)
    params = init_expert_params(kp, num_experts, width, hidden, activation="relu", dtype=dtype)
    cot = jax.random.normal(kc, (tokens, width), jnp.float32).astype(dtype)
    return x, kernel, params, cot


def route(x, kernel, *, k: int, capacity_factor: float):
    """The gating both paths share: fp32 logits, `top_k_gating` (GShard slot order)."""
    from jaxspeed.moe import top_k_gating
    from jaxspeed.moe.gating import gate_logits

    return top_k_gating(gate_logits(x, kernel), k, capacity_factor)


def jaxspeed_layer(x, kernel, params, *, k: int, capacity_factor: float, impl: str = "xla"):
    """jaxspeed's MoE layer: `[T, M]` -> `[T, M]` by index dispatch, batched FFN, combine."""
    from jaxspeed.moe import combine, dispatch, expert_ffn

    routing = route(x, kernel, k=k, capacity_factor=capacity_factor)
    buffers = dispatch(x, routing, params.w_in.shape[0], impl=impl)
    return combine(expert_ffn(buffers, params, activation="relu"), routing, impl=impl)


def one_hot_tensors(routing, num_experts: int, dtype):
    """GShard's `[T, E, C]` dispatch mask and combine weights, built from a `Routing`.

    A choice's `one_hot(expert) x one_hot(slot)`; a dropped choice (slot >= C) is all zero.
    The combine weights carry the gate weights, so the gate gradient flows through them.
    """
    import jax
    import jax.numpy as jnp

    capacity = routing.capacity
    mask, weights = 0.0, 0.0
    for j in range(routing.expert_index.shape[1]):
        expert = jax.nn.one_hot(routing.expert_index[:, j], num_experts, dtype=jnp.float32)
        slot = jax.nn.one_hot(routing.position[:, j], capacity, dtype=jnp.float32)
        choice = expert[:, :, None] * slot[:, None, :]
        mask = mask + choice
        weights = weights + routing.weight[:, j, None, None] * choice
    return mask.astype(dtype), weights.astype(dtype)


def einsum_layer(x, kernel, params, *, k: int, capacity_factor: float):
    """The GShard / DeepSpeed-MoE layer: one-hot einsum dispatch and combine, same FFN math."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    routing = route(x, kernel, k=k, capacity_factor=capacity_factor)
    mask, weights = one_hot_tensors(routing, params.w_in.shape[0], x.dtype)
    buffers = jnp.einsum("tec,tm->ecm", mask, x)
    h = jnp.einsum("ecm,emh->ech", buffers, params.w_in, preferred_element_type=f32)
    h = jax.nn.relu(h).astype(x.dtype)
    y = jnp.einsum("ech,ehm->ecm", h, params.w_out, preferred_element_type=f32).astype(x.dtype)
    return jnp.einsum("tec,ecm->tm", weights, y, preferred_element_type=f32).astype(x.dtype)


def fwd_bwd(layer):
    """`step(x, kernel, params, cot) -> (out, (dx, dkernel, dparams))`, jitted."""
    import jax

    def step(x, kernel, params, cot):
        out, vjp = jax.vjp(layer, x, kernel, params)
        return out, vjp(cot)

    return jax.jit(step)


def steps(case: dict, *, impl: str = "xla"):
    """The jitted forward+backward steps of the jaxspeed layer and the einsum layer."""
    opts = dict(k=case["k"], capacity_factor=case["capacity_factor"])
    return {"jaxspeed": fwd_bwd(functools.partial(jaxspeed_layer, impl=impl, **opts)),
            "einsum": fwd_bwd(functools.partial(einsum_layer, **opts))}


def ffn_step():
    """`step(buffers [E, C, M], params, cot [E, C, M])`: `expert_ffn` alone, forward+backward.

    The expert matmuls both layers share; timed to show how much of the jaxspeed layer they
    are (einsum time / this time bounds the ratio any dispatch/combine can reach).
    """
    import jax

    from jaxspeed.moe import expert_ffn

    def step(buffers, params, cot):
        out, vjp = jax.vjp(lambda b, p: expert_ffn(b, p, activation="relu"), buffers, params)
        return out, vjp(cot)

    return jax.jit(step)


def max_rel_diff(got, want) -> dict[str, float]:
    """Per output/gradient leaf: max |got - want| / max |want|, as fp32 numpy."""
    import jax
    import numpy as np

    names = ("out", "dx", "dgate", "dw_in", "dw_out")
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    diffs = {}
    for name, a, b in zip(names, got_leaves, want_leaves, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        diffs[name] = float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))
    return diffs


def step_bytes(compiled) -> int:
    """Arguments + outputs + temporaries of a compiled step (aliased buffers counted once)."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def run_case(case: dict, num_experts: int, hidden: int, repeats: int) -> dict:
    """Checks, then times both paths for one expert shape; returns one table row."""
    import jax

    args = make_inputs(case, num_experts, hidden)
    fns = steps(case)
    compiled, compile_s, first = {}, {}, {}
    for name, fn in fns.items():
        start = time.perf_counter()
        compiled[name] = fn.lower(*args).compile()
        compile_s[name] = time.perf_counter() - start
        first[name] = jax.block_until_ready(compiled[name](*args))
    diffs = max_rel_diff(first["jaxspeed"], first["einsum"])
    worst = max(diffs.values())
    if not worst <= TOLERANCE["float32"]:
        raise SystemExit(f"E={num_experts}: jaxspeed and the einsum layer differ: {diffs}")
    routing = jax.jit(lambda x, g: route(x, g, k=case["k"],
                                         capacity_factor=case["capacity_factor"]))(*args[:2])
    x, _, params, _ = args
    buffers = jax.random.normal(jax.random.key(1), (num_experts, routing.capacity, x.shape[1]),
                                x.dtype)
    calls = {name: functools.partial(compiled[name], *args) for name in fns}
    calls["ffn"] = functools.partial(ffn_step().lower(buffers, params, buffers).compile(),
                                     buffers, params, buffers)
    jax.block_until_ready(calls["ffn"]())
    times = _common.interleaved_seconds(calls, repeats)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    return {
        "experts": num_experts, "hidden": hidden, "capacity": routing.capacity,
        "dropped": float(routing.dropped_fraction),
        "jaxspeed_ms": med["jaxspeed"], "einsum_ms": med["einsum"], "ffn_ms": med["ffn"],
        "min_ms": {n: round(min(t) * 1e3, 1) for n, t in times.items()},
        "ratio": _common.ratio(med["einsum"], med["jaxspeed"]),
        "bytes": {n: step_bytes(c) for n, c in compiled.items()},
        "compile_s": {n: round(s, 2) for n, s in compile_s.items()},
        "max_rel_diff": worst,
    }


def use_one_cpu_device() -> str:
    """One CPU device; if JAX already runs with several (`jaxspeed bench`), the first is used."""
    try:
        _common.use_cpu_devices(1)
    except SystemExit:
        import jax

        if jax.devices()[0].platform != "cpu":
            raise
        return f"{jax.device_count()} CPU devices exist, the first is used"
    return "1 CPU device"


def main(argv: list[str] | None = None) -> int:
    from jaxspeed.runtime.host_allocator import keep_freed_memory

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (tests)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps of each (median)")
    parser.add_argument("--experts", nargs="+", default=None, metavar="ExH",
                        help="expert count x hidden, e.g. 64x256 (the last is the headline)")
    args = parser.parse_args(argv)
    devices = use_one_cpu_device()

    case = dict(QUICK if args.quick else FULL)
    repeats = args.repeats or case["repeats"]
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    if args.experts:
        try:
            case["experts"] = tuple(tuple(int(v) for v in s.lower().split("x"))
                                    for s in args.experts)
        except ValueError:
            raise SystemExit(f"--experts takes ExH pairs such as 64x256, got {args.experts}")
    tokens = case["batch"] * case["seq"]
    print(
        f"MoE layer fwd+bwd on CPU ({devices}): jaxspeed dispatch/combine (XLA index path) vs "
        f"GShard one-hot einsums, same gating; T={tokens} (batch {case['batch']} x seq "
        f"{case['seq']}), M={case['d_model']}, top-{case['k']}, capacity_factor "
        f"{case['capacity_factor']}, relu FFN, fp32; median of {repeats} interleaved steps "
        f"after one warm-up"
    )
    rows = [run_case(case, e, h, repeats) for e, h in case["experts"]]
    print()
    _common.print_table(
        ["E x hidden", "C", "dropped", "jaxspeed ms", "einsum ms", "ratio", "FFN alone ms",
         "FFN share", "jaxspeed MiB", "einsum MiB", "max diff"],
        [[f"{r['experts']}x{r['hidden']}", r["capacity"], f"{r['dropped']:.3f}",
          r["jaxspeed_ms"], r["einsum_ms"], r["ratio"], r["ffn_ms"],
          f"{r['ffn_ms'] / r['jaxspeed_ms']:.0%}", _common.mib(r["bytes"]["jaxspeed"]),
          _common.mib(r["bytes"]["einsum"]), f"{r['max_rel_diff']:.1e}"] for r in rows],
    )
    print()
    for r in rows:
        _common.print_json(_common.result(
            NAME,
            case=(f"E={r['experts']} hidden={r['hidden']} T={tokens} M={case['d_model']} "
                  f"top{case['k']} cf={case['capacity_factor']} relu fp32 cpu"),
            jaxspeed=r["jaxspeed_ms"], baseline=r["einsum_ms"], unit="ms fwd+bwd (median)",
            ratio=r["ratio"], target_ratio=case["target"], capacity=r["capacity"],
            dropped_fraction=round(r["dropped"], 4), min_ms=r["min_ms"],
            ffn_alone_ms=round(r["ffn_ms"], 3),
            ratio_bound=_common.ratio(r["einsum_ms"], r["ffn_ms"]),
            peak_MiB={n: round(_common.mib(b), 1) for n, b in r["bytes"].items()},
            compile_s=r["compile_s"], max_rel_diff=r["max_rel_diff"], repeats=repeats,
            host_allocator=keep_freed_memory(),
        ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
