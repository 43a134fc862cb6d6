"""Top-k gating (jaxspeed/moe/gating.py) against a plain numpy reference of the slot-filling rule.

Gating runs jitted (one small compile per configuration, at -O0): eager dispatch of its many
small ops is slower here than compiling them.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspeed.moe import gating
from jaxspeed.moe.gating import Routing, compute_capacity, gate_logits, top_k_gating
from numerics import assert_close, program_rtol, sum_rtol

#: fp32 gating against the float64 reference (tests/numerics.py): the weights are a softmax
#: over at most 8 experts renormalised over k, the aux loss a softmax, a mean over at most 32
#: tokens and a sum over the experts: sums of at most 32 terms, 3 chained.
GATE_RTOL = program_rtol(width=32, depth=3)

STATIC = ("k", "capacity_factor", "min_capacity", "drop_tokens", "eval_mode",
          "eval_capacity_factor", "capacity", "normalize_gate", "noisy_gate_policy",
          "gate_noise", "use_rts", "bpr", "z_loss_coef")
gate = jax.jit(top_k_gating, static_argnames=STATIC)


def random_logits(seed, tokens, experts, scale=2.0):
    return np.random.default_rng(seed).normal(size=(tokens, experts)).astype(np.float32) * scale


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def reference_gating(logits, k, capacity, *, order=None, normalize=True, select=None):
    """GShard/DeepSpeed slot filling written as loops: choice by choice, tokens in `order`."""
    gates = softmax(logits)
    tokens, experts = gates.shape
    scores = gates if select is None else np.asarray(select, np.float64)
    expert_index = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    order = range(tokens) if order is None else np.asarray(order).tolist()
    position = np.zeros((tokens, k), np.int64)
    fill = [0] * experts
    for j in range(k):
        for t in order:
            e = expert_index[t, j]
            position[t, j] = fill[e]
            fill[e] += 1
    kept = position < capacity
    weight = np.where(kept, np.take_along_axis(gates, expert_index, axis=1), 0.0)
    if normalize and k > 1:
        weight = weight / np.maximum(weight.sum(axis=1, keepdims=True), np.finfo(np.float32).eps)
    top1 = np.bincount(expert_index[:, 0], minlength=experts) / tokens
    aux = experts * np.sum(gates.mean(axis=0) * top1)
    counts = np.bincount(expert_index.reshape(-1), minlength=experts)
    return dict(expert_index=expert_index, position=position, weight=weight, aux_loss=aux,
                expert_counts=counts, dropped_fraction=1 - kept.mean())


def assert_routing_matches(routing: Routing, want, capacity):
    assert routing.capacity == capacity and isinstance(routing.capacity, int)
    assert routing.expert_index.dtype == jnp.int32 and routing.position.dtype == jnp.int32
    assert routing.weight.dtype == jnp.float32
    np.testing.assert_array_equal(routing.expert_index, want["expert_index"])
    np.testing.assert_array_equal(routing.position, want["position"])
    np.testing.assert_array_equal(routing.expert_counts, want["expert_counts"])
    assert_close((routing.weight, routing.aux_loss, routing.dropped_fraction),
                 (want["weight"], want["aux_loss"], want["dropped_fraction"]), rtol=GATE_RTOL)


@pytest.mark.parametrize("tokens,experts,k,cf,min_capacity", [
    (32, 4, 1, 1.0, 4),
    (32, 4, 2, 0.5, 2),    # drops in both choices
    (24, 8, 3, 1.25, 1),   # ceil(3 * 1.25 * 24 / 8) = 12
    (8, 4, 4, 1.0, 4),     # k = E
])
def test_matches_reference(tokens, experts, k, cf, min_capacity):
    logits = random_logits(tokens * k, tokens, experts)
    capacity = max(math.ceil(k * cf * tokens / experts), min_capacity)
    routing = gate(jnp.asarray(logits), k, cf, min_capacity=min_capacity)
    assert_routing_matches(routing, reference_gating(logits, k, capacity), capacity)


def test_capacity_formula_and_overrides():
    assert compute_capacity(64, 8, k=2, capacity_factor=1.0) == 16
    assert compute_capacity(10, 4, k=1, capacity_factor=1.0, min_capacity=0) == 3
    assert compute_capacity(8, 8, k=1, capacity_factor=1.0, min_capacity=4) == 4
    logits = jax.ShapeDtypeStruct((16, 4), jnp.float32)

    def capacity(*args, **kwargs):  # static, so abstract evaluation is enough
        return jax.eval_shape(lambda l: top_k_gating(l, *args, **kwargs), logits).capacity

    assert capacity(2, 1.0) == 8
    assert capacity(2, 1.0, eval_mode=True, eval_capacity_factor=2.0) == 16
    assert capacity(2, 1.0, eval_capacity_factor=2.0) == 8
    assert capacity(2, 1.0, capacity=3) == 3
    assert capacity(2, drop_tokens=False) == 16
    assert capacity(2, 0.1, min_capacity=4) == 4


def test_slot_order_first_choices_before_second():
    # Every token prefers expert 0 then expert 1: expert 1 takes all second choices, and with
    # T = 4 and capacity 2 the first choices of tokens 2, 3 are dropped at expert 0.
    logits = jnp.asarray([[3.0, 2.0, 0.0]] * 2 + [[2.0, 3.0, 0.0]] * 2)
    r = gate(logits, 2, capacity=3)
    np.testing.assert_array_equal(r.expert_index, [[0, 1], [0, 1], [1, 0], [1, 0]])
    # expert 0: first choices of tokens 0, 1 (slots 0, 1), then second choices of 2, 3.
    # expert 1: first choices of tokens 2, 3 (slots 0, 1), then second choices of 0, 1.
    np.testing.assert_array_equal(r.position, [[0, 2], [1, 3], [0, 2], [1, 3]])
    kept = np.asarray(r.position) < 3
    np.testing.assert_array_equal(kept, [[1, 1], [1, 0], [1, 1], [1, 0]])


def test_normalize_applies_after_dropping():
    logits = jnp.asarray(random_logits(3, 16, 4))
    r = gate(logits, 2, capacity=3, normalize_gate=True)
    raw = gate(logits, 2, capacity=3, normalize_gate=False)
    kept = np.asarray(r.position) < 3
    assert (kept.sum(1) == 1).any() and (kept.sum(1) == 2).any()
    w = np.asarray(r.weight)
    # w1 / (w1 + w2) + w2 / (w1 + w2): a 2-term sum, two quotients and a 2-term sum.
    np.testing.assert_allclose(w[kept.any(1)].sum(1), 1.0, rtol=program_rtol(width=2, depth=3))
    # lost its partner: w / (w + 0), one rounding at most
    np.testing.assert_allclose(w[kept.sum(1) == 1].max(1), 1.0, rtol=sum_rtol(1))
    assert (w[~kept] == 0).all() and (np.asarray(raw.weight)[~kept] == 0).all()
    probs = softmax(logits)
    np.testing.assert_allclose(  # a softmax over 4 experts against float64
        np.asarray(raw.weight)[kept],
        np.take_along_axis(probs, np.asarray(r.expert_index), 1)[kept],
        rtol=program_rtol(width=4, depth=2))


def test_aux_loss_and_z_loss_values():
    logits = random_logits(5, 32, 8)
    r = gate(jnp.asarray(logits), 2, 1.0, z_loss_coef=0.01)
    gates = softmax(logits)
    frac = np.bincount(gates.argmax(1), minlength=8) / 32
    # Both: a reduction over the 8 experts, a mean over the 32 tokens and one more step.
    np.testing.assert_allclose(r.aux_loss, 8 * np.sum(gates.mean(0) * frac), rtol=GATE_RTOL)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(1))
    np.testing.assert_allclose(r.z_loss, 0.01 * np.mean(lse**2), rtol=GATE_RTOL)
    uniform = gate(np.eye(4, dtype=np.float32)[np.arange(8) % 4], 1)
    # balanced: the minimum, 1 (a softmax over 4, a mean over 8 tokens, a sum over 4)
    np.testing.assert_allclose(uniform.aux_loss, 1.0, rtol=program_rtol(width=8, depth=3))
    # k = 1 is not normalized: the weight stays the top-1 probability (a softmax over 4).
    np.testing.assert_allclose(uniform.weight[:, 0], np.e / (np.e + 3),
                               rtol=program_rtol(width=4, depth=2))


def test_gradients_flow_to_logits_through_weight_aux_and_z():
    logits = jnp.asarray(random_logits(6, 16, 4))

    def loss(l):
        r = top_k_gating(l, 2, capacity=3, z_loss_coef=0.1)
        return jnp.sum(r.weight * jnp.arange(2.0)) + r.aux_loss + r.z_loss

    g = jax.jit(jax.grad(loss))(logits)
    assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).sum() > 0


def test_bpr_fills_slots_by_top1_probability():
    logits = random_logits(7, 24, 4)
    r = gate(jnp.asarray(logits), 2, 0.5, min_capacity=0, bpr=True)
    order = np.argsort(-softmax(logits).max(1), kind="stable")
    want = reference_gating(logits, 2, r.capacity, order=order)
    assert_routing_matches(r, want, 6)
    assert r.dropped_fraction > 0


def test_rts_is_a_deterministic_random_order():
    logits = jnp.asarray(random_logits(8, 32, 4))
    key = jax.random.key(1)

    @jax.jit
    def run(key):  # the routing and the documented random order, from one compile
        order = jax.random.permutation(jax.random.fold_in(key, 2), 32)
        return top_k_gating(logits, 1, 0.5, use_rts=True, rng=key), order

    (a, order), (b, _), (c, _) = run(key), run(key), run(jax.random.key(2))
    chex.assert_trees_all_equal(a, b)
    assert not np.array_equal(a.position, c.position)
    assert_routing_matches(a, reference_gating(np.asarray(logits), 1, 4, order=order), 4)
    plain = gate(logits, 1, 0.5, use_rts=True, eval_mode=True)  # no rng needed
    assert_routing_matches(plain, reference_gating(np.asarray(logits), 1, 4), 4)


def test_rsample_picks_with_gumbel_noise_and_weights_stay_clean():
    logits = random_logits(9, 32, 4, scale=0.5)
    key = jax.random.key(3)
    r, gumbel = jax.jit(lambda l, key: (
        top_k_gating(l, 2, capacity=32, noisy_gate_policy="RSample", rng=key),
        jax.random.gumbel(jax.random.fold_in(key, 1), l.shape)))(logits, key)
    want = reference_gating(logits, 2, 32, select=logits + gumbel)
    assert_routing_matches(r, want, 32)
    assert not np.array_equal(r.expert_index, reference_gating(logits, 2, 32)["expert_index"])
    clean = gate(jnp.asarray(logits), 2, capacity=32, noisy_gate_policy="RSample",
                         eval_mode=True)
    assert_routing_matches(clean, reference_gating(logits, 2, 32), 32)


def test_tutel_gate_noise_perturbs_logits():
    logits = random_logits(10, 16, 4)
    key = jax.random.key(4)
    r, noise = jax.jit(lambda l, key: (
        top_k_gating(l, 2, 1.0, gate_noise=1.0, rng=key),
        jax.random.normal(jax.random.fold_in(key, 0), l.shape)))(logits, key)
    noisy = logits + 1.0 * np.asarray(noise) / 4
    assert_routing_matches(r, reference_gating(noisy, 2, r.capacity), r.capacity)
    assert not np.allclose(r.weight, reference_gating(logits, 2, r.capacity)["weight"])


def test_jitter_multiplies_the_gate_input():
    x = jnp.asarray(random_logits(11, 8, 16))
    kernel = jnp.asarray(random_logits(12, 16, 4))
    key = jax.random.key(5)
    got, u, evaluated = jax.jit(lambda x, key: (
        gate_logits(x.astype(jnp.bfloat16), kernel, noisy_gate_policy="Jitter", rng=key),
        jax.random.uniform(key, x.shape, jnp.float32, 0.99, 1.01),
        gate_logits(x, kernel, noisy_gate_policy="Jitter", eval_mode=True)))(x, key)
    x32 = np.asarray(x).astype(jnp.bfloat16).astype(np.float32)
    assert got.dtype == jnp.float32
    # fp32 matmuls over the 16 inputs here and in numpy (the jitter's product rounds alike).
    rtol = program_rtol(width=16, depth=1)
    assert_close(got, (x32 * np.asarray(u)) @ np.asarray(kernel), rtol=rtol)
    clean = x32 @ np.asarray(kernel)
    assert 0 < np.abs(np.asarray(got) - clean).max() < 0.1 * np.abs(clean).max()
    assert_close(evaluated, np.asarray(x) @ np.asarray(kernel), rtol=rtol)


def test_fp32_math_with_bf16_logits():
    logits = random_logits(13, 32, 8).astype(jnp.bfloat16)
    r, want = jax.jit(lambda l: (top_k_gating(l, 2, 1.0, z_loss_coef=1e-3),
                                  top_k_gating(l.astype(jnp.float32), 2, 1.0, z_loss_coef=1e-3)))(
        logits)
    assert r.weight.dtype == r.aux_loss.dtype == r.z_loss.dtype == jnp.float32
    chex.assert_trees_all_equal(r, want)


def test_capacity_stays_static_under_jit_and_vmap():
    logits = jnp.asarray(random_logits(14, 16, 4))
    r = jax.jit(lambda l: top_k_gating(l, 2, 1.0))(logits)
    assert r.capacity == 8 and isinstance(r.capacity, int)
    batched = jax.eval_shape(jax.vmap(lambda l: top_k_gating(l, 1, 1.0)),
                             np.stack([logits] * 2))
    assert batched.capacity == 4 and batched.position.shape == (2, 16, 1)
    assert len(jax.tree.leaves(r)) == len(Routing._fields) - 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=5), "k must be an int in \\[1, num_experts=4\\], got 5"),
    (dict(k=0), "k must be"),
    (dict(k=2, capacity_factor=0.0), "capacity_factor must be > 0 with drop_tokens=True, got 0"),
    (dict(k=2, capacity_factor=-1.0), "capacity_buckets"),
    (dict(k=2, noisy_gate_policy="Gumbel"), "noisy_gate_policy must be one of"),
    (dict(k=2, noisy_gate_policy="RSample"), "needs? rng|rng .* is needed"),
    (dict(k=2, use_rts=True, bpr=True), "use_rts and bpr"),
    (dict(k=2, capacity=0), "capacity must be a positive"),
    (dict(k=2, gate_noise=-1.0), "gate_noise must be >= 0"),
])
def test_bad_input_is_named(kwargs, match):
    logits = jnp.zeros((8, 4))
    with pytest.raises(ValueError, match=match):
        top_k_gating(logits, **kwargs)


def test_bad_shapes_and_policies_elsewhere():
    with pytest.raises(ValueError, match="logits must have shape"):
        top_k_gating(jnp.zeros((2, 3, 4)), 1)
    with pytest.raises(ValueError, match="needs rng"):
        gate_logits(jnp.zeros((2, 3)), jnp.zeros((3, 4)), noisy_gate_policy="Jitter")
    assert gating.check_noisy_gate_policy("None") is None
    # Fine without drops; "Jitter" acts on the gate input only, so it changes nothing here.
    r = gate(np.zeros((8, 4), np.float32), 1, 0.0, drop_tokens=False, noisy_gate_policy="Jitter")
    np.testing.assert_array_equal(r.expert_index[:, 0], 0)  # ties: the lowest index
    np.testing.assert_array_equal(r.position[:, 0], np.arange(8))
    np.testing.assert_array_equal(r.weight, 0.25)  # exp(0) / (4 exp(0)): exact
