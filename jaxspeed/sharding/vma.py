"""Varying manual axes inside `shard_map`: what an array varies over, and making operands alike."""

from __future__ import annotations

import jax


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
    return [x if varying_axes(x) == axes else
            jax.lax.pcast(x, tuple(sorted(axes - varying_axes(x))), to="varying") for x in xs]
