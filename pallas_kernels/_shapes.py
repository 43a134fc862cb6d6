"""Kernel outputs typed like their inputs, so kernels run inside `jax.shard_map` too."""

from __future__ import annotations

import jax


def out_like(operands, shape, dtype) -> jax.ShapeDtypeStruct:
    """A kernel output of `shape` and `dtype` that varies over every manual mesh axis one of
    `operands` (an array or a sequence of arrays) varies over.

    Inside a `shard_map` with `check_vma` (the default), Pallas needs an output's axes stated
    (an expert-parallel MoE layer calls the dispatch kernels there); and a backward kernel's
    cotangent may arrive replicated while the routing tables it is gathered by vary.
    """
    operands = operands if isinstance(operands, (list, tuple)) else (operands,)
    types = [jax.typeof(x).manual_axis_type for x in operands]
    varying = frozenset().union(*(t.varying for t in types))
    manual = type(types[0])(varying=varying)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


def vary_like(value, like):
    """`value` made to vary over the manual axes `like` varies over: a custom VJP's cotangent
    must have its primal's type, and one computed from a replicated cotangent may not."""
    missing = jax.typeof(like).manual_axis_type.varying - jax.typeof(value).manual_axis_type.varying
    return jax.lax.pcast(value, tuple(sorted(missing)), to="varying") if missing else value
