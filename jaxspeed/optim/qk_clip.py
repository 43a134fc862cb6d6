"""QK-clip (MuonClip, Kimi K2 2025): attention heads whose logits grew past a threshold have
their query and key projections scaled back after the update.

For each head `h` whose largest logit this step, `S_h = max q·k/√d`, passes `threshold` `τ`, the
updated query projection is scaled by `γ_h^α` and the key projection by `γ_h^(1-α)`, with
`γ_h = τ / S_h`, so that the head's logits on the same activations scale by `γ_h`: its largest
one comes back to `τ`. Heads at or under `τ` keep their update bit for bit. With grouped-query
attention a key head serves a group of query heads; it is scaled for the group's most clipped
head (`min` of their `γ^(1-α)`), so no head's logits grow and each clipped one ends at or under
`τ`. Biases of the projections (`query_bias`, `key_bias`) are scaled with them.

The maxima come from the forward pass (`jaxspeed.ops.losses.LOGIT_MAX`, recorded by the GPT's
attention layers) and reach `update` as the extra argument `attn_logit_max`: a mapping of each
attention module's `/`-joined path to its heads' maxima `[*stack, heads]`. Its params are that
module's `query` and `key` (`[*stack, embed, heads, head_dim]`) and optional biases
(`[*stack, heads, head_dim]`), as `jaxspeed.models.attention.Attention` lays them out.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax

from jaxspeed.tree_paths import key_names

#: The projections QK-clip scales: param name → whether it is the query side.
_PROJECTIONS = {"query": True, "query_bias": True, "key": False, "key_bias": False}


def head_scales(logit_max: jax.Array, threshold: float, power: float, heads: int) -> jax.Array:
    """`γ^power` per head (`[*stack, heads]`), `γ = min(1, threshold / logit_max)`, for
    `heads` heads; fewer `heads` than maxima (grouped keys): each group's smallest."""
    gamma = (threshold / jnp.maximum(logit_max, threshold)) ** power  # arithmetic: on a host too
    group = gamma.shape[-1] // heads
    return jnp.min(gamma.reshape(*gamma.shape[:-1], heads, group), axis=-1)


def qk_clip(threshold: float, alpha: float = 0.5) -> optax.GradientTransformationExtraArgs:
    """QK-clip as the last transformation of a chain: the updates that land each clipped
    head's query/key projections at `γ^α` / `γ^(1-α)` times their updated values.

    Args:
      threshold: `τ`, the largest attention logit left alone (Kimi K2: 100).
      alpha: the query's share of the scaling, in [0, 1] (Kimi K2: 0.5).

    Returns:
      A stateless `optax.GradientTransformationExtraArgs`. Its `update` needs `params` and
      `attn_logit_max=` (see the module docstring).
    """
    if threshold <= 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"qk_clip: need threshold > 0 and 0 <= alpha <= 1; got "
                         f"threshold={threshold}, alpha={alpha}")

    def update(updates, state, params=None, *, attn_logit_max: Mapping | None = None, **extra):
        del extra
        if attn_logit_max is None or params is None:
            raise ValueError(
                "qk_clip needs the params and the attention logit maxima, "
                "update(..., params, attn_logit_max=...): the model must record them "
                "(jaxspeed's GPT does when optimizer.params.qk_clip is set)")
        clipped = set()

        def one(path, update, param):
            names = key_names(path)
            module, query = "/".join(names[:-1]), _PROJECTIONS.get(names[-1])
            if query is None or module not in attn_logit_max:
                return update
            clipped.add(module)
            maxima = attn_logit_max[module]
            bias = names[-1].endswith("_bias")  # [*stack, heads, kv], else [*stack, embed, ...]
            heads = param.shape[maxima.ndim - 1 if bias else maxima.ndim]
            scale = head_scales(maxima, threshold, alpha if query else 1.0 - alpha, heads)
            scale = scale[..., :, None] if bias else scale[..., None, :, None]
            scaled = (param + update) * scale.astype(update.dtype) - param
            return jnp.where(scale < 1, scaled, update)

        updates = jax.tree.map_with_path(one, updates, params)
        if not clipped:
            raise ValueError(
                f"qk_clip: no query/key params under the attention modules "
                f"{sorted(attn_logit_max)} the logit maxima name")
        return updates, state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
