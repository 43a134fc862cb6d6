"""Packed sequences: `segment_ids` and `positions` keep each document's attention and
positions its own, in every dense attention path and through the engine."""

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
    docs = [jax.random.randint(jax.random.key(i), (n,), 0, 64) for i, n in enumerate(LENGTHS)]
    tokens = jnp.concatenate(docs)[None]
    segment_ids = jnp.concatenate([jnp.full((n,), i + 1) for i, n in enumerate(LENGTHS)])[None]
    positions = jnp.concatenate([jnp.arange(n) for n in LENGTHS])[None]
    return docs, tokens, segment_ids, positions


@pytest.mark.parametrize("positions", ["rotary", "learned"])
@pytest.mark.parametrize("impl", ["reference", "blocked", "fused"])
def test_packed_row_equals_each_document_alone(impl, positions):
    model = GPT(**TINY, positions=positions, attention_impl=impl, attention_block_q=8,
                attention_block_kv=8)
    docs, tokens, segment_ids, pos = packed_row()
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens))

    @jax.jit
    def packed(params):
        return model.apply(params, tokens, segment_ids=segment_ids, positions=pos)

    @jax.jit
    def alone(params):
        return jnp.concatenate([model.apply(params, d[None]) for d in docs], axis=1)

    assert_close(packed(params), alone(params), rtol=RTOL)
    grads = [jax.jit(jax.grad(lambda p, f=f: jnp.sum(f(p) ** 2)))(params) for f in (packed, alone)]
    assert_close(grads[0], grads[1], rtol=RTOL)
    # without the segments the documents would see each other
    assert not np.allclose(jax.jit(model.apply)(params, tokens), alone(params), atol=1e-3)


def test_engine_passes_the_batch_token_features_to_the_model():
    cfg = js.load_config(None, overrides=[
        "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.d_ff=64",
        "model.vocab_size=64", "model.max_seq_len=32", "data.seq_len=32", "mesh.data=8",
        "train_batch_size=8"])
    engine = js.initialize(cfg)
    state = engine.init(jax.random.key(0))
    _, tokens, segment_ids, positions = packed_row()
    rows = lambda x: np.repeat(np.asarray(x, np.int32), 8, axis=0)  # noqa: E731
    batch = {"inputs": rows(tokens), "targets": rows(jnp.roll(tokens, -1, axis=1)),
             "segment_ids": rows(segment_ids), "positions": rows(positions)}
    got = float(engine.eval_step(state, batch)["loss"])
    params = jax.device_get(state.params)
    model = GPT(**{k: v for k, v in TINY.items()})
    logits = model.apply({"params": params}, batch["inputs"], segment_ids=batch["segment_ids"],
                         positions=batch["positions"])
    np.testing.assert_allclose(got, float(lm_loss(logits, batch)), rtol=RTOL)
    plain = float(engine.eval_step(state, {"inputs": batch["inputs"],
                                           "targets": batch["targets"]})["loss"])
    assert abs(plain - got) > 1e-4


def test_packing_with_a_sequence_split_or_sparse_attention_is_refused():
    _, tokens, segment_ids, positions = packed_row()
    sparse = GPT(**TINY, sparse_attention=js.attention.FixedSparsityConfig(
        num_heads=4, block=8, num_local_blocks=2))
    params = nn.unbox(sparse.init(jax.random.key(0), tokens))
    with pytest.raises(ConfigError, match="sparse_attention with packed"):
        sparse.apply(params, tokens, segment_ids=segment_ids, positions=positions)
    cfg = js.load_config(None, overrides=[
        "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.d_ff=64",
        "model.vocab_size=64", "model.max_seq_len=32", "data.seq_len=32", "mesh.data=4",
        "mesh.sequence=2", "train_batch_size=4"])
    engine = js.initialize(cfg)
    rows = lambda x: np.repeat(np.asarray(x, np.int32), 4, axis=0)  # noqa: E731
    batch = {"inputs": rows(tokens), "targets": rows(tokens), "segment_ids": rows(segment_ids),
             "positions": rows(positions)}
    with pytest.raises(ConfigError, match="mesh.sequence > 1"):
        engine.eval_step(engine.init(jax.random.key(0)), batch)
