"""Block-sparse attention on CPU: the XLA path against dense `jax.nn.dot_product_attention`.

Forward + backward (`jax.vjp` of the attention, all three input gradients) of
`jaxspeed.attention.block_sparse.block_sparse_attention(..., impl="xla")` against
`jax.nn.dot_product_attention(..., mask=..., implementation="xla")` given the same mask (the
layout expanded to tokens, with the causal mask), side by side in one run. Layout: DeepSpeed's
`FixedSparsityConfig(block=64, num_local_blocks=4, num_global_blocks=1,
attention="unidirectional")` with causal attention, shared by 8 heads of 64, batch 1, fp32
(about 14-19% of the blocks). Block 64 rather than DeepSpeed's default 16: on CPU a 16 x 16 tile
is too small a matmul to be efficient.
  - Time: each step compiled ahead, run once, then timed interleaved (A B, B A, ...); the table
    shows the median (and min) wall time. The dq, dk, dv of the two paths are compared.
  - Memory: the compiled step's arguments + outputs + temporaries (`memory_analysis()`).
  - Fit: the longest power-of-2 sequence each path compiles within 16 GiB (compile only).
Target: ratio = dense time / sparse time >= 0.5 / density. Headline: seq 8192.
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

NAME = "sparse_attention"
FULL = {"seqs": (2048, 4096, 8192), "batch": 1, "heads": 8, "head_dim": 64, "block": 64,
        "local": 4, "repeats": 3, "fit_gib": 16.0, "fit_max": 2**18}
QUICK = {"seqs": (256,), "batch": 1, "heads": 2, "head_dim": 32, "block": 32,
         "local": 4, "repeats": 1, "fit_gib": 1 / 64, "fit_max": 1024}


def fixed_layout(case: dict, seq: int):
    """The benchmark's layout: DeepSpeed's unidirectional Fixed pattern, `[heads, nb, nb]`."""
    from jaxspeed.attention.sparsity import FixedSparsityConfig

    config = FixedSparsityConfig(
        num_heads=case["heads"], block=case["block"], num_local_blocks=case["local"],
        num_global_blocks=1, attention="unidirectional",
    )
    return config.make_layout(seq)


def steps(case: dict, seq: int):
    """The two jitted forward+backward steps and the density of the layout's computed blocks.

    Returns:
      `(sparse, dense, density)`: `sparse(q, k, v, do)` and `dense(q, k, v, do, mask)` return
      `(dq, dk, dv)`; `density` counts the blocks kept by the causal mask, over `nb**2`.
    """
    import jax
    import numpy as np

    from jaxspeed.attention.block_sparse import block_sparse_attention

    layout = fixed_layout(case, seq)
    kept = layout.astype(bool) & np.tril(np.ones(layout.shape[1:], bool))

    def sparse(q, k, v, do):
        attend = lambda q, k, v: block_sparse_attention(q, k, v, layout, causal=True, impl="xla")
        return jax.vjp(attend, q, k, v)[1](do)

    def dense(q, k, v, do, mask):
        attend = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask, implementation="xla")
        return jax.vjp(attend, q, k, v)[1](do)

    return jax.jit(sparse), jax.jit(dense), float(kept.mean())


def token_mask(case: dict, seq: int):
    """`[1, 1, seq, seq]` bool: the layout (shared by the heads) expanded, and causal."""
    from jaxspeed.attention.block_sparse import expand_layout

    return expand_layout(fixed_layout(case, seq)[:1], seq_len=seq, causal=True)[None]


def step_bytes(compiled) -> int:
    """Arguments + outputs + temporaries of a compiled step (aliased buffers counted once)."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def run_case(case: dict, seq: int, repeats: int) -> dict:
    """Times both paths at one sequence length; returns the figures of one table row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    shape = (case["batch"], seq, case["heads"], case["head_dim"])
    q, k, v, do = (jax.random.normal(key, shape, jnp.float32)
                   for key in jax.random.split(jax.random.key(seq), 4))
    mask = jnp.asarray(token_mask(case, seq))
    sparse, dense, density = steps(case, seq)
    compiled, compile_s, first = {}, {}, {}
    calls = (("sparse", (q, k, v, do)), ("dense", (q, k, v, do, mask)))
    for name, args in calls:
        fn = sparse if name == "sparse" else dense
        start = time.perf_counter()
        compiled[name] = fn.lower(*args).compile()
        compile_s[name] = time.perf_counter() - start
        first[name] = jax.block_until_ready(compiled[name](*args))
    error = max(float(jnp.abs(a - b).max() / jnp.abs(b).max())
                for a, b in zip(first["sparse"], first["dense"]))
    times = {"sparse": [], "dense": []}
    for i in range(repeats):
        for name, args in calls if i % 2 == 0 else calls[::-1]:
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            times[name].append(time.perf_counter() - start)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    return {
        "seq": seq, "density": density, "target": 0.5 / density,
        "sparse_ms": med["sparse"], "dense_ms": med["dense"],
        "min_ms": {n: round(min(t) * 1e3, 1) for n, t in times.items()},
        "ratio": _common.ratio(med["dense"], med["sparse"]),
        "bytes": {n: step_bytes(c) for n, c in compiled.items()},
        "compile_s": {n: round(s, 2) for n, s in compile_s.items()},
        "max_rel_grad_diff": float(np.float32(error)),
    }


def longest_fit(case: dict, path: str, budget: float, start: int, limit: int):
    """The longest `start * 2**i <= limit` whose step compiles within `budget` bytes.

    Returns:
      `(longest or None, {seq: bytes})` over the sizes compiled (the last one is over budget,
      unless `limit` was reached).
    """
    import jax
    import jax.numpy as jnp

    found, sizes, seq = None, {}, start
    while seq <= limit:
        x = jax.ShapeDtypeStruct((case["batch"], seq, case["heads"], case["head_dim"]), jnp.float32)
        sparse, dense, _ = steps(case, seq)
        if path == "sparse":
            lowered = sparse.lower(x, x, x, x)
        else:
            lowered = dense.lower(x, x, x, x, jax.ShapeDtypeStruct((1, 1, seq, seq), jnp.bool_))
        sizes[seq] = step_bytes(lowered.compile())
        if sizes[seq] > budget:
            break
        found, seq = seq, seq * 2
    return found, sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (tests)")
    parser.add_argument("--seqs", type=int, nargs="+", default=None,
                        help="sequence lengths (the last is the headline)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps of each (median)")
    parser.add_argument("--no-fit", action="store_true", help="skip the longest-fit search")
    args = parser.parse_args(argv)
    _common.use_cpu_devices()

    import jax

    case = dict(QUICK if args.quick else FULL)
    seqs = tuple(args.seqs or case["seqs"])
    repeats = args.repeats or case["repeats"]
    for seq in seqs:
        if seq % (case["block"] * case["local"]):
            raise SystemExit(f"--seqs: {seq} is not a multiple of block * num_local_blocks = "
                             f"{case['block'] * case['local']}")
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")

    print(
        f"Block-sparse attention fwd+bwd on CPU ({jax.device_count()} devices, one used): "
        f"XLA gather path vs jax.nn.dot_product_attention with the same mask; batch "
        f"{case['batch']}, {case['heads']} heads of {case['head_dim']}, fp32, Fixed layout "
        f"(block {case['block']}, {case['local']} local blocks, 1 global, unidirectional, "
        f"causal); median of {repeats} interleaved steps after one warm-up"
    )
    rows = []
    for seq in seqs:
        rows.append(run_case(case, seq, repeats))
    print()
    _common.print_table(
        ["seq", "density", "target", "sparse ms", "dense ms", "ratio", "sparse MiB", "dense MiB",
         "max grad diff"],
        [[r["seq"], r["density"], r["target"], r["sparse_ms"], r["dense_ms"], r["ratio"],
          _common.mib(r["bytes"]["sparse"]), _common.mib(r["bytes"]["dense"]),
          f"{r['max_rel_grad_diff']:.1e}"] for r in rows],
    )

    fit = {}
    if not args.no_fit:
        budget = case["fit_gib"] * 2**30
        print(f"\nLongest power-of-2 sequence whose fwd+bwd step compiles within "
              f"{case['fit_gib']:g} GiB (compile only):")
        table = []
        for path in ("sparse", "dense"):
            longest, sizes = longest_fit(case, path, budget, seqs[0], case["fit_max"])
            fit[path] = longest
            table.append([path, longest or f"< {seqs[0]}",
                          ", ".join(f"{s}: {_common.mib(b) / 1024:.2f}" for s, b in sizes.items())])
        _common.print_table(["path", "longest seq", "GiB by seq"], table)
    print()
    for i, r in enumerate(rows):
        _common.print_json(_common.result(
            NAME,
            case=(f"seq={r['seq']} fixed block={case['block']} local={case['local']} causal "
                  f"heads={case['heads']} head_dim={case['head_dim']} batch={case['batch']} fp32"),
            jaxspeed=r["sparse_ms"], baseline=r["dense_ms"], unit="ms fwd+bwd (median)",
            ratio=r["ratio"], density=round(r["density"], 4), target_ratio=round(r["target"], 3),
            min_ms=r["min_ms"],
            peak_MiB={n: round(_common.mib(b), 1) for n, b in r["bytes"].items()},
            compile_s=r["compile_s"], max_rel_grad_diff=r["max_rel_grad_diff"], repeats=repeats,
            **({"longest_seq_in_budget": fit, "budget_GiB": case["fit_gib"]}
               if i == len(rows) - 1 and fit else {}),
        ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
