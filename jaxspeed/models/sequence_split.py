"""Whether and how the current mesh splits the activations' `length` axis."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
from jax.sharding import AxisType

from jaxspeed.attention.sequence_parallel import layout_positions
from jaxspeed.errors import ConfigError

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """How the current mesh and logical rules split the activations' `length` axis.

    Attributes:
      axis: the mesh axis `length` maps to.
      shards: its size (> 1).
      head_axes: the mesh axes `heads` maps to (tensor parallelism).
      balanced: the sequence is in the load-balanced layout inside the layers.
    """

    axis: str
    shards: int
    head_axes: tuple[str, ...]
    balanced: bool

    def positions(self, length: int) -> Array:
        """Each row's position in the original sequence."""
        return layout_positions(length, self.shards, self.balanced)


def sequence_split(load_balance: bool) -> SequenceSplit | None:
    """The split of `length` under the current rules and mesh, or None when there is none.

    The logical rules (`nn.logical_axis_rules`) name the mesh axis; the mesh (`jax.set_mesh`)
    gives its size. Axes already manual (an enclosing `shard_map`) do not count.
    """
    spec = nn.logical_to_mesh_axes(("length", "heads"))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or spec[0] is None:
        return None
    axes = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
    auto = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual}
    axes = tuple(a for a in axes if a in auto and mesh.shape[a] > 1)
    if not axes:
        return None
    if len(axes) > 1:
        raise ConfigError(f"the sequence may be split over one mesh axis, got {axes}")
    heads = spec[1] if spec[1] is not None else ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    heads = tuple(a for a in heads if a in auto and mesh.shape[a] > 1)
    return SequenceSplit(axes[0], mesh.shape[axes[0]], heads, bool(load_balance))
