"""Language-model loss, and the sown collections the engine adds to the loss or logs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util


def lm_loss(logits: jax.Array, batch: Mapping[str, Any]) -> jax.Array:
    """Mean next-token cross entropy, computed in float32.

    Args:
      logits: `[batch, length, vocab]`.
      batch: `targets` int `[batch, length]` (already shifted by the data pipeline: row i of
        `targets` is the token that follows row i of `inputs`) and optional `mask`
        `[batch, length]` of per-token weights (bool or float).

    Returns:
      Scalar float32: the mask-weighted mean over tokens (0 when the mask is all zero).
    """
    if "targets" not in batch:
        raise ValueError(f"lm_loss needs batch['targets']; the batch has keys {sorted(batch)}")
    targets = jnp.asarray(batch["targets"])
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"lm_loss: logits {logits.shape} do not match targets {targets.shape}; expected "
            "logits [batch, length, vocab] and targets [batch, length]"
        )
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = batch.get("mask")
    if mask is None:
        return jnp.mean(losses)
    weights = jnp.broadcast_to(jnp.asarray(mask, dtype=jnp.float32), losses.shape)
    total = jnp.sum(weights)
    return jnp.sum(losses * weights) / jnp.where(total > 0, total, 1.0)


#: The Flax variable collection layers `sow` auxiliary losses into (e.g. the MoE load-balancing
#: loss); the engine adds the sum of its leaves to the training loss.
AUX_LOSS = "aux_loss"


def total_aux_loss(collections: Mapping[str, Any]) -> jax.Array | None:
    """Sum of every leaf of the `AUX_LOSS` collection (float32), or None when nothing was sown."""
    leaves = jax.tree.leaves(collections.get(AUX_LOSS, {}))
    if not leaves:
        return None
    return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in leaves)


#: The Flax variable collection layers `sow` per-step scalar metrics into (e.g. which MoE
#: strategy ran); the engine logs, for each name, the sum of its leaves over the model.
STEP_METRICS = "step_metrics"


def step_metrics(collections: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Name → the sum (float32) of every value sown under that name in `STEP_METRICS`."""
    flat = traverse_util.flatten_dict(dict(collections.get(STEP_METRICS, {})))
    totals: dict[str, jax.Array] = {}
    for path, values in flat.items():
        for leaf in jax.tree.leaves(values):
            totals[path[-1]] = totals.get(path[-1], 0.0) + jnp.sum(leaf.astype(jnp.float32))
    return totals


#: The Flax variable collection attention layers `sow` each head's largest attention logit into
#: when an optimizer clips them (Muon's `qk_clip`). The step reduces it by its maximum over the
#: microbatches and devices, hands it to the optimizer (`tx.update(..., attn_logit_max=...)`)
#: and logs its overall maximum under the same name.
LOGIT_MAX = "attn_logit_max"


def logit_maxima(collections: Mapping[str, Any]) -> dict[str, jax.Array]:
    """`/`-joined attention module path → its heads' largest logit (float32 `[*stack, heads]`,
    stacked like the module's params), from the `LOGIT_MAX` collection; empty without one."""
    flat = traverse_util.flatten_dict(dict(collections.get(LOGIT_MAX, {})))
    return {"/".join(path[:-1]): jnp.max(jnp.stack(values), axis=0)
            for path, values in flat.items()}


def sum_extras(total: Mapping[str, Any], extras: Mapping[str, Any]) -> dict[str, Any]:
    """Two microbatches' step extras in one: summed, and the `LOGIT_MAX` maxima maxed."""
    return {name: jax.tree.map(jnp.maximum if name == LOGIT_MAX else jnp.add, total[name], value)
            for name, value in extras.items()}


def zero_extras(shapes: Mapping[str, Any]) -> dict[str, Any]:
    """The identity of `sum_extras` for extras shaped like `shapes`."""
    def zeros(name):
        fill = -jnp.inf if name == LOGIT_MAX else 0.0
        return lambda s: jnp.full(s.shape, fill, s.dtype)

    return {name: jax.tree.map(zeros(name), value) for name, value in shapes.items()}


def mean_extras(extras: Mapping[str, Any], count: int,
                axes: tuple[str, ...] = ()) -> dict[str, Any]:
    """`sum_extras` over `count` microbatches → their means (the maxima stay maxima), reduced
    over the manual mesh `axes` too inside a `shard_map`."""
    def one(name):
        if name == LOGIT_MAX:
            return lambda x: jax.lax.pmax(x, axes) if axes else x
        return lambda x: jax.lax.pmean(x / count, axes) if axes else x / count

    return {name: jax.tree.map(one(name), value) for name, value in extras.items()}
