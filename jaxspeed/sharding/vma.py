"""Varying manual axes inside `shard_map`: what an array varies over, and making operands alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over (empty outside `shard_map`)."""
    return frozenset(jax.typeof(x).mat.varying)


def vary_alike(*xs) -> list:
    """Marks every operand varying over the union of their manual axes (inside `shard_map`).

    `custom_vjp` wants each cotangent typed like its primal, and the cotangent of replicated
    weights varies with the rows; the `pcast` (whose transpose is a `psum`) makes them alike.
    Outside `shard_map` nothing varies and the operands come back as they are.
    """
    axes = frozenset().union(*map(varying_axes, xs))
    return [make_varying(x, axes) for x in xs]


def narrow_float(x) -> bool:
    """Whether `x` is a float narrower than fp32 (bf16, fp16, fp8)."""
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4


def make_varying(x, axes):
    """`x` marked varying over the manual `axes` it does not vary over yet (inside `shard_map`).

    The `pcast`'s transpose sums the cotangent over those axes. A 16-bit float goes through
    fp32, so that sum is in fp32: more accurate, and XLA:CPU's all-reduce promotion pass aborts
    the process on a bf16 all-reduce whose reducer carries the mesh's sharding annotation, as
    the transpose of a bf16 `pcast` inside a partly manual `shard_map` has it (jax 0.12: "Invalid
    binary instruction opcode copy").
    """
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    if not missing:
        return x
    if narrow_float(x):
        return jax.lax.pcast(x.astype(jnp.float32), missing, to="varying").astype(x.dtype)
    return jax.lax.pcast(x, missing, to="varying")
