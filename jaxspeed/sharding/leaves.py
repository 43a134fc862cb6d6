"""One parameter's plan (`LeafPlan`), and what follows from leaf plans alone: the bytes a
device holds of one, and the flat list of a tree of them."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Logical = tuple[str | None, ...] | None


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """The plan for one parameter: its specs for params, gradients and optimizer state."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    logical: Logical
    param: P
    grad: P
    opt: P
    notes: tuple[str, ...]
    #: The spec without ZeRO's data-parallel axes: the whole param, as the step computes with
    #: it once gathered (tensor, expert and pipe axes stay).
    gathered: P = P()


def leaf_bytes(mesh: Mesh, leaf: LeafPlan, field: str) -> int:
    """Bytes one device holds of `leaf` stored with its `field` ("param", "grad", "opt") spec."""
    shard = NamedSharding(mesh, getattr(leaf, field)).shard_shape(leaf.shape)
    return math.prod(shard) * np.dtype(leaf.dtype).itemsize


def flatten_leaf_plans(leaves) -> list[tuple[tuple, LeafPlan]]:
    """`(key path, LeafPlan)` for every leaf of a tree of `LeafPlan`s, in tree order."""
    return jax.tree.flatten_with_path(leaves, is_leaf=lambda x: isinstance(x, LeafPlan))[0]
