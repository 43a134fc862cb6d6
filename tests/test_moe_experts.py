"""Expert FFNs (jaxspeed/moe/experts.py): batched, dropless (ragged_dot) and dynamic capacity.

References are plain loops over tokens and choices: `sum_j w_tj * expert_{e_tj}(x_t)`.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from scipy.special import erf

from jaxspeed.moe import experts
from jaxspeed.moe.dispatch import combine, dispatch
from jaxspeed.moe.experts import (ExpertParams, capacity_buckets, dropless_ffn, expert_ffn,
                                  init_expert_params, select_capacity_bucket,
                                  switch_on_capacity)
from jaxspeed.moe.gating import top_k_gating
from numerics import assert_close, program_rtol


def f32(a):
    """A float32 jax array, converted on the host (an eager convert would compile)."""
    return jnp.asarray(np.asarray(a, np.float32))


def params_for(seed, num_experts, d_model, d_hidden, activation, *, bias=False):
    """Random `ExpertParams` from numpy (no eager PRNG compiles), non-zero biases if `bias`."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray((rng.normal(size=shape) * scale).astype(np.float32))

    return ExpertParams(
        w_in=normal(num_experts, d_model, d_hidden, scale=d_model**-0.5),
        w_out=normal(num_experts, d_hidden, d_model, scale=d_hidden**-0.5),
        w_gate=normal(num_experts, d_model, d_hidden) if activation == "swiglu" else None,
        b_in=normal(num_experts, d_hidden) if bias else None,
        b_out=normal(num_experts, d_model) if bias else None)


def numpy_expert(x, e, p: ExpertParams, activation):
    """One expert on rows `x [n, M]`, in float64."""
    f = lambda a: None if a is None else np.asarray(a, np.float64)[e]  # noqa: E731
    h = x @ f(p.w_in) + (0 if p.b_in is None else f(p.b_in))
    if activation == "relu":
        h = np.maximum(h, 0)
    elif activation == "gelu":
        h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
    else:
        g = x @ f(p.w_gate)
        h = g / (1 + np.exp(-g)) * h
    return h @ f(p.w_out) + (0 if p.b_out is None else f(p.b_out))


@pytest.mark.parametrize("activation,bias", [("relu", True), ("gelu", False), ("swiglu", True)])
def test_expert_ffn_matches_per_expert_loop(activation, bias):
    p = params_for(0, 4, 8, 16, activation, bias=bias)
    x = np.random.default_rng(0).normal(size=(4, 5, 8))
    ffn = jax.jit(functools.partial(expert_ffn, activation=activation))
    got = ffn(f32(x), p)
    want = np.stack([numpy_expert(x[e], e, p, activation) for e in range(4)])
    # fp32 against float64 (tests/numerics.py): matmuls over M = 8 and H = 16, chained with
    # the activation (its own few-ulp rounding) between them.
    assert_close(got, want, rtol=program_rtol(width=16, depth=3))


def moe_capacity_path(x, routing, p, activation):
    """Dispatch, batched experts, combine (the XLA path)."""
    y = expert_ffn(dispatch(x, routing, p.w_in.shape[0], impl="xla"), p, activation=activation)
    return combine(y, routing, impl="xla")


@pytest.mark.parametrize("k,activation", [(1, "relu"), (2, "swiglu"), (3, "gelu")])
def test_dropless_equals_large_capacity_path_with_gradients(k, activation):
    tokens, num_experts, d_model = 32, 4, 8
    p = params_for(k, num_experts, d_model, 16, activation, bias=True)
    rng = np.random.default_rng(k)
    x = f32(rng.normal(size=(tokens, d_model)))
    logits = f32(rng.normal(size=(tokens, num_experts)) * 3)
    ct = f32(rng.normal(size=(tokens, d_model)))

    routing = jax.jit(lambda l: top_k_gating(l, k, drop_tokens=False))(logits)
    assert routing.capacity == tokens and float(routing.dropped_fraction) == 0.0

    @jax.jit
    def both(x, p, weight):
        # The gradient in the combine weights is what carries the gate's gradient.
        def value_and_grads(fn):
            out, vjp = jax.vjp(fn, x, p, weight)
            return out, vjp(ct)

        capacity_path = lambda x, p, w: moe_capacity_path(  # noqa: E731
            x, routing._replace(weight=w), p, activation)
        dropless = lambda x, p, w: dropless_ffn(  # noqa: E731
            x, routing.expert_index, w, p, activation)
        return value_and_grads(capacity_path), value_and_grads(dropless)

    (want, want_grads), (got, got_grads) = both(x, p, routing.weight)
    assert got.shape == (tokens, d_model) and got.dtype == jnp.float32
    # Grouped matmuls against capacity buffers (tests/numerics.py): widest sums over the 32
    # tokens an expert's weight gradient sums over (M = 8, H = 16 narrower); forward chain of
    # the two matmuls, the activation between them and the combine over k; 3x with the backward.
    assert_close((got, got_grads), (want, want_grads),
                 rtol=program_rtol(width=tokens, depth=3 * 4))


def test_dropless_gradients_match_plain_reference():
    tokens, k, num_experts, d_model = 16, 2, 4, 8
    p = params_for(7, num_experts, d_model, 8, "gelu", bias=True)
    rng = np.random.default_rng(7)
    x = f32(rng.normal(size=(tokens, d_model)))
    # Expert 1 is busy, expert 3 gets no token.
    e = jnp.asarray([[1, 2 if t % 2 else 0] for t in range(12)] + [[0, 2]] * 4, jnp.int32)
    w = f32(rng.random((tokens, k)))

    def reference(x, p, w):
        # Per (token, choice): gather that expert's weights and apply it (no sorting, no groups).
        def one(xt, et, wt):
            q = jax.tree.map(lambda a: a[et], p)
            h = jax.nn.gelu(xt @ q.w_in + q.b_in, approximate=False)
            return wt * (h @ q.w_out + q.b_out)

        per_choice = jax.vmap(jax.vmap(one, (None, 0, 0)), (0, 0, 0))(x, e, w)
        return per_choice.sum(axis=1)

    ct = f32(rng.normal(size=(tokens, d_model)))

    @jax.jit
    def grads(x, p, w):
        got = jax.vjp(lambda *a: dropless_ffn(*a[:1], e, a[2], a[1], "gelu"), x, p, w)
        want = jax.vjp(reference, x, p, w)
        return (got[0], got[1](ct)), (want[0], want[1](ct))

    got, want = grads(x, p, w)
    # Sums over at most the 16 tokens (an expert's weight gradient; M = H = 8); the chain of
    # `test_dropless_equals_large_capacity_path_with_gradients` (tests/numerics.py).
    assert_close(got, want, rtol=program_rtol(width=tokens, depth=3 * 4))


def test_capacity_buckets():
    assert capacity_buckets(64, 8, k=2, capacity_factor=1.0) == (16,)
    assert capacity_buckets(64, 8, k=2, capacity_factor=-2.0) == (8, 16, 32)
    assert capacity_buckets(64, 8, k=2, capacity_factor=-2.0, multiple_of=1) == (4, 8, 16, 32)
    assert capacity_buckets(64, 8, k=1, capacity_factor=0) == (8, 16, 32, 64)  # uncapped: T
    assert capacity_buckets(40, 8, k=1, capacity_factor=-1.0, min_capacity=4) == (5,)
    with pytest.raises(ValueError, match="num_buckets"):
        capacity_buckets(8, 2, k=1, capacity_factor=-1.0, num_buckets=0)
    buckets = (8, 16, 32)
    picks = [int(select_capacity_bucket(jnp.asarray(c), buckets)) for c in
             ([3, 8, 1], [9, 0, 0], [32, 1, 1], [40, 0, 0])]
    assert picks == [0, 1, 2, 2]


def test_switch_on_capacity_runs_the_chosen_bucket():
    tokens, num_experts, d_model = 32, 4, 8
    p = params_for(3, num_experts, d_model, 8, "relu")
    rng = np.random.default_rng(3)
    x = f32(rng.normal(size=(tokens, d_model)))
    skewed = rng.normal(size=(tokens, num_experts)) + np.array([2.0, 0, 0, 0])
    logits = f32(skewed)
    buckets = capacity_buckets(tokens, num_experts, k=1, capacity_factor=-2.0, multiple_of=4)
    assert buckets == (4, 8, 16)

    def layer(x, logits, *, capacity):
        r = top_k_gating(logits, 1, capacity=capacity)
        return moe_capacity_path(x, r, p, "relu"), r.dropped_fraction

    @jax.jit
    def dynamic(x, logits):
        counts = top_k_gating(logits, 1, 1.0).expert_counts
        return switch_on_capacity(layer, counts, buckets, x, logits), counts

    (out, dropped), counts = dynamic(x, logits)
    busiest = int(np.max(counts))
    chosen = min([b for b in buckets if b >= busiest], default=buckets[-1])
    want_out, want_dropped = jax.jit(functools.partial(layer, capacity=chosen))(x, logits)
    # The branch of the switch against the same layer compiled alone: forward only, softmax
    # over 4 experts, matmuls over M = H = 8, the combine's product (tests/numerics.py). The
    # drops are a count.
    assert_close(out, want_out, rtol=program_rtol(width=8, depth=4))
    chex.assert_trees_all_equal(dropped, want_dropped)
    assert busiest > 16 and float(dropped) > 0  # capped: the busiest expert overflows


def test_bad_input_is_named():
    p = params_for(0, 2, 4, 4, "relu")
    with pytest.raises(ValueError, match="activation must be one of"):
        expert_ffn(jnp.zeros((2, 3, 4)), p, activation="tanh")
    with pytest.raises(ValueError, match="w_gate must be given exactly when"):
        expert_ffn(jnp.zeros((2, 3, 4)), p, activation="swiglu")
    with pytest.raises(ValueError, match="weight must have expert_index's shape"):
        dropless_ffn(jnp.zeros((3, 4)), jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 1)), p, "relu")
    with pytest.raises(ValueError, match="w_in must be"):
        expert_ffn(jnp.zeros((2, 3, 4)), p._replace(w_out=p.w_out[:, :2]), activation="relu")


def test_init_expert_params_shapes():
    shapes = jax.eval_shape(lambda key: init_expert_params(
        key, 4, 8, 16, activation="swiglu", bias=True, dtype=jnp.bfloat16), jax.random.key(0))
    assert shapes.w_in.shape == shapes.w_gate.shape == (4, 8, 16)
    assert shapes.w_out.shape == (4, 16, 8) and shapes.w_out.dtype == jnp.bfloat16
    assert shapes.b_in.shape == (4, 16) and shapes.b_out.shape == (4, 8)
    plain = jax.eval_shape(lambda key: init_expert_params(key, 4, 8, 16), jax.random.key(0))
    assert plain.w_gate is None and plain.b_in is None
    assert experts.ACTIVATIONS == ("relu", "gelu", "swiglu")



def test_gelu_gradient_inside_shard_map():
    """The exact GELU's derivative is written out (`experts._gelu`): jax 0.12's derivative of
    `lax.erf` fails inside `shard_map`. Gradients equal autodiff of `jax.nn.gelu`."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    p = params_for(4, 2, 4, 8, "gelu", bias=True)
    x = f32(np.random.default_rng(4).normal(size=(2, 8 * 3, 4)) * 2)

    def local_loss(x, p):  # this device's slots, summed over devices
        return jax.lax.psum(jnp.sum(jnp.sin(expert_ffn(x, p, activation="gelu"))), "data")

    sharded = jax.shard_map(local_loss, mesh=mesh, in_specs=(P(None, "data"), P()),
                            out_specs=P())

    def plain(x, p):  # the same FFN, differentiated through jax.nn.gelu
        h = jax.nn.gelu(jnp.einsum("ecm,emh->ech", x, p.w_in) + p.b_in[:, None],
                        approximate=False)
        return jnp.sum(jnp.sin(jnp.einsum("ech,ehm->ecm", h, p.w_out) + p.b_out[:, None]))

    got = jax.jit(jax.grad(sharded, argnums=(0, 1)))(x, p)
    want = jax.grad(plain, argnums=(0, 1))(x, p)
    # Widest sums: the 24 slots an expert's weight gradient sums over (psum'd over devices);
    # forward chain of two matmuls with the activation between them (whose derivative is
    # another formula here, a few ulps apart); 3x with the backward (tests/numerics.py).
    assert_close(got, want, rtol=program_rtol(width=24, depth=3 * 3))
