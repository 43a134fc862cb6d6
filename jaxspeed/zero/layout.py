"""How a ZeRO-3 leaf is laid out for the explicit step's gathers: the manual axes, ZeRO++'s
switches, which dimension each stored leaf is split on over which axes (`LeafGather`), the
order its gather stages run in, and the local transpose that puts a staged gather's blocks
back in the spec's order. `jaxspeed.zero.collectives` runs the gathers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspeed.ops import quantize as qz
from jaxspeed.runtime.mesh import DATA, EXPERT, HOST

#: The axes the explicit ZeRO-3 step is manual over (the batch's rows are split over them).
#: `expert` shards the dense weights as a ZeRO axis and the expert weights' expert dimension
#: as a model-parallel one (never gathered: the MoE layer exchanges tokens over it).
MANUAL_AXES: tuple[str, ...] = (HOST, DATA, EXPERT)


class Switches(NamedTuple):
    """ZeRO++'s switches, as the collectives use them.

    Attributes:
      quantized_weights: qwZ: weight all-gathers move int8 block-quantized values.
      gradient_bits: qgZ: gradients reduce-scatter as `all_to_all`s of block-quantized values
        of this many bits (4 or 8); None: a full-precision (fp32) `psum_scatter`.
      hpz: hpZ: gather over `host` once per step, then within the host per use.
      block: elements per quantization scale.
      bucket: the most elements one full-precision gather or reduce-scatter moves (each
        device's gathered output, or unscattered input): leaves gathered together move in
        runs of whole leaves of at most this many (`gather_leaves`), and a larger gradient
        is reduced in pieces of at most this many (`reduce_scatter`). None: one buffer.
      two_level: `(axis, hosts)` of the manual axes whose devices span `hosts` hosts
        (1 < hosts < the axis size, no `host` axis naming them): a full-precision gather over
        one of them alone runs across hosts and then inside each host, its reduce-scatter
        the other way round (`jaxspeed.sharding.two_level`).
    """

    quantized_weights: bool = False
    gradient_bits: int | None = None
    hpz: bool = False
    block: int = qz.BLOCK
    bucket: int | None = None
    two_level: tuple[tuple[str, int], ...] = ()

    @property
    def grouped(self) -> bool:
        """Whether the leaves gathered together move as one buffer (`gather_leaves`): in full
        precision only, where a block of qwZ or qgZ would mix leaves' scales."""
        return not self.quantized_weights and self.gradient_bits is None

    def hosts(self, axes: tuple[str, ...]) -> int:
        """The hosts a gather over `axes` runs in two stages over (1: one flat collective)."""
        return dict(self.two_level).get(axes[0], 1) if len(axes) == 1 else 1


class LeafGather(NamedTuple):
    """How one stored leaf is gathered: the dimension ZeRO split, over which manual axes.

    `axes` are in the spec's order, major first: `data` before `host` (`ZERO_AXES`), or
    `host` first with host-major shards (`zero_optimization.shard_order`).
    `kept` is the stored spec's entries on the map's other axes (`tensor`), one per
    dimension: the leaf stays split over them, and its gather runs inside each of their
    groups (`gather_leaves`).
    """

    dim: int
    axes: tuple[str, ...]
    kept: tuple = ()

    def stages(self, hpz: bool) -> tuple[tuple[str, ...], ...]:
        """The gathers, in order: with hpZ `host` alone first, then the rest; else one."""
        if hpz and HOST in self.axes and len(self.axes) > 1:
            return (HOST,), tuple(a for a in self.axes if a != HOST)
        return (self.axes,)

    @property
    def kept_axes(self) -> tuple[str, ...]:
        """The other axes the leaf stays split over (`kept`'s, flattened)."""
        return tuple(a for e in self.kept for a in named(e))

    def order(self, hpz: bool) -> tuple[str, ...]:
        """The axes, major first, in which `stages(hpz)` leave the gathered blocks: each
        stage's all-gather puts its axes above the earlier stages' (`reorder_blocks`)."""
        return tuple(a for axes in reversed(self.stages(hpz)) for a in axes)

    def sliced(self) -> LeafGather:
        """The same gather for one slice of a scanned stack (the leading `layers` dim gone)."""
        return self._replace(dim=self.dim - 1, kept=self.kept[1:])


def named(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def leaf_gather(spec, gathered=(), manual: tuple[str, ...] = MANUAL_AXES) -> LeafGather | None:
    """The `LeafGather` of a stored leaf's `PartitionSpec` (None: not split over `manual`).

    `gathered` is the spec the step computes with (`LeafPlan.gathered`): its axes split the
    leaf for the model (an expert weight's `expert` dimension), not for ZeRO, and stay.
    The ZeRO dimension has no other axis: inside a group of one (`kept`), its ZeRO shards
    would not make one contiguous block (`zero_spec`'s `beside`).
    """
    kept = tuple(spec_entry(tuple(a for a in named(e) if a not in manual)) for e in spec)
    for dim, entry in enumerate(spec):
        model = named(gathered[dim]) if dim < len(gathered) else ()
        axes = tuple(a for a in named(entry) if a in manual and a not in model)
        if axes:
            if named(entry) != axes:
                raise ValueError(f"{spec}: dimension {dim} is split over {named(entry)}; "
                                 f"an explicit ZeRO gather needs it split over {axes} alone")
            return LeafGather(dim, axes, kept if any(kept) else ())
    return None


def spec_entry(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else (axes or None)


def manual_spec(spec, manual: tuple[str, ...] = MANUAL_AXES):
    """`spec` with only the `manual` axes: a stored leaf's `shard_map` spec."""
    return P(*(spec_entry(tuple(a for a in named(e) if a in manual)) for e in spec))


def across_hosts_last(axes) -> tuple[str, ...]:
    """`axes` with `host` last: qgZ's all-to-alls, one an axis, reduce inside the host first
    and send across hosts only what is left (`zero.comm.reduce_scatter`)."""
    return tuple(sorted(axes, key=lambda a: a == HOST))


#: Which of a leaf's gather stages `gather_leaf` runs: all of them; hpZ's `host` stage alone
#: (the once-per-step secondary copy); or the others (each use).
PARTS = ("all", "secondary", "use")


def part_stages(stages, part: str, hpz: bool):
    """The stages of `stages` that `part` (one of `PARTS`) runs."""
    secondary = tuple(s for s in stages if hpz and s == (HOST,))
    if part == "secondary":
        return secondary
    if part == "use":
        return tuple(s for s in stages if s not in secondary)
    return stages


def reorder_blocks(x: jax.Array, dim: int, have: tuple[str, ...], want: tuple[str, ...]):
    """`x`'s dimension `dim`, one block per device of the axes `have` (major first), with its
    blocks in the order of `want` (the same axes): a local transpose (inside `shard_map`)."""
    sizes = [jax.lax.axis_size(a) for a in have]
    split = x.reshape(*x.shape[:dim], *sizes, -1, *x.shape[dim + 1:])
    moved = jnp.moveaxis(split, [dim + have.index(a) for a in want],
                         list(range(dim, dim + len(want))))
    return moved.reshape(x.shape)
