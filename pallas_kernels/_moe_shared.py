"""What both MoE kernel families share (the Triton one in `moe_kernels`, the Mosaic GPU one in
`moe_kernels_mgpu`): padding, the routing's slot tables and their checks, and the custom VJPs
over a family's three kernel calls. Its own module, so that neither family imports the other's
module. `static` is a family's hashable geometry (`num_tokens`, `num_slots`, `tokens_padded`,
`slots_padded`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._shapes import vary_like


def pad_to(x, rows: int, cols: int):
    pad_rows, pad_cols = rows - x.shape[0], cols - x.shape[1]
    if pad_rows or pad_cols:
        x = jnp.pad(x, ((0, pad_rows), (0, pad_cols)))
    return x


# ---- index tables -------------------------------------------------------------------------------


def slot_table(expert_index, position, capacity, static):
    """Flat slot per (choice, token), `[k, Tp]` int32; -1 for a dropped choice or padding."""
    num_experts = static.num_slots // capacity if capacity else 0
    kept = (position >= 0) & (position < capacity)
    kept &= (expert_index >= 0) & (expert_index < num_experts)
    flat = jnp.where(kept, expert_index * capacity + position, -1).astype(jnp.int32).T
    return jnp.pad(flat, ((0, 0), (0, static.tokens_padded - static.num_tokens)),
                   constant_values=-1)


def inverse_table(slots, values, static, *, fill):
    """Scatters `values [k, Tp]` to their slots: `[Sp]`, `fill` where no choice lands."""
    # Out-of-range targets are dropped; -1 must not wrap around, so it is sent to Sp.
    target = jnp.where(slots >= 0, slots, static.slots_padded).reshape(-1)
    table = jnp.full((static.slots_padded,), fill, values.dtype)
    return table.at[target].set(values.reshape(-1), mode="drop")


def token_ids(slots):
    return jnp.broadcast_to(jnp.arange(slots.shape[1], dtype=jnp.int32), slots.shape)


# ---- differentiable ops on padded operands ------------------------------------------------------


def differentiable_ops(combine_call, dispatch_call, combine_dw_call):
    """`(dispatch, combine)` with custom VJPs over a family's three kernel calls (Triton here,
    Mosaic GPU in `moe_kernels_mgpu`): the backward passes are the same kernels.

    `dispatch(x, slots, static)` and `combine(y, slots, weight, static)` take padded operands
    and the slot table; the calls take `(rows, table, weight_or_scale, static)`.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def dispatch(x, slots, static):
        src = inverse_table(slots, token_ids(slots), static, fill=-1)
        return dispatch_call(x, src, None, static)

    def dispatch_fwd(x, slots, static):
        return dispatch(x, slots, static), (slots, x[:, :0])  # x's rows and type, no bytes

    def dispatch_bwd(static, residuals, dout):
        slots, like_x = residuals
        ones = (slots >= 0).astype(jnp.float32)
        dx = combine_call(dout, slots, ones, static)[: like_x.shape[0]]
        return vary_like(dx, like_x), None

    dispatch.defvjp(dispatch_fwd, dispatch_bwd)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def combine(y, slots, weight, static):
        return combine_call(y, slots, weight, static)

    def combine_fwd(y, slots, weight, static):
        return combine_call(y, slots, weight, static), (y, slots, weight)

    def combine_bwd(static, residuals, dout):
        y, slots, weight = residuals
        src = inverse_table(slots, token_ids(slots), static, fill=-1)
        scale = inverse_table(slots, weight, static, fill=0.0)
        dy = dispatch_call(dout, src, scale, static)[: y.shape[0]]
        dw = combine_dw_call(y, slots, dout, static)
        return vary_like(dy, y), None, vary_like(dw, weight)

    combine.defvjp(combine_fwd, combine_bwd)
    return dispatch, combine


def check_routing(expert_index, position, num_tokens, *, weight=None):
    if expert_index.ndim != 2 or expert_index.shape[0] != num_tokens:
        raise ValueError(
            f"expert_index must have shape [tokens, k] = [{num_tokens}, k], got "
            f"{expert_index.shape}")
    if position.shape != expert_index.shape:
        raise ValueError(
            f"position must have expert_index's shape {expert_index.shape}, got {position.shape}")
    if weight is not None and weight.shape != expert_index.shape:
        raise ValueError(
            f"weight must have expert_index's shape {expert_index.shape}, got {weight.shape}")
    for name, a in (("expert_index", expert_index), ("position", position)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {a.dtype}")
