"""One MoE layer on one NVIDIA GPU: the Pallas dispatch/combine kernels against one-hot einsums.

Run on a machine with a GPU: `python benchmarks/gpu_moe.py` (an H200 is the case the issue
names). Two parts, every figure and its baseline measured in the same run:
  - Layer: forward+backward of one top-2 MoE layer in bf16 (fp32 gating), as
    `benchmarks/moe_layer.py` does on CPU, but with `impl="pallas"` (the kernels compiled:
    Mosaic GPU on Hopper, Triton on older GPUs): T = 4096 tokens, M = 512, capacity_factor 1.0, relu FFN, E x hidden in
    {8 x 2048, 32 x 512, 64 x 256}, against GShard's `[T, E, C]` one-hot einsum layer with the
    same gating. Time: median over rounds of `--iters` back-to-back calls; memory:
    `memory_analysis()` of the compiled step. Checked first (bf16, and fp32 at "highest"
    matmul precision) against the einsum layer and the XLA index path.
  - Bandwidth: the forward `moe_dispatch` and `moe_combine` ops (the XLA scatter of the int32
    slot table included) at T = 32768, M = 4096, E = 64, top-2, bf16, for a few block sizes.
    Bytes moved: dispatch reads the kept token rows and the slot table and writes the whole
    `[E, C, M]` buffer; combine reads the kept expert rows, the `[k, T]` slots and weights and
    writes `[T, M]`. On Hopper the Mosaic GPU kernels (the default there) are timed beside the
    Triton ones. Baseline: a plain device-to-device copy (`jnp.copy` under `jax.jit`, no
    donation) that moves the same number of bytes (reads half, writes half), timed the same
    way: the bandwidth this GPU reaches on the simplest traffic. ratio = kernel TB/s / copy
    TB/s = copy time / kernel time. The XLA gather path (`jaxspeed.moe.dispatch(impl="xla")`)
    is timed too, for reference.
Target: dispatch and combine at >= 70% of the copy's bandwidth. Headline: the layer at E = 64,
ratio = einsum time / jaxspeed time. The two lines before the layer lines are the dispatch and
combine bandwidths.
Off GPU it stops with a message; `--cpu-check` runs all of it at tiny sizes on CPU with the
kernels interpreted (a smoke test of the code, not a measurement: its lines say "interpreted").
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402
import moe_layer  # noqa: E402

NAME = "gpu_moe"
GPU_CASE = {
    "layer": {"batch": 8, "seq": 512, "d_model": 512, "k": 2, "capacity_factor": 1.0,
              "experts": ((8, 2048), (32, 512), (64, 256))},
    "bandwidth": {"tokens": 32768, "d_model": 4096, "experts": 64, "k": 2,
                  "capacity_factor": 1.0, "blocks": ((32, 256), (16, 256), (64, 256),
                                                     (32, 128), (32, 512), (64, 512))},
    "check": {"batch": 2, "seq": 256, "d_model": 256, "k": 2, "capacity_factor": 1.0,
              "experts": ((8, 128),)},
    "iters": 20, "rounds": 5,
}
CPU_CHECK = {
    "layer": {"batch": 2, "seq": 32, "d_model": 64, "k": 2, "capacity_factor": 1.0,
              "experts": ((4, 32),)},
    "bandwidth": {"tokens": 128, "d_model": 64, "experts": 8, "k": 2, "capacity_factor": 1.0,
                  "blocks": ((32, 256),)},
    "check": {"batch": 2, "seq": 32, "d_model": 64, "k": 2, "capacity_factor": 1.0,
              "experts": ((4, 32),)},
    "iters": 1, "rounds": 1,
}


def layer_steps(case: dict):
    """Jitted fwd+bwd steps: the Pallas layer, the XLA-path layer and the einsum layer."""
    opts = dict(k=case["k"], capacity_factor=case["capacity_factor"])
    return {
        "pallas": moe_layer.fwd_bwd(functools.partial(moe_layer.jaxspeed_layer, impl="pallas",
                                                      **opts)),
        "xla": moe_layer.fwd_bwd(functools.partial(moe_layer.jaxspeed_layer, impl="xla", **opts)),
        "einsum": moe_layer.fwd_bwd(functools.partial(moe_layer.einsum_layer, **opts)),
    }


class Steps:
    """The three layers' fwd+bwd steps, compiled once per (name, dtype, shapes) and kept."""

    def __init__(self, case: dict):
        self.fns = layer_steps(case)
        self.compiled = {}

    def get(self, name: str, args):
        import jax

        key = (name, *((a.shape, str(a.dtype)) for a in jax.tree.leaves(args)))
        if key not in self.compiled:
            self.compiled[key] = self.fns[name].lower(*args).compile()
        return self.compiled[key]


def check(case: dict, steps: Steps) -> dict[str, float]:
    """Largest relative difference of the Pallas layer's output and gradients to the others.

    bf16 (as benchmarked) and fp32, against the einsum layer and the XLA index path. fp32
    runs under "highest" matmul precision (no TF32).
    """
    import jax

    (num_experts, hidden), = case["experts"]
    worst = {}
    for dtype in ("bfloat16", "float32"):
        args = moe_layer.make_inputs(case, num_experts, hidden, dtype)
        if dtype == "bfloat16":
            got = {name: jax.block_until_ready(steps.get(name, args)(*args))
                   for name in steps.fns}
        else:
            with jax.default_matmul_precision("highest"):
                got = {name: jax.block_until_ready(fn(*args))
                       for name, fn in steps.fns.items()}
        for other in ("einsum", "xla"):
            diffs = moe_layer.max_rel_diff(got["pallas"], got[other])
            worst[f"{dtype} vs {other}"] = max(diffs.values())
    return worst


def run_layer(case: dict, num_experts: int, hidden: int, steps: Steps, *, iters: int,
              rounds: int) -> dict:
    """Times the three layers at one expert shape (bf16); returns one table row."""
    import jax

    args = moe_layer.make_inputs(case, num_experts, hidden, "bfloat16")
    row = {"experts": num_experts, "hidden": hidden, "ms": {}, "bytes": {}}
    for name in steps.fns:
        try:
            compiled = steps.get(name, args)
            row["bytes"][name] = moe_layer.step_bytes(compiled)
            row["ms"][name] = _common.timed(compiled, args, iters=iters, rounds=rounds)
        except Exception as err:  # e.g. out of memory for the one-hot tensors
            row.setdefault("errors", {})[name] = f"{type(err).__name__}: {str(err)[:200]}"
    routing = jax.jit(lambda x, g: moe_layer.route(
        x, g, k=case["k"], capacity_factor=case["capacity_factor"]))(*args[:2])
    row["capacity"] = routing.capacity
    if "pallas" in row["ms"]:
        for other in ("einsum", "xla"):
            if other in row["ms"]:
                row[f"ratio_{other}"] = ratio_of(row["ms"][other], row["ms"]["pallas"])
    return row


def bandwidth_inputs(case: dict, dtype):
    """Tokens `[T, M]`, a top-k routing of random logits, and expert outputs `[E, C, M]`."""
    import jax

    from jaxspeed.moe import top_k_gating

    kx, kl, ky = jax.random.split(jax.random.key(0), 3)
    tokens, width, num_experts = case["tokens"], case["d_model"], case["experts"]
    x = jax.random.normal(kx, (tokens, width), dtype)
    logits = jax.random.normal(kl, (tokens, num_experts))
    routing = jax.jit(lambda l: top_k_gating(l, case["k"], case["capacity_factor"]))(logits)
    y = jax.random.normal(ky, (num_experts, routing.capacity, width), dtype)
    return x, routing, y


def moved_bytes(case: dict, routing, itemsize: int) -> dict[str, int]:
    """Bytes each forward op must move at least (see the module docstring)."""
    import numpy as np

    tokens, width, num_experts = case["tokens"], case["d_model"], case["experts"]
    kept = int(np.sum(np.asarray(routing.weight) > 0))
    slots = num_experts * routing.capacity
    k = routing.expert_index.shape[1]
    return {
        "dispatch": (kept + slots) * width * itemsize + slots * 4 + 2 * tokens * k * 4,
        "combine": (kept + tokens) * width * itemsize + 3 * tokens * k * 4,
    }


def copy_ms(num_bytes: int, *, iters: int, rounds: int) -> float:
    """Median ms of a device-to-device copy moving `num_bytes`: `num_bytes / 2` read, as many
    written (`jnp.copy` of a bf16 vector under `jax.jit`; without donation XLA must write a
    new buffer)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((max(num_bytes // 4, 1),), jnp.bfloat16)  # 2 bytes read + 2 written each
    return _common.timed(jax.jit(jnp.copy), (x,), iters=iters, rounds=rounds)


def run_bandwidth(case: dict, *, iters: int, rounds: int, interpret: bool) -> dict:
    """Times forward dispatch and combine (kernels at several block sizes, and XLA) and, as
    their baseline, a copy of the same bytes; TB/s = bytes moved / time."""
    import jax
    import jax.numpy as jnp

    from jaxspeed.moe import combine, dispatch
    from pallas_kernels import backend as _backend
    from pallas_kernels.moe_kernels import moe_combine, moe_dispatch

    x, routing, y = bandwidth_inputs(case, jnp.bfloat16)
    need = moved_bytes(case, routing, 2)
    e_idx, pos, w = routing.expert_index, routing.position, routing.weight
    num_experts, capacity = case["experts"], routing.capacity
    timing = dict(iters=iters, rounds=rounds)
    rows = []
    # On Hopper the default is the Mosaic GPU kernels (their own tiling), timed beside the
    # Triton ones at each block size; elsewhere the Triton kernels are the default.
    variants = [(f"pallas triton {r}x{c}", dict(block_rows=r, block_cols=c, interpret=interpret,
                                                 backend=_backend.TRITON))
                for r, c in case["blocks"]]
    if _backend.kernel_backend() == _backend.MOSAIC_GPU:
        variants.insert(0, ("pallas mosaic_gpu", dict(backend=_backend.MOSAIC_GPU)))
    for name, opts in variants:
        fns = {
            "dispatch": (jax.jit(lambda x, e, p: moe_dispatch(x, e, p, num_experts, capacity,
                                                              **opts)), (x, e_idx, pos)),
            "combine": (jax.jit(lambda y, e, p, w: moe_combine(y, e, p, w, **opts)),
                        (y, e_idx, pos, w)),
        }
        row = {"impl": name}
        for op, (fn, args) in fns.items():
            row[op] = _common.timed(fn, args, **timing)
        rows.append(row)
    xla = {"impl": "xla gather",
           "dispatch": _common.timed(jax.jit(lambda x, r: dispatch(x, r, num_experts, impl="xla")),
                                     (x, routing), **timing),
           "combine": _common.timed(jax.jit(lambda y, r: combine(y, r, impl="xla")), (y, routing),
                                    **timing)}
    rows.append(xla)
    copy = {"impl": "copy (baseline)", **{op: copy_ms(need[op], **timing) for op in need}}
    rows.append(copy)
    for row in rows:
        for op in ("dispatch", "combine"):
            row[f"{op}_TBps"] = need[op] / (row[op] * 1e-3) / 1e12
            row[f"{op}_of_copy"] = copy[op] / row[op]
    kernels = [r for r in rows if r["impl"].startswith("pallas")]
    best = {op: max(kernels, key=lambda r: r[f"{op}_TBps"]) for op in ("dispatch", "combine")}
    return {"rows": rows, "best": best, "xla": xla, "copy": copy, "bytes": need,
            "capacity": capacity, "default": kernels[0]["impl"]}


def ratio_of(better: float, worse: float) -> float:
    """`better / worse` to 4 significant digits (`_common.ratio` keeps 3 decimals, which
    rounds a small ratio, such as an interpreted kernel's, to 0)."""
    return float(f"{better / worse:.4g}") if worse else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-check", action="store_true",
                        help="tiny sizes on CPU, kernels interpreted (a smoke test)")
    parser.add_argument("--quick", action="store_true", help="the same as --cpu-check")
    parser.add_argument("--iters", type=int, default=None, help="calls per timed round")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth part")
    args = parser.parse_args(argv)
    cpu_check = args.cpu_check or args.quick
    if cpu_check:
        moe_layer.use_one_cpu_device()

    import jax

    from pallas_kernels import backend as _backend

    on_gpu = _backend.on_gpu()
    if not on_gpu and not cpu_check:
        raise SystemExit(f"this benchmark needs an NVIDIA GPU (JAX's backend is "
                         f"{jax.default_backend()!r}); `--cpu-check` runs it at tiny sizes on "
                         f"CPU with the kernels interpreted")
    case = dict(CPU_CHECK if cpu_check else GPU_CASE)
    iters = args.iters or case["iters"]
    device = jax.devices()[0]
    layer = case["layer"]
    tokens = layer["batch"] * layer["seq"]
    print(f"MoE layer on {device.device_kind} ({device.platform}): Pallas dispatch/combine vs "
          f"GShard one-hot einsums, same gating; T={tokens}, M={layer['d_model']}, "
          f"top-{layer['k']}, capacity_factor {layer['capacity_factor']}, relu FFN, bf16"
          + ("; kernels interpreted (CPU check, not a measurement)" if not on_gpu else ""))

    if (layer["k"], layer["capacity_factor"]) != (case["check"]["k"],
                                                  case["check"]["capacity_factor"]):
        raise SystemExit("the check and the layer cases must share k and capacity_factor")
    steps = Steps(layer)
    worst = check(case["check"], steps)
    tolerance = {"bfloat16": moe_layer.TOLERANCE["bfloat16"], "float32": 1e-4}
    bad = {k: v for k, v in worst.items() if not v <= tolerance[k.split()[0]]}
    print("check (output and gradients, max relative difference): "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
          + (f"  <-- TOO LARGE: {sorted(bad)}" if bad else ""))
    if bad:
        raise SystemExit(f"the Pallas layer differs from the references: {bad}")

    rows = [run_layer(layer, e, h, steps, iters=iters, rounds=case["rounds"])
            for e, h in layer["experts"]]
    print()
    _common.print_table(
        ["E x hidden", "C", "pallas ms", "xla ms", "einsum ms", "ratio", "pallas MiB",
         "einsum MiB"],
        [[f"{r['experts']}x{r['hidden']}", r["capacity"], r["ms"].get("pallas", "-"),
          r["ms"].get("xla", "-"), r["ms"].get("einsum", "-"), r.get("ratio_einsum", "-"),
          _common.mib(r["bytes"].get("pallas", 0)), _common.mib(r["bytes"].get("einsum", 0))]
         for r in rows],
    )
    for r in rows:
        for name, err in r.get("errors", {}).items():
            print(f"E={r['experts']}: {name} failed: {err}")

    bw = None
    if not args.no_bandwidth:
        bcase = case["bandwidth"]
        bw = run_bandwidth(bcase, iters=iters, rounds=case["rounds"], interpret=not on_gpu)
        print(f"\nForward dispatch / combine, T={bcase['tokens']}, M={bcase['d_model']}, "
              f"E={bcase['experts']}, C={bw['capacity']}, top-{bcase['k']}, bf16; bytes "
              f"moved: dispatch {bw['bytes']['dispatch']:,}, combine {bw['bytes']['combine']:,}; "
              f"baseline: a device-to-device copy of as many bytes, in this run:")
        _common.print_table(
            ["impl (rows x cols)", "dispatch ms", "TB/s", "of copy", "combine ms", "TB/s",
             "of copy"],
            [[r["impl"], r["dispatch"], r["dispatch_TBps"], f"{r['dispatch_of_copy']:.0%}",
              r["combine"], r["combine_TBps"], f"{r['combine_of_copy']:.0%}"]
             for r in bw["rows"]],
        )

    print()
    kind = device.device_kind + ("" if on_gpu else " interpreted")
    results = []
    for op in ("dispatch", "combine") if bw else ():
        best, xla, copy = bw["best"][op], bw["xla"], bw["copy"]
        results.append(_common.result(
            NAME,
            case=(f"{op} fwd T={bcase['tokens']} M={bcase['d_model']} E={bcase['experts']} "
                  f"top{bcase['k']} bf16 {kind}"),
            jaxspeed=best[f"{op}_TBps"], baseline=copy[f"{op}_TBps"],
            unit="TB/s", ratio=ratio_of(best[f"{op}_TBps"], copy[f"{op}_TBps"]),
            baseline_source="jnp.copy moving as many bytes, timed in this run",
            ms=round(best[op], 4), copy_ms=round(copy[op], 4), bytes=bw["bytes"][op],
            blocks=best["impl"], default_blocks=bw["default"],
            xla_TBps=float(f"{xla[op + '_TBps']:.4g}"),
            xla_ratio=ratio_of(xla[f"{op}_TBps"], copy[f"{op}_TBps"]),
        ))
    for r in rows:
        if "ratio_einsum" not in r:
            continue
        results.append(_common.result(
            NAME,
            case=(f"E={r['experts']} hidden={r['hidden']} T={tokens} M={layer['d_model']} "
                  f"top{layer['k']} cf={layer['capacity_factor']} relu bf16 {kind}"),
            jaxspeed=r["ms"]["pallas"], baseline=r["ms"]["einsum"], unit="ms fwd+bwd (median)",
            ratio=r["ratio_einsum"], xla_ms=round(r["ms"].get("xla", float("nan")), 4),
            ratio_vs_xla=r.get("ratio_xla"),
            capacity=r["capacity"],
            peak_MiB={n: round(_common.mib(b), 1) for n, b in r["bytes"].items()},
            check_max_rel_diff=worst,
        ))
    if "ratio_einsum" not in rows[-1]:
        raise SystemExit("the layer comparison failed at the headline expert count (see above)")
    for obj in results:
        _common.print_json(obj)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
