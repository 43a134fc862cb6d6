"""Expert-choice routing (Zhou et al. 2022): each expert takes its top-`C` tokens of the group.

Every expert fills exactly its `C` slots, so the load is balanced by construction and nothing
overflows; instead a token may be taken by several experts or by none (it then passes through
the layer as zero, like a dropped token). The decision is returned as a token-choice `Routing`
with one choice per expert (`k = E`): choice `j` of token `t` is expert `j`, kept at the slot
of `t` in `j`'s ranking when `j` took it, dropped otherwise. So the same dispatch and combine
kernels run it, and everything downstream (expert parallelism, capacity buffers) is unchanged.

Causality: a token's experts depend on the scores of every token of its group, later ones
included. In a causal LM this leaks information from the future into training, and decoding
one token at a time cannot reproduce it; `sample` refuses it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspeed.moe.gating import Routing, compute_capacity



def expert_choice_gating(logits, k: int, capacity_factor: float = 1.0, *, min_capacity: int = 4,
                         eval_mode: bool = False, eval_capacity_factor: float | None = None,
                         z_loss_coef: float = 0.0) -> Routing:
    """Each expert picks the `C` tokens with its highest router probability.

    Args:
      logits: `[tokens, experts]` router logits (all math in fp32).
      k: the average experts per token the capacity is sized for: `C = max(ceil(k *
        capacity_factor * T / E), min_capacity)`, at most `T` (Zhou et al.'s `c = k * cf`).
      capacity_factor, min_capacity, eval_mode, eval_capacity_factor: as in `top_k_gating`.
      z_loss_coef: the router z-loss coefficient.

    Returns:
      A `Routing` with `k = E` choices per token (see the module docstring). The weights are
      the router's softmax probabilities of the taken (token, expert) pairs, not renormalised;
      `aux_loss` is 0 (there is nothing to balance); `expert_counts` is each expert's taken
      tokens (`C`); `dropped_fraction` is the share of tokens no expert took.
    """
    num_tokens, num_experts = logits.shape
    factor = eval_capacity_factor if eval_mode and eval_capacity_factor is not None else capacity_factor
    capacity = min(num_tokens, compute_capacity(num_tokens, num_experts, k=k,
                                                capacity_factor=factor, min_capacity=min_capacity))
    logits = logits.astype(jnp.float32)
    gates = jax.nn.softmax(logits, axis=-1)
    _, taken = jax.lax.top_k(gates.T, capacity)  # [E, C]: each expert's tokens, best first
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    slot = jnp.full((num_experts, num_tokens), capacity, jnp.int32)
    slot = slot.at[experts[:, None], taken].set(jnp.arange(capacity, dtype=jnp.int32)[None, :])
    position = slot.T  # [T, E]; `capacity` where the expert did not take the token
    kept = position < capacity
    weight = jnp.where(kept, gates, 0.0)
    z = jax.nn.logsumexp(logits, axis=-1)
    return Routing(
        expert_index=jnp.broadcast_to(experts, (num_tokens, num_experts)),
        position=position,
        weight=weight,
        capacity=int(capacity),
        aux_loss=jnp.zeros((), jnp.float32),
        z_loss=z_loss_coef * jnp.mean(jnp.square(z)),
        expert_counts=jnp.sum(kept, axis=0).astype(jnp.int32),
        dropped_fraction=jnp.mean(jnp.logical_not(jnp.any(kept, axis=1)).astype(jnp.float32)),
    )
