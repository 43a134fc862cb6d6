"""A compiled step's own matmuls, run alone: the rate they reach without the rest of the step.

`throughput.py` holds a training step to the machine's matmul peak (a large square matmul). A
step cannot reach it: its matmuls have the model's shapes, not the peak's, and everything
else (norms, softmax, casts, collectives, the optimizer) takes time the matmuls do not use.
`rate` separates the two. It reads every `dot` of the compiled step (`cost.hlo.dots`: shapes
per device, dtypes, dimension numbers, executions per step) and times one program that runs
exactly those dots, each as often as the step does, on every device of the step's mesh at
once. Its FLOP/s is what the step would reach if it did nothing but its matmuls.

The program chains each dot to the one before it (one element of the next left operand takes
0 x an element of the last output), so XLA can neither merge equal dots nor hoist them.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402

#: HLO element type → JAX dtype name.
_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}


def _program(dots, mesh):
    """(jitted fn, its operands): every dot of `dots` `executions` times on every device."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    counts = collections.Counter()
    for dot in dots:
        counts[(dot.lhs, dot.rhs, dot.dtypes, dot.dimension_numbers)] += dot.executions
    kinds = list(counts)
    unknown = {t for kind in kinds for t in kind[2] if t not in _DTYPES}
    if unknown:
        raise ValueError(f"dots of element types {sorted(unknown)} cannot be replayed")
    axes = tuple(mesh.axis_names)
    devices = mesh.size

    def operands(key):
        out = []
        for i, (lhs, rhs, dtypes, _) in enumerate(kinds):
            a, b = jax.random.split(jax.random.fold_in(key, i))
            out.append((jax.random.normal(a, (devices, *lhs), _DTYPES[dtypes[0]]),
                        jax.random.normal(b, (devices, *rhs), _DTYPES[dtypes[1]])))
        return out

    def body(pairs):
        outs = []
        for (a, b), kind in zip(pairs, kinds, strict=True):
            a, b, (_, _, dtypes, numbers) = a[0], b[0], kind
            for _ in range(counts[kind]):
                y = jax.lax.dot_general(a, b, numbers, preferred_element_type=_DTYPES[dtypes[2]])
                a = a.at[(0,) * a.ndim].add((y[(0,) * y.ndim] * 0).astype(a.dtype))
            outs.append(y[None])
        return outs

    spec = P(axes)  # each device its own operands: the leading axis split over the whole mesh
    with jax.set_mesh(mesh):
        pairs = jax.jit(operands, out_shardings=NamedSharding(mesh, spec))(jax.random.key(0))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return fn, pairs


def rate(hlo_text: str, mesh, *, repeats: int = 5) -> dict:
    """The step's dots (from its optimized HLO text), run alone on `mesh`: best of `repeats`.

    Returns:
      `{"gflops": aggregate GFLOP/s over all devices (at the best run), "flops_per_device":
      per step, "dots_per_device": dot executions per step, "seconds": the best run}`.
    """
    from jaxspeed.cost.hlo import dots as find_dots

    dots = find_dots(hlo_text)
    if not dots:
        raise ValueError("the compiled step has no dot instructions to replay")
    fn, pairs = _program(dots, mesh)
    best = min(_common.interleaved_seconds({"dots": lambda: fn(pairs)}, repeats)["dots"])
    flops = sum(d.flops * d.executions for d in dots)
    return {"gflops": mesh.size * flops / best / 1e9, "flops_per_device": flops,
            "dots_per_device": sum(d.executions for d in dots), "seconds": best}
