"""Top-k gating for mixture-of-experts: which expert and which capacity slot each token gets.

Follows GShard (Lepikhin et al. 2020, Alg. 1-2) and DeepSpeed-MoE's `TopKGate`, with Tutel's
options (Hwang et al. 2022): gate noise and batch-prioritized routing. Everything is computed in
fp32 whatever the dtype of the logits, and without any `[tokens, experts, capacity]` one-hot
tensor: slots come from one stable sort of the `k * tokens` choices by expert.

Slot order. Expert buffers are filled choice by choice, every first choice ahead of every
second choice (GShard/DeepSpeed), and within a choice in token order, or in priority order with
`bpr` (highest top-1 gate first, Tutel) or `use_rts` (a random order, DeepSpeed's random token
selection). A choice whose slot is `>= capacity` is dropped.

Randomness comes from one key, `rng`, split into independent streams with `fold_in`:
`fold_in(rng, 0)` for `gate_noise`, `fold_in(rng, 1)` for `RSample`, `fold_in(rng, 2)` for
`use_rts`. In `eval_mode` nothing is random and `rng` is not needed.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspeed.options.moe import NOISY_GATE_POLICIES

_NOISE_STREAM, _RSAMPLE_STREAM, _RTS_STREAM = 0, 1, 2


class Routing(NamedTuple):
    """The routing decision for `T` tokens over `E` experts, `k` choices each.

    A pytree whose leaves are the arrays; `capacity` is static (kept out of the leaves, so it
    stays a Python int through `jit`, `vmap` and `shard_map`).

    Attributes:
      expert_index: int32 `[T, k]`, the expert of each choice (choice 0 is the top-1).
      position: int32 `[T, k]`, the slot of the choice in its expert's buffer. A dropped choice
        has `position >= capacity`: the slot it would have had with unlimited capacity.
      weight: fp32 `[T, k]`, the combine weight; exactly 0 for a dropped choice.
      capacity: static int, slots per expert.
      aux_loss: fp32 scalar, GShard's load-balancing loss `E * sum_e mean_t(p_te) *
        frac_t(top1_t == e)`, unscaled (DeepSpeed's `l_aux`; the caller applies its coefficient).
      z_loss: fp32 scalar, `z_loss_coef * mean_t(logsumexp_e(logits_te) ** 2)` (ST-MoE).
      expert_counts: int32 `[E]`, choices routed to each expert before capacity drops.
      dropped_fraction: fp32 scalar, dropped choices / (T * k).
    """

    expert_index: jax.Array
    position: jax.Array
    weight: jax.Array
    capacity: int
    aux_loss: jax.Array
    z_loss: jax.Array
    expert_counts: jax.Array
    dropped_fraction: jax.Array


_ARRAY_FIELDS = tuple(f for f in Routing._fields if f != "capacity")


def _flatten_routing(r: Routing):
    return tuple(getattr(r, f) for f in _ARRAY_FIELDS), r.capacity


def _unflatten_routing(capacity, leaves):
    return Routing(capacity=capacity, **dict(zip(_ARRAY_FIELDS, leaves)))


jax.tree_util.register_pytree_node(Routing, _flatten_routing, _unflatten_routing)


def compute_capacity(num_tokens: int, num_experts: int, *, k: int, capacity_factor: float,
                     min_capacity: int = 4) -> int:
    """Slots per expert: `max(ceil(k * capacity_factor * T / E), min_capacity)`."""
    return max(math.ceil(k * capacity_factor * num_tokens / num_experts), int(min_capacity))


def check_noisy_gate_policy(policy):
    """Returns `policy` with DeepSpeed's "None" string mapped to None; raises if unknown."""
    if policy == "None":
        return None
    if policy not in NOISY_GATE_POLICIES:
        raise ValueError(
            f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES} (or the string 'None'), "
            f"got {policy!r}")
    return policy


def multiplicative_jitter(x, rng, *, epsilon: float = 1e-2):
    """DeepSpeed's `Jitter`: `x * u`, `u ~ Uniform(1 - epsilon, 1 + epsilon)` elementwise, fp32.

    Applied to the gate's *input* (Switch Transformer's recipe against bf16 rounding in the
    router), so it lives outside `top_k_gating`, which only sees logits; see `gate_logits`.
    """
    u = jax.random.uniform(rng, x.shape, jnp.float32, 1.0 - epsilon, 1.0 + epsilon)
    return x.astype(jnp.float32) * u


def gate_logits(x, kernel, *, noisy_gate_policy=None, rng=None, eval_mode: bool = False,
                jitter_epsilon: float = 1e-2):
    """The router's fp32 logits `x @ kernel`, with DeepSpeed's `Jitter` on the input.

    Args:
      x: `[tokens, model]` gate input, any float dtype (cast to fp32).
      kernel: `[model, experts]` gate weight (cast to fp32).
      noisy_gate_policy: with "Jitter" and not `eval_mode`, `x` is first multiplied by
        `multiplicative_jitter(x, rng, epsilon=jitter_epsilon)` (the key `rng` itself is
        used). Other policies act on the logits, in `top_k_gating`.
      rng: a PRNG key, needed for "Jitter" outside `eval_mode`.
      eval_mode: no jitter.
      jitter_epsilon: the jitter's half-width.

    Returns:
      fp32 `[tokens, experts]`.
    """
    policy = check_noisy_gate_policy(noisy_gate_policy)
    x32 = x.astype(jnp.float32)
    if policy == "Jitter" and not eval_mode:
        if rng is None:
            raise ValueError("noisy_gate_policy='Jitter' needs rng (a PRNG key) when training")
        x32 = multiplicative_jitter(x32, rng, epsilon=jitter_epsilon)
    return jnp.dot(x32, kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _as_int(value, name):
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a Python int, got {value!r}") from None


def _validate(logits, k, capacity_factor, min_capacity, drop_tokens, capacity, gate_noise,
              use_rts, bpr):
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [tokens, experts], got {logits.shape}")
    num_experts = logits.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k must be an int in [1, num_experts={num_experts}], got {k!r}")
    if drop_tokens and capacity is None and not capacity_factor > 0:
        raise ValueError(
            f"capacity_factor must be > 0 with drop_tokens=True, got {capacity_factor}; for "
            f"Tutel's dynamic capacity (capacity_factor <= 0) pick the capacity with "
            f"jaxspeed.moe.experts.capacity_buckets and pass it as capacity=")
    if min_capacity < 0:
        raise ValueError(f"min_capacity must be >= 0, got {min_capacity}")
    if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"capacity must be a positive Python int or None, got {capacity!r}")
    if gate_noise < 0:
        raise ValueError(f"gate_noise must be >= 0, got {gate_noise}")
    if use_rts and bpr:
        raise ValueError("use_rts and bpr both set the slot priority: choose at most one")


def _slot_ranks(expert_index, order, num_experts):
    """Slot of every choice with unlimited capacity, in GShard order.

    The choices are laid out in slot order (all first choices in priority order, then all
    second choices, ...) and stably sorted by expert; a choice's slot is its index in the sorted
    list minus its expert's start. `O(T * k)` memory (no `[T * k, E]` one-hot cumsum), and
    twice as fast as that cumsum on CPU.

    Args:
      expert_index: int32 `[T, k]`.
      order: int32 `[T]`, the tokens in priority order, or None for token order.
      num_experts: E.

    Returns:
      `(rank [T, k] int32, counts [E] int32)`.
    """
    tokens, k = expert_index.shape
    ranked = expert_index if order is None else expert_index[order]
    flat = ranked.T.reshape(-1)  # [k*T] in slot order
    by_expert = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    sorted_rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[flat[by_expert]]
    rank = jnp.zeros_like(flat).at[by_expert].set(sorted_rank, unique_indices=True)
    rank = rank.reshape(k, tokens).T
    if order is not None:
        rank = jnp.zeros_like(rank).at[order].set(rank, unique_indices=True)
    return rank.astype(jnp.int32), counts


def top_k_gating(logits, k: int, capacity_factor: float = 1.0, *, min_capacity: int = 4,
                 drop_tokens: bool = True, eval_mode: bool = False,
                 eval_capacity_factor: float | None = None, capacity: int | None = None,
                 normalize_gate: bool = True, noisy_gate_policy=None, rng=None,
                 gate_noise: float = 0.0, use_rts: bool = False, bpr: bool = False,
                 z_loss_coef: float = 0.0, selection_bias=None) -> Routing:
    """Routes each token to its top-k experts and assigns capacity slots (GShard/DeepSpeed).

    Args:
      logits: `[tokens, experts]` router logits, any float dtype; all math is fp32.
      k: choices per token, `1 <= k <= experts`.
      capacity_factor: capacity = `max(ceil(k * capacity_factor * T / E), min_capacity)`.
      min_capacity: lower bound of the capacity.
      drop_tokens: False makes the capacity `T` (the most one expert can receive), so no
        choice is dropped; `jaxspeed.moe.experts.dropless_ffn` avoids those buffers.
      eval_mode: no noise, no random token order; `eval_capacity_factor` applies.
      eval_capacity_factor: capacity factor in `eval_mode` (default: `capacity_factor`).
      capacity: an explicit static capacity, overriding the formula (dynamic-capacity buckets).
      normalize_gate: for `k > 1`, rescale each token's kept weights to sum to 1. Applied
        *after* dropping, as DeepSpeed does: a token that lost its second choice keeps weight
        1 on the first. With `k == 1` the weight stays the top-1 probability (normalizing it
        would make it a constant 1, cutting the router's gradient), as in DeepSpeed and Tutel.
      noisy_gate_policy: None, "Jitter" or "RSample" (DeepSpeed). "RSample" picks the experts
        by `logits + Gumbel noise` (the weights stay the clean probabilities of the picked
        experts). "Jitter" multiplies the gate *input*, so it is applied by `gate_logits`;
        here it leaves the logits unchanged. Both only outside `eval_mode`.
      rng: PRNG key for `gate_noise`, "RSample" and `use_rts` outside `eval_mode`.
      gate_noise: Tutel's noise: `logits + gate_noise * N(0, 1) / E` before the softmax; the
        noisy probabilities are used for selection, weights and the aux loss.
      use_rts: random token selection: slots within each choice are filled in a random token
        order (`jax.random.permutation(fold_in(rng, 2), T)`), so drops are not biased to the
        end of the batch.
      bpr: batch-prioritized routing: within each choice, tokens with the highest top-1
        probability get slots first (ties in token order).
      z_loss_coef: the router z-loss coefficient; `Routing.z_loss` is already scaled by it.
      selection_bias: `[E]` or None: added to the scores that pick the experts, and to
        nothing else (the weights stay the probabilities; DeepSeek-V3's balancing bias,
        `jaxspeed.moe.balance`); no gradient flows into it.

    Returns:
      A `Routing`.
    """
    policy = check_noisy_gate_policy(noisy_gate_policy)
    k = _as_int(k, "k")
    capacity = None if capacity is None else _as_int(capacity, "capacity")
    _validate(logits, k, capacity_factor, min_capacity, drop_tokens, capacity, gate_noise,
              use_rts, bpr)
    num_tokens, num_experts = logits.shape
    training = not eval_mode
    needs_rng = training and (gate_noise > 0 or policy == "RSample" or use_rts)
    if needs_rng and rng is None:
        raise ValueError(
            "rng (a PRNG key) is needed when training with gate_noise > 0, "
            "noisy_gate_policy='RSample' or use_rts=True")

    if capacity is None:
        if drop_tokens:
            factor = capacity_factor
            if eval_mode and eval_capacity_factor is not None:
                factor = eval_capacity_factor
            capacity = compute_capacity(num_tokens, num_experts, k=k, capacity_factor=factor,
                                        min_capacity=min_capacity)
        else:
            capacity = num_tokens

    logits = logits.astype(jnp.float32)
    noisy = logits
    if training and gate_noise > 0:
        noise = jax.random.normal(jax.random.fold_in(rng, _NOISE_STREAM), logits.shape)
        noisy = logits + gate_noise * noise / num_experts
    gates = jax.nn.softmax(noisy, axis=-1)
    scores = noisy  # the softmax is monotonic: logits rank experts like probabilities do
    if training and policy == "RSample":
        gumbel = jax.random.gumbel(jax.random.fold_in(rng, _RSAMPLE_STREAM), logits.shape)
        scores = noisy + gumbel
    if selection_bias is not None:
        scores = scores + jax.lax.stop_gradient(selection_bias).astype(jnp.float32)
    _, expert_index = jax.lax.top_k(scores, k)
    expert_index = expert_index.astype(jnp.int32)
    picked = jnp.take_along_axis(gates, expert_index, axis=1)

    order = None
    if training and use_rts:
        order = jax.random.permutation(jax.random.fold_in(rng, _RTS_STREAM), num_tokens)
    elif bpr:
        order = jnp.argsort(-jnp.max(gates, axis=1), stable=True)
    position, counts = _slot_ranks(expert_index, order, num_experts)

    kept = position < capacity
    weight = jnp.where(kept, picked, 0.0)
    if normalize_gate and k > 1:
        denom = jnp.sum(weight, axis=1, keepdims=True)
        weight = weight / jnp.maximum(denom, jnp.finfo(jnp.float32).eps)

    # argmax, not expert_index[:, 0]: a second slice of the TopK result makes XLA:CPU sort
    # every row instead (20x slower at T=4096, E=64); both pick the lowest index on ties.
    top1 = jax.nn.one_hot(jnp.argmax(scores, axis=1), num_experts, dtype=jnp.float32)
    aux_loss = num_experts * jnp.sum(jnp.mean(gates, axis=0) * jnp.mean(top1, axis=0))
    z = jax.nn.logsumexp(logits, axis=-1)
    z_loss = z_loss_coef * jnp.mean(jnp.square(z))
    # The dropped choices' mean, not 1 - the kept ones': exactly 0 without drops (XLA may
    # fuse `1 - sum * (1 / n)` into an FMA, which left -3e-8 for n = 96).
    dropped = jnp.mean(jnp.logical_not(kept).astype(jnp.float32))
    return Routing(expert_index, position, weight, int(capacity), aux_loss, z_loss, counts,
                   dropped)
