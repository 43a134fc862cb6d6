"""The reference GPT as a Llama: grouped-query attention, rope_theta and Llama 3's rope
scaling, the norms' epsilon; and the engine training it on a mesh."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.errors import ConfigError
from jaxspeed.models import GPT, build_gpt
from jaxspeed.models.positions import Rotary
from numerics import assert_close, gpt_rtol

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=16,
            mlp="swiglu", tie_embeddings=False)
TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)
RTOL = gpt_rtol(tokens=32, d_model=32, d_ff=64, n_layers=2, vocab=64)


def init(model):
    return nn.unbox(jax.jit(model.init)(jax.random.key(1), TOKENS))


def test_gqa_equals_multi_head_attention_with_shared_key_value_heads():
    gqa = GPT(**TINY, n_kv_heads=2)
    params = init(gqa)
    assert params["params"]["layers"]["attn"]["key"].shape == (2, 32, 2, 8)
    mha_params = jax.tree.map(lambda x: x, params)
    attn = mha_params["params"]["layers"]["attn"]
    for name in ("key", "value"):  # query heads 2g and 2g+1 read key/value head g
        attn[name] = jnp.repeat(attn[name], 2, axis=2)
    want = GPT(**TINY).apply(mha_params, TOKENS)
    assert_close(gqa.apply(params, TOKENS), want, rtol=RTOL)


def test_rope_theta_and_llama3_scaling_set_the_frequencies():
    base = Rotary(10_000.0).frequencies(8)
    np.testing.assert_allclose(base, 10_000.0 ** (-np.arange(0, 8, 2) / 8), rtol=1e-6)
    assert (Rotary(500_000.0).frequencies(8)[1:] < base[1:]).all()
    scaled = Rotary(10_000.0, (8.0, 1.0, 4.0, 64)).frequencies(64)
    plain = Rotary(10_000.0).frequencies(64)
    wavelen = 2 * np.pi / plain
    np.testing.assert_array_equal(scaled[wavelen < 64 / 4], plain[wavelen < 64 / 4])
    np.testing.assert_allclose(scaled[wavelen > 64], plain[wavelen > 64] / 8, rtol=1e-6)
    between = (wavelen >= 16) & (wavelen <= 64)
    assert between.any() and ((scaled[between] <= plain[between])
                              & (scaled[between] >= plain[between] / 8)).all()
    theta = GPT(**TINY, rope_theta=500_000.0)
    assert not np.allclose(theta.apply(init(theta), TOKENS), GPT(**TINY).apply(init(theta), TOKENS))


def test_config_keys_reach_the_model():
    cfg = js.load_config(None, overrides=[
        "model.n_heads=8", "model.n_kv_heads=2", "model.rope_theta=500000",
        "model.rope_scaling.factor=8", "model.rms_norm_eps=1e-5"])
    model = build_gpt(cfg.model)
    assert (model.n_kv_heads, model.rope_theta, model.norm_eps) == (2, 500_000.0, 1e-5)
    assert model.rope_scaling == (8.0, 1.0, 4.0, 8192)
    eps = GPT(**TINY, norm_eps=0.5)
    assert not np.allclose(eps.apply(init(eps), TOKENS), GPT(**TINY).apply(init(eps), TOKENS))


@pytest.mark.parametrize("bad, match", [
    (["model.n_kv_heads=3"], "n_kv_heads"),
    (["model.rope_theta=0"], "rope_theta"),
    (["model.rope_scaling.rope_type=yarn"], "rope_scaling.rope_type"),
])
def test_bad_llama_keys_are_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        js.load_config(None, overrides=bad)


def test_gqa_on_tensor_and_sequence_trains_like_one_mesh_axis():
    base = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
            "model.d_ff=128", "model.max_seq_len=32", "data.seq_len=32",
            "data.max_bytes=300000", "train_batch_size=8", "model.mlp=swiglu",
            "model.tie_embeddings=false"]
    losses = {}
    for name, mesh in (("data8", ["mesh.data=8"]),
                       ("tp2_seq2_zero3", ["mesh.data=2", "mesh.tensor=2", "mesh.sequence=2",
                                           "zero_optimization.stage=3"])):
        cfg = js.load_config(None, overrides=[*base, *mesh])
        engine = js.initialize(cfg)
        data = js.data.TokenDataset.from_config(cfg.data, seed=0)
        state = engine.init(jax.random.key(0))
        losses[name] = []
        for step in range(3):
            state, metrics = engine.train_step(state, data.batch(step, global_batch=8))
            losses[name].append(float(metrics["loss"]))
    rtol = gpt_rtol(tokens=8 * 32, d_model=64, d_ff=128, n_layers=2, vocab=256)
    np.testing.assert_allclose(losses["tp2_seq2_zero3"], losses["data8"], rtol=rtol)
