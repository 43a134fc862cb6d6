"""Block-sparse attention on one NVIDIA GPU: the Pallas kernel vs dense `dot_product_attention`.

Run on a machine with a GPU: `python benchmarks/gpu_sparse_attention.py` (an H200 is the case
the issue names). At seq 8k, 16k and 32k, batch 1, 16 heads of 128, bf16, causal:
  - jaxspeed: `pallas_kernels.block_sparse_attention` (Mosaic GPU on Hopper, where the Triton
    kernel it replaces is timed beside it; Triton on older GPUs) over DeepSpeed's
    unidirectional Fixed layout, block 64, 8 local blocks, 1 global block: about 7-10% of the
    blocks;
  - baseline: `jax.nn.dot_product_attention(is_causal=True)` with cuDNN's fused kernel (XLA's
    dense attention where cuDNN is not available), which computes every causal block.
Forward and forward+backward are timed (median of rounds of `--iters` calls) and the kernel's
achieved TFLOP/s is counted on the blocks it computes: 4 * batch * heads * block**2 * head_dim
FLOPs per non-zero block forward (QK^T and PV), 3.5x that forward+backward (FlashAttention's
count: the backward's five matmuls). A correctness check against XLA's dense masked attention
runs first at seq 2048. Headline: the longest sequence both paths ran, forward+backward,
ratio = baseline time / kernel time (target >= 3 at ~10% density).
`--quick` runs a tiny case on any backend (on CPU the kernel is interpreted).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

NAME = "gpu_sparse_attention"
GPU_CASE = {"seqs": (8192, 16384, 32768), "batch": 1, "heads": 16, "head_dim": 128,
            "block": 64, "local": 8, "iters": 10, "rounds": 3, "check_seq": 2048}
QUICK = {"seqs": (256,), "batch": 1, "heads": 2, "head_dim": 64, "block": 32, "local": 4,
         "iters": 1, "rounds": 1, "check_seq": 128}


def fixed_layout_numpy(seq: int, *, block: int, num_local_blocks: int):
    """DeepSpeed's unidirectional Fixed layout with one global block, `[1, nb, nb]` int32.

    Equal to `FixedSparsityConfig(num_heads=1, block=block, num_local_blocks=num_local_blocks,
    attention="unidirectional").make_layout(seq)` for `seq` a multiple of `block *
    num_local_blocks` (tests check it); here so the benchmark runs without jaxspeed's
    dependencies, e.g. on a GPU machine with only jax installed.
    """
    import numpy as np

    nb = seq // block
    row, col = np.arange(nb)[:, None], np.arange(nb)[None, :]
    local = (row // num_local_blocks == col // num_local_blocks) & (col <= row)
    global_col = (col % num_local_blocks == num_local_blocks - 1) & (row >= col)
    return (local | global_col).astype(np.int32)[None]


def fixed_layout(seq: int, *, block: int, num_local_blocks: int):
    """The layout, from jaxspeed's `FixedSparsityConfig` when it imports, else built here."""
    try:
        from jaxspeed.attention.sparsity import FixedSparsityConfig
    except ImportError:
        return fixed_layout_numpy(seq, block=block, num_local_blocks=num_local_blocks)
    config = FixedSparsityConfig(num_heads=1, block=block, num_local_blocks=num_local_blocks,
                                 attention="unidirectional")
    return config.make_layout(seq)


def attention_fns(layout, *, interpret):
    """Jitted forward and forward+backward of the kernel, of the dense baseline and, on
    Hopper, of the Triton kernel that the Mosaic GPU one replaces there."""
    import jax

    from pallas_kernels import backend as _backend
    from pallas_kernels.block_sparse_attention import block_sparse_attention

    def sparse(q, k, v):
        return block_sparse_attention(q, k, v, layout, causal=True, interpret=interpret)

    def triton(q, k, v):
        return block_sparse_attention(q, k, v, layout, causal=True, backend=_backend.TRITON)

    def dense(implementation):
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation)

    def with_grad(f):
        return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))

    fns = {"sparse": (jax.jit(sparse), with_grad(sparse)),
           "cudnn": (jax.jit(dense("cudnn")), with_grad(dense("cudnn"))),
           "xla": (jax.jit(dense("xla")), with_grad(dense("xla")))}
    if _backend.kernel_backend() == _backend.MOSAIC_GPU:
        fns["triton"] = (jax.jit(triton), with_grad(triton))
    return fns


def inputs(case: dict, seq: int, dtype):
    import jax

    shape = (case["batch"], seq, case["heads"], case["head_dim"])
    return [jax.random.normal(key, shape, dtype) for key in jax.random.split(jax.random.key(0), 4)]


def check(case: dict, *, interpret) -> float:
    """Largest relative difference of output and dq, dk, dv to XLA's dense masked attention."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    seq, block = case["check_seq"], case["block"]
    layout = fixed_layout(seq, block=block, num_local_blocks=case["local"])
    mask = np.kron(layout[0], np.ones((block, block), np.int32)).astype(bool)
    mask = jnp.asarray(mask & np.tril(np.ones((seq, seq), bool)))[None, None]
    q, k, v, do = inputs(case, seq, jnp.bfloat16)
    sparse = attention_fns(layout, interpret=interpret)["sparse"][0]
    dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    worst = 0.0
    for f32 in (False, True):  # bf16 as benchmarked, and fp32 against fp32
        args = [x.astype(jnp.float32) for x in (q, k, v)] if f32 else [q, k, v]
        got = jax.jit(lambda *a: jax.vjp(sparse, *a))(*args)
        want = jax.jit(lambda *a: jax.vjp(dense, *a))(*args)
        cot = do.astype(args[0].dtype)
        pairs = [(got[0], want[0]), *zip(got[1](cot), want[1](cot))]
        for a, b in pairs:
            a, b = (np.asarray(x, np.float32) for x in (a, b))
            worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    return worst


def run_seq(case: dict, seq: int, *, interpret) -> dict:
    import jax.numpy as jnp
    import numpy as np

    block, heads, batch, dim = case["block"], case["heads"], case["batch"], case["head_dim"]
    layout = fixed_layout(seq, block=block, num_local_blocks=case["local"])
    nnz = int((layout[0].astype(bool) & np.tril(np.ones(layout.shape[1:], bool))).sum())
    density = nnz / layout.shape[1] ** 2
    fwd_flops = 4 * batch * heads * nnz * block**2 * dim
    dense_fwd_flops = 4 * batch * heads * seq * (seq + 1) // 2 * dim
    q, k, v, do = inputs(case, seq, jnp.bfloat16)
    fns = attention_fns(layout, interpret=interpret)
    row = {"seq": seq, "density": density, "nnz_blocks": nnz}
    timing = dict(iters=case["iters"], rounds=case["rounds"])
    row["sparse_fwd_ms"] = _common.timed(fns["sparse"][0], (q, k, v), **timing)
    row["sparse_ms"] = _common.timed(fns["sparse"][1], (q, k, v, do), **timing)
    if "triton" in fns:  # Hopper: the Mosaic GPU kernel against the Triton one it replaces
        row["triton_fwd_ms"] = _common.timed(fns["triton"][0], (q, k, v), **timing)
        row["triton_ms"] = _common.timed(fns["triton"][1], (q, k, v, do), **timing)
    row["baseline"] = None
    for impl in ("cudnn", "xla"):
        try:
            row["dense_fwd_ms"] = _common.timed(fns[impl][0], (q, k, v), **timing)
            row["dense_ms"] = _common.timed(fns[impl][1], (q, k, v, do), **timing)
        except Exception as err:  # cuDNN absent (CPU), or out of memory at long sequences
            row.setdefault("dense_errors", {})[impl] = f"{type(err).__name__}: {str(err)[:200]}"
            continue
        row["baseline"] = impl
        break
    row["sparse_tflops_fwd"] = fwd_flops / row["sparse_fwd_ms"] / 1e9
    row["sparse_tflops"] = 3.5 * fwd_flops / row["sparse_ms"] / 1e9
    if row["baseline"]:
        row["dense_tflops"] = 3.5 * dense_fwd_flops / row["dense_ms"] / 1e9
        row["ratio"] = _common.ratio(row["dense_ms"], row["sparse_ms"])
        row["ratio_fwd"] = _common.ratio(row["dense_fwd_ms"], row["sparse_fwd_ms"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny case on any backend (interpreted kernel off GPU)")
    parser.add_argument("--seqs", type=int, nargs="+", default=None)
    parser.add_argument("--block", type=int, default=None, help="layout block (default 64)")
    parser.add_argument("--local", type=int, default=None, help="num_local_blocks (default 8)")
    parser.add_argument("--iters", type=int, default=None, help="calls per timed round")
    args = parser.parse_args(argv)

    import jax

    from pallas_kernels import backend as _backend

    on_gpu = _backend.on_gpu()
    if not on_gpu and not args.quick:
        raise SystemExit(f"this benchmark needs a GPU (JAX's backend is "
                         f"{jax.default_backend()!r}); `--quick` runs a tiny case anywhere")
    case = dict(QUICK if args.quick else GPU_CASE)
    for key in ("block", "local", "iters"):
        if getattr(args, key):
            case[key] = getattr(args, key)
    seqs = tuple(args.seqs or case["seqs"])
    interpret = not on_gpu
    device = jax.devices()[0]
    print(f"Block-sparse attention on {device.device_kind} ({device.platform}): Pallas kernel "
          f"vs jax.nn.dot_product_attention (causal); batch {case['batch']}, {case['heads']} "
          f"heads of {case['head_dim']}, bf16; Fixed layout block {case['block']}, "
          f"{case['local']} local blocks, unidirectional, causal"
          + ("; kernel interpreted" if interpret else ""))
    error = check(case, interpret=interpret)
    print(f"check at seq {case['check_seq']} (bf16 and fp32) vs XLA dense masked attention: "
          f"max relative difference {error:.2e}" + ("" if error < 5e-2 else "  <-- TOO LARGE"))
    rows = [run_seq(case, seq, interpret=interpret) for seq in seqs]
    print()
    _common.print_table(
        ["seq", "density", "fwd ms", "dense fwd ms", "fwd+bwd ms", "dense fwd+bwd ms", "ratio",
         "TFLOP/s fwd", "TFLOP/s fwd+bwd", "dense TFLOP/s", "baseline"],
        [[r["seq"], r["density"], r["sparse_fwd_ms"], r.get("dense_fwd_ms", "-"),
          r["sparse_ms"], r.get("dense_ms", "-"), r.get("ratio", "-"), r["sparse_tflops_fwd"],
          r["sparse_tflops"], r.get("dense_tflops", "-"), r["baseline"] or "failed"]
         for r in rows],
    )
    for r in rows:
        for impl, err in r.get("dense_errors", {}).items():
            print(f"seq {r['seq']}: dense {impl} failed: {err}")
        if "triton_ms" in r:
            print(f"seq {r['seq']}: Mosaic GPU kernel {r['sparse_ms']:.3f} ms fwd+bwd, Triton "
                  f"{r['triton_ms']:.3f} ms ({_common.ratio(r['triton_ms'], r['sparse_ms']):.2f}x)")
    print()
    results = []
    for r in rows:
        if r["baseline"] is None:
            continue
        results.append(_common.result(
            NAME,
            case=(f"seq={r['seq']} fixed block={case['block']} local={case['local']} causal "
                  f"heads={case['heads']} head_dim={case['head_dim']} batch={case['batch']} bf16 "
                  f"{device.device_kind}"),
            jaxspeed=r["sparse_ms"], baseline=r["dense_ms"], unit="ms fwd+bwd (median)",
            ratio=r["ratio"], ratio_fwd=r["ratio_fwd"], density=round(r["density"], 4),
            baseline_impl=r["baseline"], fwd_ms={"jaxspeed": round(r["sparse_fwd_ms"], 3),
                                                 "baseline": round(r["dense_fwd_ms"], 3)},
            tflops={"jaxspeed_fwd": round(r["sparse_tflops_fwd"], 2),
                    "jaxspeed_fwd_bwd": round(r["sparse_tflops"], 2),
                    "baseline_fwd_bwd": round(r["dense_tflops"], 2)},
            check_max_rel_diff=error,
            kernel=_backend.kernel_backend(),
            **({"triton_ms": {"fwd": round(r["triton_fwd_ms"], 3), "fwd_bwd": round(r["triton_ms"], 3)},
                "ratio_vs_triton": _common.ratio(r["triton_ms"], r["sparse_ms"])}
               if "triton_ms" in r else {}),
        ))
    if not results:
        raise SystemExit("the dense baseline failed at every sequence length (see above)")
    for obj in results:
        _common.print_json(obj)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
