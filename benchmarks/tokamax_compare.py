"""Our GPU attention and grouped-expert matmuls against tokamax's kernels (issue 56, item 3).

tokamax (PyPI, Google's Pallas kernel library) covers two of our GPU kernels:
  - attention: llama_1b's (`configs/llama_1b.yaml`: batch 4, seq 4096, 32 heads, 8 KV heads,
    head dim 64, causal, bf16), forward+backward. Ours: `blocked` (the config's:
    `jaxspeed.attention.blocked_attention`, FlashAttention's algorithm in plain JAX, blocks of
    512), `pallas` (`model.attention.impl: pallas`: our Pallas FlashAttention kernel over the
    causal block layout, Mosaic GPU on Hopper) and `fused` (`jax.nn.dot_product_attention`:
    XLA's dense attention). tokamax's
    `dot_product_attention` implementations: `mosaic` (Mosaic GPU), `triton` (Pallas Triton),
    `cudnn` (jax.nn's cuDNN path), `xla`, `xla_chunked`.
  - grouped experts: the expert FFN of `gpu_moe.py`'s layer (T 4096 tokens, top-2, so 8192
    rows sorted by expert, M 512, E x hidden in {8 x 2048, 32 x 512, 64 x 256}, relu, bf16),
    two grouped matmuls forward+backward. Ours: `jaxspeed.moe.grouped.grouped_matmul` (padded
    blocks, one batched dot) and `jax.lax.ragged_dot` (XLA's). tokamax's `ragged_dot`:
    `mosaic`, `triton` (needs `jax_triton`), `xla`. Group sizes: a fixed top-2 routing of
    random logits (seed 0).

Default (on a GPU): each implementation compiled, checked against a plain fp32 jnp reference
(output and every gradient, max |got - want| / max |want| <= `TOLERANCE`: a few bf16 roundings)
and timed (`_common.timed`: a warm-up, then the median over rounds of back-to-back calls).
One JSON line per case: `jaxspeed` is the implementation's ms, `baseline` ours in use (blocked
attention; `grouped_matmul`), `ratio` = baseline / it (above 1: it is faster than ours). An
implementation that fails to compile, run or match is skipped with its reason. The last line
is the headline: the fastest implementation of llama_1b's attention against blocked.

`--dry-run` (no GPU): compiles each with XLA:GPU for one H100 (`jaxspeed.gpu.deviceless`) and
prints the roofline's predicted time (`jaxspeed.cost.roofline`, as `gpu_mfu --dry-run`), with
three corrections this comparison needs, each stated in `predict_ms`.
`--cpu-check`: tiny sizes on CPU, ours and tokamax's `xla` implementations only, checked and
timed once (a smoke test of the code, not a measurement).

Without tokamax it says so and exits 0. tokamax imports `xprof` (a 100 MB wheel with
Google Cloud clients) only for `tokamax.benchmark`'s profiler, which this script does not
call: where xprof is missing, an empty stand-in lets tokamax import.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import types
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "tokamax_compare"
GPU_CASE = {
    "attention": {"batch": 4, "seq": 4096, "heads": 32, "kv_heads": 8, "head_dim": 64,
                  "block": 512},
    "ragged": {"tokens": 4096, "k": 2, "d_model": 512,
               "experts": ((8, 2048), (32, 512), (64, 256))},
    "iters": 5, "rounds": 5,
}
CPU_CASE = {
    "attention": {"batch": 1, "seq": 128, "heads": 4, "kv_heads": 2, "head_dim": 32,
                  "block": 64},
    "ragged": {"tokens": 32, "k": 2, "d_model": 32, "experts": ((4, 64),)},
    "iters": 1, "rounds": 1,
}
#: tokamax implementations tried: attention, ragged_dot ("mosaic" is tokamax's "mosaic_gpu").
TOKAMAX_ATTENTION = ("mosaic_gpu", "triton", "cudnn", "xla", "xla_chunked")
TOKAMAX_RAGGED = ("mosaic_gpu", "triton", "xla")
#: max |got - want| / max |want| against the fp32 reference: bf16 inputs, bf16 outputs and
#: (attention) bf16 probabilities before P·V, each a relative 2**-8, with room (8 roundings).
TOLERANCE = 8 * 2.0**-8
DRY_RUN_TARGET = "h100"
#: custom-call targets of Pallas kernels: opaque to the roofline (bytes counted, FLOPs not)
KERNEL_TARGETS = ("mosaic_gpu", "__gpu$xla.gpu.triton")


def load_tokamax():
    """tokamax, or None when it is not installed (the stand-in for a missing xprof first)."""
    if importlib.util.find_spec("tokamax") is None:
        return None
    if importlib.util.find_spec("xprof") is None:
        names = ("xprof", "xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool")
        mods = [types.ModuleType(n) for n in names]
        for parent, child, attr in zip(mods, mods[1:], ("cli", "tools", "get_kernel_stats_tool")):
            setattr(parent, attr, child)
        sys.modules.update(zip(names, mods))
    import tokamax

    return tokamax


# --- the functions compared -----------------------------------------------------------------

def attention_impls(tokamax, case: dict, names=TOKAMAX_ATTENTION) -> dict:
    """name -> attend(q `[B, S, H, D]`, k, v `[B, S, KV, D]`) -> `[B, S, H, D]`, causal."""
    import jax

    from jaxspeed.attention import blocked_attention
    from jaxspeed.attention.block_sparse import causal_attention
    from jaxspeed.models.dense_attention import share_kv_heads

    def blocked(q, k, v):
        k, v = share_kv_heads(k, v, q.shape[2])
        return blocked_attention(q, k, v, causal=True, block_q=case["block"],
                                 block_kv=case["block"])

    def kernel(q, k, v):  # model.attention.impl: pallas (its XLA path off a GPU)
        return causal_attention(q, *share_kv_heads(k, v, q.shape[2]))

    impls = {"jaxspeed blocked": blocked,
             "jaxspeed pallas (our kernel)": kernel,
             "jaxspeed fused (jax.nn, XLA)":
                 lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)}
    for name in names if tokamax else ():
        impls[f"tokamax {name}"] = functools.partial(
            tokamax.dot_product_attention, is_causal=True, implementation=name)
    return impls


def reference_attention(q, k, v):
    """Causal softmax attention written plainly, in fp32: `[B, S, H, D]` in fp32."""
    import jax
    import jax.numpy as jnp

    q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    length = q.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def ragged_impls(tokamax, names=TOKAMAX_RAGGED) -> dict:
    """name -> matmul(lhs `[N, K]`, rhs `[G, K, P]`, group_sizes int32 `[G]`) -> `[N, P]`."""
    import jax

    from jaxspeed.moe.grouped import grouped_matmul

    impls = {"jaxspeed grouped_matmul":
                 lambda x, w, sizes: grouped_matmul(x, w, sizes).astype(x.dtype),
             "jax.lax.ragged_dot (XLA)": jax.lax.ragged_dot}
    for name in names if tokamax else ():
        impls[f"tokamax {name}"] = functools.partial(tokamax.ragged_dot, implementation=name)
    return impls


def expert_ffn(matmul):
    """The experts' FFN `relu(x @ w_in[g]) @ w_out[g]` on rows sorted by expert, by `matmul`."""
    import jax

    def ffn(x, w_in, w_out, sizes):
        return matmul(jax.nn.relu(matmul(x, w_in, sizes)), w_out, sizes)

    return ffn


def reference_ragged(lhs, rhs, sizes):
    """`lhs` rows of group g times `rhs[g]`, written plainly: every group's product, then each
    row's own, in fp32."""
    import jax.numpy as jnp

    lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    every = jnp.einsum("nk,gkp->gnp", lhs, rhs)
    group = jnp.repeat(jnp.arange(sizes.shape[0]), sizes, total_repeat_length=lhs.shape[0])
    return jnp.take_along_axis(every, group[None, :, None], axis=0)[0]


def fwd_bwd(fn):
    """`(out, *grads)` of `fn`'s first `n` arguments for the cotangent `d_out`, jitted."""
    import jax

    def step(*args):
        *inputs, d_out = args
        diff = [a for a in inputs if a.dtype.kind == "f" or str(a.dtype) == "bfloat16"]
        rest = inputs[len(diff):]
        out, pull = jax.vjp(lambda *d: fn(*d, *rest), *diff)
        return (out, *pull(d_out.astype(out.dtype)))

    return jax.jit(step)


def routing_sizes(case: dict, experts: int):
    """int32 `[E]` rows per expert of a top-k routing of random logits (seed 0)."""
    import numpy as np

    logits = np.random.default_rng(0).normal(size=(case["tokens"], experts))
    chosen = np.argsort(-logits, axis=1)[:, :case["k"]]
    return np.bincount(chosen.ravel(), minlength=experts).astype(np.int32)


def cases(tokamax, config: dict, *, attention=TOKAMAX_ATTENTION, ragged=TOKAMAX_RAGGED):
    """`(group, case, impls, reference, args, matmul FLOPs, baseline name)`, one per case."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = config["attention"]
    b, s, h, kv, d = a["batch"], a["seq"], a["heads"], a["kv_heads"], a["head_dim"]
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(b, s, h, d), (b, s, kv, d), (b, s, kv, d), (b, s, h, d)]
    args = [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]
    # causal: half of Q·Kᵀ and P·V forward, and of the five backward matmuls (Q·Kᵀ again, dV,
    # dP, dQ, dK), as a FlashAttention kernel that skips the masked blocks does
    flops = 7 * 2 * b * h * s * s * d / 2
    yield ("attention", f"llama_1b B{b} S{s} H{h}/{kv} D{d} causal bf16 fwd+bwd",
           attention_impls(tokamax, a, attention), reference_attention, args, flops, "jaxspeed blocked")

    r = config["ragged"]
    rows = r["tokens"] * r["k"]
    for experts, hidden in r["experts"]:
        sizes = routing_sizes(r, experts)
        keys = jax.random.split(jax.random.key(experts), 4)
        x = jax.random.normal(keys[0], (rows, r["d_model"]), jnp.bfloat16)
        w_in = (jax.random.normal(keys[1], (experts, r["d_model"], hidden), jnp.float32)
                / np.sqrt(r["d_model"])).astype(jnp.bfloat16)
        w_out = (jax.random.normal(keys[2], (experts, hidden, r["d_model"]), jnp.float32)
                 / np.sqrt(hidden)).astype(jnp.bfloat16)
        d_out = jax.random.normal(keys[3], (rows, r["d_model"]), jnp.bfloat16)
        impls = {name: expert_ffn(fn) for name, fn in ragged_impls(tokamax, ragged).items()}
        # two grouped matmuls forward, two each backward (d lhs, d rhs)
        flops = 6 * 2 * rows * r["d_model"] * hidden
        yield (f"ragged E{experts}x{hidden}", f"expert FFN E{experts}x{hidden} T{r['tokens']} top-{r['k']} "
               f"M{r['d_model']} bf16 fwd+bwd", impls, expert_ffn(reference_ragged),
               [x, w_in, w_out, jnp.asarray(sizes), d_out], flops, "jaxspeed grouped_matmul")


def _error(err: Exception) -> str:
    """One line of an exception."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}"


# --- prediction (--dry-run) -----------------------------------------------------------------

def _multipliers(own: dict, entry: str, *, unknown_trips: float, taken) -> dict[str, float]:
    """Per computation: what to multiply its roofline cost by (on top of `parse`'s runs)."""
    from jaxspeed.cost import hlo

    mult: dict[str, float] = {}

    def visit(name: str, factor: float, depth: int = 0) -> None:
        if depth > 64 or mult.get(name, -1.0) >= factor:
            return
        mult[name] = factor
        for ins in own.get(name, ()):
            for role, callee in hlo.callees(ins):
                unknown = ins.op == "while" and role == "body" and hlo.trip_count(ins) is None
                visit(callee, factor * (unknown_trips if unknown else 1.0), depth + 1)
            found = hlo.branches(ins)
            pick = taken(len(found)) if (found and taken) else None
            for i, callee in enumerate(found):
                visit(callee, factor * (pick is None or i == pick), depth + 1)
            if ins.op == "call":
                for callee in hlo.to_apply(ins):
                    visit(callee, factor, depth + 1)

    visit(entry, 1.0)
    return mult


def predict_ms(hlo_text: str, *, flops: float, unknown_trips: float = 1.0, taken=None) -> dict:
    """The roofline's time (`jaxspeed.cost.roofline.op_costs`, calibrated, one H100) of a
    compiled program, with three corrections:
      - a Pallas kernel (`KERNEL_TARGETS`) is a custom call whose FLOPs the HLO does not show:
        the case's matmul `flops` that no XLA op accounts for are given to the kernels, which
        then take `max(their bytes / HBM, those FLOPs at the calibrated matmul rate)`;
      - a `while` whose trip count XLA does not know (blocked attention's causal inner loops)
        counts `unknown_trips` times per run of its parent, not once;
      - a conditional (`grouped_matmul`'s choice of block size) counts the branch
        `taken(branches)` only (None: every branch, the roofline's upper bound).
    Returns ms, the XLA ops' and the kernels' shares, and the matmul FLOPs seen in XLA ops."""
    from jaxspeed.cost import hlo, roofline
    from jaxspeed.cost.peaks import gpu_peaks
    from jaxspeed.gpu import targets

    spec = targets.load(DRY_RUN_TARGET)
    peaks = gpu_peaks(spec.device_kind)
    own, _, entry = hlo.parse(hlo_text)
    where = {ins.name: comp for comp, instructions in own.items() for ins in instructions}
    kernels = {ins.name for instructions in own.values() for ins in instructions
               if (hlo.custom_call_target(ins) or "").startswith(KERNEL_TARGETS)}
    mult = _multipliers(own, entry, unknown_trips=unknown_trips, taken=taken)
    xla_s = kernel_bytes_s = seen = 0.0
    for op in roofline.op_costs(hlo_text, peaks=peaks, hbm=spec.memory_bandwidth):
        factor = mult.get(where.get(op.name, entry), 1.0)
        seen += op.flops * op.executions * factor
        if op.name in kernels:
            kernel_bytes_s += op.total_seconds * factor
        else:
            xla_s += op.total_seconds * factor
    kernel_s = 0.0
    if kernels:
        unseen = max(flops - seen, 0.0)
        kernel_s = max(kernel_bytes_s, unseen / (peaks.bf16 * roofline.MATMUL_EFFICIENCY))
    return {"ms": (xla_s + kernel_s) * 1e3, "xla_ms": xla_s * 1e3, "kernel_ms": kernel_s * 1e3,
            "kernels": len(kernels), "xla_matmul_flops": seen}


def _taken_branch(sizes, rows: int):
    """The `lax.switch` branch `grouped_matmul` takes for `sizes` (`grouped._in_blocks`)."""
    from jaxspeed.moe.grouped import block_capacities

    import numpy as np

    sizes = np.asarray(sizes)
    capacities = block_capacities(rows, len(sizes))
    index = sum(int(sizes.max()) > c for c in capacities)
    return lambda count: min(index, count - 1)


def dry_run(tokamax) -> int:
    """Compiles every case for one H100 without a GPU and prints the roofline's times."""
    import jax
    import numpy as np

    from jaxspeed.gpu import deviceless

    if deviceless.missing():
        print(f"{NAME} --dry-run: skipped, no deviceless GPU compile here: "
              f"{deviceless.missing()}")
        return 0
    device = deviceless.devices(DRY_RUN_TARGET, 1)[0]
    lines, rows = [], []
    built = list(cases(tokamax, GPU_CASE))  # the inputs on the CPU: only their shapes are used
    sizes_of = {c[1]: np.asarray(c[4][3]) for c in built if c[0].startswith("ragged")}
    with jax.default_device(device), tokamax.config.cross_compile(True):
        for group, case, impls, _, args, flops, baseline in built:
            shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
            corrections = {}  # for ours only: see predict_ms
            if group == "attention":  # causal: query block i sees i + 1 key blocks
                blocks = GPU_CASE["attention"]["seq"] // GPU_CASE["attention"]["block"]
                corrections["unknown_trips"] = (blocks + 1) / 2
            else:
                corrections["taken"] = _taken_branch(sizes_of[case], args[0].shape[0])
            predicted = {}
            for name, fn in impls.items():
                try:
                    text = fwd_bwd(fn).lower(*shapes).compile().as_text()
                    predicted[name] = predict_ms(
                        text, flops=flops, **(corrections if name == baseline else {}))
                except Exception as err:  # noqa: BLE001 - every failure is a result here
                    predicted[name] = {"error": _error(err)}
            base = predicted.get(baseline, {}).get("ms")
            for name, p in predicted.items():
                if "error" in p:
                    rows.append([group, name, "failed", "", "", p["error"][:90]])
                    lines.append({"benchmark": NAME, "case": f"{case}: {name}",
                                  "skipped": p["error"], "predicted": True})
                    continue
                rows.append([group, name, round(p["ms"], 3), round(p["kernel_ms"], 3),
                             _common.ratio(base, p["ms"]) if base else "", ""])
                lines.append(_common.result(
                    NAME, case=f"{case}: {name} (predicted, {DRY_RUN_TARGET} deviceless)",
                    jaxspeed=p["ms"], baseline=base or float("nan"), unit="ms predicted",
                    ratio=_common.ratio(base, p["ms"]) if base else float("nan"),
                    kernel_ms=round(p["kernel_ms"], 4), xla_ms=round(p["xla_ms"], 4)))
    print(f"{NAME} --dry-run: roofline-predicted fwd+bwd ms on one {DRY_RUN_TARGET} "
          f"(deviceless compile; ratio = ours in use / it)")
    _common.print_table(["group", "implementation", "ms", "of it kernels", "ratio", "failed"],
                        rows)
    for line in lines:
        _common.print_json(line)
    return 0


# --- measurement (GPU, --cpu-check) ---------------------------------------------------------

def max_rel_diff(got, want) -> float:
    """The largest over leaves of max |got - want| / max |want|, in fp32."""
    import jax
    import numpy as np

    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        worst = max(worst, float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30)))
    return worst


def measure(tokamax, config: dict, *, label: str, **names) -> int:
    """Checks and times every case; prints the table and one JSON line per implementation."""
    import jax

    lines, rows, headline = [], [], None
    for group, case, impls, reference, args, _, baseline in cases(tokamax, config, **names):
        want = jax.block_until_ready(fwd_bwd(reference)(*args))
        timings = {}
        for name, fn in impls.items():
            try:
                step = fwd_bwd(fn)
                diff = max_rel_diff(jax.block_until_ready(step(*args)), want)
                if not diff <= TOLERANCE:
                    raise ValueError(f"differs from the fp32 reference by {diff:.3g} "
                                     f"(max relative; tolerance {TOLERANCE:.3g})")
                timings[name] = (_common.timed(step, args, iters=config["iters"],
                                               rounds=config["rounds"]), diff)
            except Exception as err:  # noqa: BLE001 - a failing implementation is a result
                timings[name] = (None, _error(err))
        del want
        base = (timings.get(baseline) or (None,))[0]
        for name, (ms, diff) in timings.items():
            if ms is None:
                rows.append([group, name, "skipped", "", "", diff[:90]])
                lines.append({"benchmark": NAME, "case": f"{case}: {name}", "skipped": diff})
                continue
            ratio = _common.ratio(base, ms) if base else float("nan")
            rows.append([group, name, round(ms, 3), round(base, 3) if base else "", ratio,
                         f"{diff:.2g}"])
            line = _common.result(NAME, case=f"{case}: {name}{label}", jaxspeed=ms,
                                  baseline=base or float("nan"), unit="ms fwd+bwd (median)",
                                  ratio=ratio, max_rel_diff=round(diff, 5))
            lines.append(line)
            if group == "attention" and name.startswith("tokamax") and (
                    headline is None or ms < headline["jaxspeed"]):
                headline = line
    print(f"{NAME}: fwd+bwd ms{label}; baseline = ours in use (blocked attention, "
          f"grouped_matmul); ratio = baseline / it")
    _common.print_table(["group", "implementation", "ms", "baseline ms", "ratio",
                         "max rel diff / why skipped"], rows)
    for line in lines:
        _common.print_json(line)
    if headline is not None:
        _common.print_json({**headline, "case": "headline, fastest tokamax attention: "
                            + headline["case"]})
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true",
                      help="compile for one H100 without a GPU; print the predicted times")
    mode.add_argument("--cpu-check", action="store_true",
                      help="tiny sizes on CPU, ours and tokamax's xla implementations")
    args = parser.parse_args(argv)
    tokamax = load_tokamax()
    if tokamax is None:
        print(f"{NAME}: tokamax is missing (pip install tokamax); nothing to compare")
        return 0
    print(f"{NAME}: tokamax {tokamax.__version__}", flush=True)
    if args.dry_run:
        return dry_run(tokamax)
    import jax

    if args.cpu_check:
        return measure(tokamax, CPU_CASE, label=" (cpu-check, tiny, not a measurement)",
                       attention=("xla", "xla_chunked"), ragged=("xla",))
    if jax.devices()[0].platform != "gpu":
        raise SystemExit(f"{NAME} needs a GPU (JAX sees {jax.devices()}); `--dry-run` "
                         "predicts it without one, `--cpu-check` runs tiny sizes on CPU")
    return measure(tokamax, GPU_CASE, label=f" ({jax.devices()[0].device_kind})")


if __name__ == "__main__":
    sys.exit(main())
