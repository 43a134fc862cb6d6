"""Logical axis names → mesh axes, through ordered rules with fallbacks.

A rule is `(logical_name, mesh_axes)`; `mesh_axes` is a mesh axis, a tuple of them, or None.
A logical name may appear in several rules: the first one whose mesh axes are still free in
this spec and divide the dimension wins, as in MaxText's `logical_axis_rules`. Mesh axes of
size 1 are dropped, so specs stay readable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from jax.sharding import PartitionSpec as P

from jaxspeed.runtime.mesh import DATA, EXPERT, HOST, PIPE, SEQUENCE, TENSOR

MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    ("batch", (HOST, DATA, EXPERT)),
    ("batch", (HOST, DATA)),
    ("mlp", TENSOR),
    ("heads", TENSOR),
    ("vocab", TENSOR),
    ("expert", EXPERT),
    ("layers", PIPE),
    ("stage", PIPE),
    ("embed", None),
    ("kv", None),
    ("length", SEQUENCE),
)
#: Mesh axes parameters are never split over by the logical rules (ZeRO may still use them):
#: a parameter with a `length` dimension (learned positions) is not an activation.
ACTIVATION_ONLY_AXES: tuple[str, ...] = (SEQUENCE,)


class DimChoice(NamedTuple):
    """Mesh axes chosen for one dimension, and why a wanted sharding was dropped (or '')."""

    axes: tuple[str, ...]
    note: str


def as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def spec_entry(axes: Sequence[str]) -> MeshAxes:
    """The `PartitionSpec` entry for a dimension sharded over `axes` (in order)."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def logical_to_spec(
    logical: Sequence[str | None] | None,
    shape: Sequence[int],
    mesh_shape: Mapping[str, int],
    rules: Rules = DEFAULT_RULES,
) -> tuple[P, list[str]]:
    """Maps one array's logical axis names to a `PartitionSpec`.

    Args:
      logical: one logical name (or None) per dimension of `shape`; None = no metadata.
      shape: the array's shape.
      mesh_shape: mesh axis name → size.
      rules: ordered `(logical_name, mesh_axes)` rules.

    Returns:
      The spec, and notes on dimensions left unsharded because no rule divided them.
    """
    if logical is None:
        return P(*([None] * len(shape))), []
    if len(logical) != len(shape):
        raise ValueError(
            f"logical axes {tuple(logical)} have {len(logical)} names for a {len(shape)}-d "
            f"array of shape {tuple(shape)}"
        )
    used: set[str] = set()
    entries, notes = [], []
    for name, size in zip(logical, shape):
        choice = _choose(name, size, mesh_shape, rules, used)
        used.update(choice.axes)
        entries.append(spec_entry(choice.axes))
        if choice.note:
            notes.append(choice.note)
    return P(*entries), notes


def _choose(name, size, mesh_shape, rules, used) -> DimChoice:
    if name is None:
        return DimChoice((), "")
    wanted = ""
    for rule_name, mesh_axes in rules:
        if rule_name != name:
            continue
        axes = tuple(a for a in as_tuple(mesh_axes) if mesh_shape.get(a, 1) > 1)
        if not axes:
            return DimChoice((), "")
        ways = math.prod(mesh_shape[a] for a in axes)
        if used.intersection(axes):
            wanted = wanted or f"{name}→{axes} (axis already used)"
        elif size % ways:
            wanted = wanted or f"{name}→{axes} ({size} not divisible by {ways})"
        else:
            return DimChoice(axes, "")
    return DimChoice((), f"replicated {wanted}" if wanted else "")


def without_axes(rules: Rules, axes: tuple[str, ...]) -> Rules:
    """`rules` without the mesh `axes` (inside a `shard_map` manual over them, the batch is
    already local)."""
    return tuple((name, tuple(a for a in as_tuple(mesh_axes) if a not in axes) or None)
                 for name, mesh_axes in rules)
