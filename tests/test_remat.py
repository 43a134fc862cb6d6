"""Activation checkpointing: every policy trains to the same loss; `full` saves memory."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxspeed as js
from jaxspeed.errors import ConfigError
from jaxspeed.ops.losses import lm_loss
from jaxspeed.models import GPT
from jaxspeed.ops.remat import POLICIES
from numerics import gpt_rtol

TINY = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=2, d_ff=64, max_seq_len=32)
NAMES = ("qkv", "mlp_hidden")
#: A policy recomputes (or saves) other values, so the step is another program: its losses
#: agree with no remat's to two orders of TINY's step on 4 x 32 tokens (tests/numerics.py).
RHO = gpt_rtol(tokens=4 * 32, d_model=32, d_ff=64, n_layers=4, vocab=64)


def _model(policy):
    return GPT(**TINY, remat_policy=policy, remat_names=NAMES if policy == "names" else ())


def _batch(seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (4, 32), 0, TINY["vocab_size"])
    return {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1)}


def _step_fn(model, tx):
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(model.apply(p, batch["inputs"]), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@functools.cache
def _train(policy, steps=3):
    model, tx = _model(policy), optax.adam(1e-2)
    params = nn.unbox(model.init(jax.random.key(0), _batch()["inputs"]))
    opt_state = tx.init(params)
    step = jax.jit(_step_fn(model, tx))
    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, _batch(i))
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "none"])
def test_every_policy_trains_to_the_same_loss(policy):
    np.testing.assert_allclose(_train(policy), _train("none"), rtol=RHO)


def _temp_bytes(policy):
    model, tx = _model(policy), optax.adam(1e-2)
    batch = _batch()
    params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), batch["inputs"])))
    opt_state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(_step_fn(model, tx)).lower(params, opt_state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_full_remat_needs_less_temp_memory_than_none():
    assert _temp_bytes("full") < _temp_bytes("none")


def _grad_jaxpr(policy):
    model = _model(policy)
    batch = _batch()
    params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), batch["inputs"])))
    loss = lambda p: lm_loss(model.apply(p, batch["inputs"]), batch)  # noqa: E731
    return str(jax.make_jaxpr(jax.grad(loss))(params))


def test_offload_dots_moves_saved_activations_to_host():
    # XLA on CPU elides host<->device copies, so the jaxpr is where the offload shows.
    assert "Space.Host" in _grad_jaxpr("offload_dots")
    assert "Space.Host" not in _grad_jaxpr("dots_with_no_batch_dims_saveable")


def _engine_jaxpr(*overrides):
    base = [
        "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.max_seq_len=16", "data.seq_len=16", "train_batch_size=8", "mesh.data=8",
    ]
    engine = js.initialize(js.load_config(None, overrides=[*base, *overrides]))
    return str(jax.make_jaxpr(engine._train[None])(engine.abstract_state(), engine.abstract_batch()))


def test_engine_applies_the_configured_policy():
    assert "remat2" not in _engine_jaxpr()
    policy = ["activation_checkpointing.policy=names", "activation_checkpointing.names=[qkv, attn_out]"]
    assert "remat2" in _engine_jaxpr(*policy)


@pytest.mark.parametrize(
    ("names", "match"), [(("qkv", "logits"), "logits"), ((), "at least one")]
)
def test_unknown_checkpoint_names_are_clear_errors(names, match):
    model = GPT(**TINY, remat_policy="names", remat_names=names)
    with pytest.raises(ConfigError, match=match):
        model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
