"""Dispatch tokens to expert capacity buffers and combine expert outputs back, by index.

`dispatch` scatters each kept (token, choice) row to its `(expert, slot)` of an `[E, C, M]`
buffer and `combine` gathers the `k` rows of every token back, weighted. Neither builds
GShard's `[T, E, C]` one-hot dispatch/combine tensors, so time and memory are `O(T * k * M)`
instead of `O(T * E * C * M)`.

Two implementations, chosen by `impl=`, with the same design: a cheap XLA scatter of int32
ids builds the inverse map slot -> token, and then every direction, forward and
backward, is a row *gather* (scatter-adds of rows are slow, serial loops on CPU):
  - "pallas": the kernels of `pallas_kernels.moe_dispatch` (custom VJPs whose backward passes
    are kernels too), compiled on GPU and interpreted elsewhere;
  - "xla": the same gathers as XLA ops (`jnp.take` with dropped choices masked), in custom
    VJPs: d x of dispatch and d y, d weight of combine are gathers as well;
  - "auto": "pallas" on GPU, "xla" elsewhere (the interpreter is for testing, not speed).
Both are differentiable in the token rows, the expert outputs and the combine weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspeed.moe.gating import Routing
from jaxspeed.options.moe import IMPLS
from jaxspeed.sharding.vma import vary_alike
from pallas_kernels import moe_kernels as kernels
from pallas_kernels.backend import on_gpu



def _resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if on_gpu() else "xla"
    return impl


def _static_capacity(routing: Routing) -> int:
    capacity = routing.capacity
    if isinstance(capacity, jax.core.Tracer):
        raise ValueError(
            "routing.capacity must be a static Python int, got a traced value: build the "
            "Routing with top_k_gating (its capacity stays static through jit) rather than "
            "from raw arrays")
    return int(capacity)


def _kept(routing: Routing, capacity: int, num_experts: int):
    e, p = routing.expert_index, routing.position
    return (p >= 0) & (p < capacity) & (e >= 0) & (e < num_experts)


# ---- the XLA path: gathers only -----------------------------------------------------------------


def take_rows(table, idx):
    """`table[idx]` along rows, zero rows where `idx < 0`; `[*idx.shape, M]`."""
    rows = jnp.take(table, jnp.maximum(idx, 0), axis=0)
    return jnp.where((idx >= 0)[..., None], rows, jnp.zeros((), table.dtype))


def flat_slots(routing: Routing, capacity: int, num_experts: int):
    """Flat slot `e * C + c` per (token, choice), `[T, k]` int32; -1 where dropped."""
    flat = routing.expert_index * capacity + routing.position
    return jnp.where(_kept(routing, capacity, num_experts), flat, -1).astype(jnp.int32)


def _scatter_to_slots(slots, values, num_slots: int, fill):
    """Inverse map: `[S]`, `values[t, j]` at slot `slots[t, j]`, `fill` where no choice landed.

    A scatter of `T * k` scalars; materialised once, so the row gathers that read it do no
    index arithmetic per element (a `pair // k` fused into them made them ~20% slower).
    """
    target = jnp.where(slots >= 0, slots, num_slots).reshape(-1)  # -1 must not wrap around
    return jnp.full((num_slots,), fill, values.dtype).at[target].set(values.reshape(-1),
                                                                      mode="drop")


def _token_of_slot(slots, num_slots: int):
    """`[S]` int32: the token filling each slot, -1 if none."""
    tokens = jnp.broadcast_to(jnp.arange(slots.shape[0], dtype=jnp.int32)[:, None], slots.shape)
    return _scatter_to_slots(slots, tokens, num_slots, -1)


def _gather_sum(table, slots, weight=None):
    """`sum_j weight[:, j] * table[slots[:, j]]` in fp32 (weight 1 if None): `[T, M]`."""
    out = 0.0
    for j in range(slots.shape[1]):
        rows = take_rows(table, slots[:, j]).astype(jnp.float32)
        out = out + (rows if weight is None else weight[:, j, None] * rows)
    return out


@jax.custom_vjp
def _xla_dispatch(x, slots, token):
    return take_rows(x, token)


def _xla_dispatch_fwd(x, slots, token):
    return _xla_dispatch(x, slots, token), slots


def _xla_dispatch_bwd(slots, dout):
    return _gather_sum(dout, slots).astype(dout.dtype), None, None


_xla_dispatch.defvjp(_xla_dispatch_fwd, _xla_dispatch_bwd)


@jax.custom_vjp
def _xla_combine(y, slots, weight, token):
    return _gather_sum(y, slots, weight).astype(y.dtype)


def _xla_combine_fwd(y, slots, weight, token):
    return _xla_combine(y, slots, weight, token), (y, slots, weight, token)


def _xla_combine_bwd(residuals, dout):
    y, slots, weight, token = residuals
    scale = _scatter_to_slots(slots, weight, token.shape[0], 0.0)
    dy = (scale[:, None] * take_rows(dout, token).astype(jnp.float32)).astype(y.dtype)
    do = dout.astype(jnp.float32)
    dweight = jnp.stack(
        [jnp.sum(take_rows(y, slots[:, j]).astype(jnp.float32) * do, axis=1)
         for j in range(slots.shape[1])], axis=1)
    return dy, None, dweight, None


_xla_combine.defvjp(_xla_combine_fwd, _xla_combine_bwd)


def dispatch(x, routing: Routing, num_experts: int, *, impl: str = "auto"):
    """Scatters token rows into per-expert capacity buffers.

    Args:
      x: `[tokens, model]`.
      routing: from `top_k_gating` over the same tokens.
      num_experts: `E` (static).
      impl: "auto", "pallas" or "xla" (see the module docstring).

    Returns:
      `[E, C, model]` in `x`'s dtype, `C = routing.capacity`; unfilled slots are zero.
    """
    impl = _resolve_impl(impl)
    capacity = _static_capacity(routing)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive Python int, got {num_experts!r}")
    if impl == "pallas":
        return kernels.moe_dispatch(x, routing.expert_index, routing.position, num_experts,
                                    capacity)
    if x.ndim != 2 or routing.expert_index.shape[0] != x.shape[0]:
        raise ValueError(
            f"x must have shape [tokens, model] with tokens = {routing.expert_index.shape[0]} "
            f"(the routing's), got {x.shape}")
    num_slots = num_experts * capacity
    slots = flat_slots(routing, capacity, num_experts)
    out = _xla_dispatch(x, slots, _token_of_slot(slots, num_slots))
    return out.reshape(num_experts, capacity, x.shape[1])


def combine(y, routing: Routing, *, impl: str = "auto"):
    """Gathers expert outputs back to tokens: `out[t] = sum_j weight[t, j] * y[e_tj, c_tj]`.

    Args:
      y: `[E, C, model]` expert outputs, `C = routing.capacity`.
      routing: from `top_k_gating`; dropped choices contribute nothing.
      impl: "auto", "pallas" or "xla" (see the module docstring).

    Returns:
      `[tokens, model]` in `y`'s dtype, accumulated in fp32. Differentiable in `y` and in
      `routing.weight` (the gate gradient).
    """
    impl = _resolve_impl(impl)
    capacity = _static_capacity(routing)
    # the weights' cotangent varies with `y` (over `tensor` where experts run whole on shares
    # of the slots): the custom VJPs want it typed like its primal
    y, weight = vary_alike(y, routing.weight)
    routing = routing._replace(weight=weight)
    if y.ndim != 3 or y.shape[1] != capacity:
        raise ValueError(
            f"y must have shape [experts, capacity={capacity}, model], got {y.shape}")
    if impl == "pallas":
        return kernels.moe_combine(y, routing.expert_index, routing.position, routing.weight)
    num_experts, _, width = y.shape
    slots = flat_slots(routing, capacity, num_experts)
    token = _token_of_slot(slots, num_experts * capacity)
    weight = routing.weight.astype(jnp.float32)
    return _xla_combine(y.reshape(num_experts * capacity, width), slots, weight, token)
