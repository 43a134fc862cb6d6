"""Packed sequences: `segment_ids` and `positions` keep each document's attention and
positions its own, in every dense attention path and through the engine."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.errors import ConfigError
from jaxspeed.ops.losses import lm_loss
from jaxspeed.models import GPT
from numerics import assert_close, gpt_rtol

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
LENGTHS = (7, 12, 13)  # one row of 32 tokens, three documents
RTOL = gpt_rtol(tokens=32, d_model=32, d_ff=64, n_layers=2, vocab=64)


def packed_row():
    """The documents, and their packed row: tokens, segment_ids and positions `[1, 32]`
    (numpy: nothing to compile)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 64, (n,), np.int32) for n in LENGTHS]
    tokens = np.concatenate(docs)[None]
    segment_ids = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(LENGTHS)])[None]
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in LENGTHS])[None]
    return docs, tokens, segment_ids, positions


@functools.cache
def initial_params(positions):
    """The tiny GPT's params (the attention implementation has none of its own)."""
    model = GPT(**TINY, positions=positions)
    return nn.unbox(jax.jit(model.init)(jax.random.key(0), packed_row()[1]))


@pytest.mark.parametrize(
    "impl, positions",
    # Positions are applied before the attention implementation is chosen (learned: in the
    # embedding; rotary: to q and k), and only segment_ids reach it: each implementation once,
    # and each kind of positions once.
    [("reference", "learned"), ("blocked", "rotary"), ("fused", "rotary")],
)
def test_packed_row_equals_each_document_alone(impl, positions):
    """Logits and gradients of the packed row equal those of each document alone, and without
    the segments the documents would see each other (one program computes all three)."""
    model = GPT(**TINY, positions=positions, attention_impl=impl, attention_block_q=8,
                attention_block_kv=8)
    docs, tokens, segment_ids, pos = packed_row()

    def packed(params):
        return model.apply(params, tokens, segment_ids=segment_ids, positions=pos)

    def alone(params):
        return jnp.concatenate([model.apply(params, d[None]) for d in docs], axis=1)

    def logits_and_grads(f, params):
        def loss(p):
            y = f(p)
            return jnp.sum(y ** 2), y

        (_, y), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return y, grads

    @jax.jit
    def run(params):
        return (logits_and_grads(packed, params), logits_and_grads(alone, params),
                model.apply(params, tokens))

    (got, got_grads), (want, want_grads), unsegmented = run(initial_params(positions))
    assert_close(got, want, rtol=RTOL)
    assert_close(got_grads, want_grads, rtol=RTOL)
    # without the segments the documents would see each other
    assert not np.allclose(unsegmented, want, atol=1e-3)


def test_engine_passes_the_batch_token_features_to_the_model():
    cfg = js.load_config(None, overrides=[
        "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.d_ff=64",
        "model.vocab_size=64", "model.max_seq_len=32", "data.seq_len=32", "mesh.data=8",
        "train_batch_size=8"])
    engine = js.initialize(cfg)
    # the packing test's params: the engine's GPT is TINY with rotary positions
    state = engine.init(jax.random.key(0), params=initial_params("rotary")["params"])
    _, tokens, segment_ids, positions = packed_row()
    rows = lambda x: np.repeat(np.asarray(x, np.int32), 8, axis=0)  # noqa: E731
    batch = {"inputs": rows(tokens), "targets": rows(np.roll(tokens, -1, axis=1)),
             "segment_ids": rows(segment_ids), "positions": rows(positions)}
    got = float(engine.eval_step(state, batch)["loss"])
    params = jax.device_get(state.params)
    model = GPT(**TINY)

    @jax.jit
    def loss(params):
        logits = model.apply({"params": params}, batch["inputs"],
                             segment_ids=batch["segment_ids"], positions=batch["positions"])
        return lm_loss(logits, batch)

    np.testing.assert_allclose(got, float(loss(params)), rtol=RTOL)
    plain = float(engine.eval_step(state, {"inputs": batch["inputs"],
                                           "targets": batch["targets"]})["loss"])
    assert abs(plain - got) > 1e-4


def test_packing_with_a_sequence_split_or_sparse_attention_is_refused():
    """Both are refused while the model is traced, before anything runs."""
    _, tokens, segment_ids, positions = packed_row()
    sparse = GPT(**TINY, sparse_attention=js.attention.FixedSparsityConfig(
        num_heads=4, block=8, num_local_blocks=2))
    params = jax.eval_shape(lambda: nn.unbox(sparse.init(jax.random.key(0), tokens)))
    with pytest.raises(ConfigError, match="sparse_attention with packed"):
        jax.eval_shape(lambda p: sparse.apply(p, tokens, segment_ids=segment_ids,
                                              positions=positions), params)
    cfg = js.load_config(None, overrides=[
        "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.d_ff=64",
        "model.vocab_size=64", "model.max_seq_len=32", "data.seq_len=32", "mesh.data=4",
        "mesh.sequence=2", "train_batch_size=4"])
    engine = js.initialize(cfg)
    rows = lambda x: np.repeat(np.asarray(x, np.int32), 4, axis=0)  # noqa: E731
    batch = {"inputs": rows(tokens), "targets": rows(tokens), "segment_ids": rows(segment_ids),
             "positions": rows(positions)}
    # any params: the step is refused while it is traced (zeros: no init program to compile)
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), engine.abstract_state().params)
    with pytest.raises(ConfigError, match="mesh.sequence > 1"):
        engine.eval_step(engine.init(jax.random.key(0), params=zeros), batch)
