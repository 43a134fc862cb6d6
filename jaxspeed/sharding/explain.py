"""`Plan.explain()`: a plain-text table of where every parameter lives."""

from __future__ import annotations

from jaxspeed.runtime.mesh import HOST, data_parallel_size
from jaxspeed.sharding.leaves import flatten_leaf_plans, leaf_bytes


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _spec(spec) -> str:
    return "(" + ", ".join(str(e) for e in tuple(spec)) + ")" if tuple(spec) else "replicated"


def _mesh_line(mesh) -> str:
    """`pipe=1, data=8, ...`; a `host` axis only when there are hosts, with the split it makes
    of the data-parallel degree (a one-host mesh reads as it did before the axis existed)."""
    shape = dict(mesh.shape)
    hosts = shape.get(HOST, 1)
    text = ", ".join(f"{k}={v}" for k, v in shape.items() if k != HOST or hosts > 1)
    if hosts > 1:
        dp = data_parallel_size(mesh)
        text += f" (data-parallel {dp} = {hosts} hosts x {dp // hosts} per host)"
    return text


def explain_plan(plan) -> str:
    """The table `Plan.explain()` returns, for a `Plan` (or anything with its fields)."""
    header = ("parameter", "shape", "params", "grads", "opt state", "param bytes/dev", "notes")
    rows = []
    for _, leaf in flatten_leaf_plans(plan.leaves):
        nbytes = leaf_bytes(plan.mesh, leaf, "param")
        rows.append((
            leaf.path, "×".join(map(str, leaf.shape)) or "scalar", _spec(leaf.param),
            _spec(leaf.grad), _spec(leaf.opt), format_bytes(nbytes), "; ".join(leaf.notes),
        ))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    mesh = _mesh_line(plan.mesh)
    out = [f"mesh: {mesh}   ZeRO stage {plan.stage}", line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    out.append(
        f"per device: params {format_bytes(plan.bytes_per_device('param'))}, "
        f"grads {format_bytes(plan.bytes_per_device('grad'))}, "
        f"one opt-state copy {format_bytes(plan.bytes_per_device('opt'))}"
    )
    return "\n".join(out)
