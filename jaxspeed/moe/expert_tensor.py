"""An MoE layer's experts over the `tensor` mesh axis, Tutel's sharding degree (`jaxspeed.moe.
strategies`): stored with their hidden units split over `tensor`, they run split there
(`expert_tensor`, `split_ffn`) or whole, on the device's share of the slots (every other
strategy, `Whole`).

These run inside the layer's `shard_map`, manual over `tensor` as well as the data-parallel
axes, where the tokens and their routing are the same on every device of a tensor group.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspeed.moe.experts import ExpertParams, expert_ffn
from jaxspeed.sharding.vma import make_varying


#: The hidden dimension of each `ExpertParams` field that has one.
HIDDEN_DIM = {"w_in": 2, "w_gate": 2, "w_out": 1, "b_in": 1}


def hidden_specs(experts: ExpertParams, expert_axis: str | None, tensor: str | None):
    """`shard_map` specs of `experts` stored split over `expert_axis` (None: whole) on their
    first dimension and over `tensor` (None: not split) on their hidden one."""

    def spec(name, w):
        if w is None:
            return None
        dims = [expert_axis] + [None] * (w.ndim - 1)
        if tensor is not None and name in HIDDEN_DIM:
            dims[HIDDEN_DIM[name]] = tensor
        return P(*dims)

    return ExpertParams(*(spec(name, w) for name, w in zip(ExpertParams._fields, experts)))


def _first_only(experts: ExpertParams, axis: str) -> ExpertParams:
    """`experts` with the output bias on the first device of `axis` only, so that a sum of the
    devices' outputs over `axis` adds it once."""
    if experts.b_out is None:
        return experts
    first = (jax.lax.axis_index(axis) == 0).astype(experts.b_out.dtype)
    return experts._replace(b_out=experts.b_out * first)


def summed(fn: Callable, experts: ExpertParams, axis: str):
    """`fn(experts)` (an FFN of the experts, such as `dropless_ffn` on routed tokens) on their
    hidden units split over `axis`, its shares summed over `axis`."""
    return jax.lax.psum(fn(_first_only(experts, axis)), axis)


def split_ffn(experts: ExpertParams, *, axis: str | None, activation: str,
              fp8: str | None = None) -> Callable:
    """`buf [E, S, M] -> [E, S, M]`: the experts' FFN with their hidden units split over `axis`
    (None: not split), each device's share summed over `axis`; in FP8 with recipe `fp8`."""
    def ffn(params, buf):
        return expert_ffn(buf, params, activation=activation, fp8=fp8)
    if axis is None:
        return functools.partial(ffn, experts)
    return lambda buf: summed(functools.partial(ffn, buf=buf), experts, axis)


class Whole:
    """Every expert whole where it runs, on 1/t of a tensor group's slots (t = the size of
    `axis`): the hidden units gathered over `axis` (their gradient reduce-scattered back), each
    device's slots put through the FFN, and the group's outputs summed after the combine.

    `tokens` marks the tokens varying over `axis`, so that their cotangent, not the larger
    buffer's, is what the backward pass sums over it.
    """

    def __init__(self, axis: str, size: int):
        self.axis, self.size = axis, size

    def experts(self, experts: ExpertParams) -> ExpertParams:
        return ExpertParams(*(
            w if w is None or name not in HIDDEN_DIM
            else jax.lax.all_gather(w, self.axis, axis=HIDDEN_DIM[name], tiled=True)
            for name, w in zip(ExpertParams._fields, experts)))

    def tokens(self, x):
        return make_varying(x, (self.axis,))

    def slots(self, ffn: Callable) -> Callable:
        """`ffn` on this device's `ceil(S / t)` of the slots of `buf [E, S, M]`, its output in
        their place, zeros elsewhere."""

        def run(buf):
            slots = buf.shape[1]
            share = math.ceil(slots / self.size)
            padded = jnp.pad(buf, ((0, 0), (0, share * self.size - slots), (0, 0)))
            start = jax.lax.axis_index(self.axis) * share
            out = ffn(jax.lax.dynamic_slice_in_dim(padded, start, share, axis=1))
            placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(padded), out, start, 1)
            return placed[:, :slots]

        return run

    def output(self, y):
        return jax.lax.psum(y, self.axis)
