"""Mistral (sliding window) and Qwen2 (q/k/v biases) checkpoints in and out, against
transformers' own MistralForCausalLM and Qwen2ForCausalLM; the window and the biases in the
reference GPT.

The oracle's logits were computed by transformers (PyTorch, fp32, eager attention) when the
fixtures were generated (tests/fixtures/hf_families/generate.py).
"""

import json
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.checkpoint.hf import export_hf, import_hf
from jaxspeed.checkpoint.hf.config import model_from_hf
from jaxspeed.checkpoint.params import read_record, restore_params, save_params, saved_shapes
from jaxspeed.data import TokenDataset
from jaxspeed.errors import ConfigError
from jaxspeed.models import GPT, build_gpt
from jaxspeed.models.dense_attention import attend, causal_attention
from numerics import assert_close, gpt_rtol, program_rtol
from test_hf import _cli_error, _tensors, forward_rtol, logits_of, model_config

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf_families"
CASES = ["mistral", "qwen2", "qwen2_window"]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case):
    ckpt = import_hf(FIXTURES / case, tmp_path / "ckpt")
    tokens, want = (np.load(FIXTURES / case / f"{name}.npy") for name in ("tokens", "logits"))
    rtol = forward_rtol(read_record(ckpt)["model"], tokens.shape[1])
    assert_close(logits_of(ckpt, tokens), want, rtol=rtol)


@pytest.mark.parametrize("case", ["mistral", "qwen2_window"])
def test_the_window_matters(tmp_path, case):
    """Without its window the model misses the oracle: the fixture's window is shorter than
    its tokens."""
    ckpt = import_hf(FIXTURES / case, tmp_path / "ckpt")
    record = read_record(ckpt)
    record["model"]["sliding_window"] = None
    params = restore_params(ckpt, saved_shapes(ckpt))
    tokens, want = (np.load(FIXTURES / case / f"{name}.npy") for name in ("tokens", "logits"))
    model = build_gpt(model_config(record).model)
    got = np.asarray(model.apply({"params": params}, jnp.asarray(tokens)))
    rtol = forward_rtol(record["model"], tokens.shape[1])
    assert_close(got[:, :4], want[:, :4], rtol=rtol)  # the first tokens' windows hold every key
    assert np.abs(got - want).max() > 100 * rtol * np.abs(want).max()


def test_config_mapping(tmp_path):
    keys = ("attention_bias", "sliding_window", "tie_embeddings", "n_kv_heads", "rope_theta")
    models = {case: read_record(import_hf(FIXTURES / case, tmp_path / case))["model"]
              for case in CASES}
    got = {case: {k: model[k] for k in keys} for case, model in models.items()}
    assert got == {
        "mistral": dict(attention_bias=False, sliding_window=5, tie_embeddings=False,
                        n_kv_heads=2, rope_theta=20_000.0),
        "qwen2": dict(attention_bias=True, sliding_window=None, tie_embeddings=True,
                      n_kv_heads=2, rope_theta=10_000.0),
        "qwen2_window": dict(attention_bias=True, sliding_window=4, tie_embeddings=False,
                             n_kv_heads=2, rope_theta=10_000.0),
    }
    shapes = saved_shapes(tmp_path / "qwen2")["layers"]["attn"]
    assert (shapes["query_bias"].shape, shapes["key_bias"].shape) == ((2, 4, 4), (2, 2, 4))


def test_qwen2_window_on_some_layers_only_is_refused():
    config = json.loads((FIXTURES / "qwen2_window" / "config.json").read_text())
    config["layer_types"] = ["full_attention", "sliding_attention"]
    with pytest.raises(js.checkpoint.CheckpointError, match="layer_types mixes"):
        model_from_hf(config)
    config.pop("layer_types")  # then max_window_layers says which layers
    config["max_window_layers"] = 1
    with pytest.raises(js.checkpoint.CheckpointError, match="layer_types mixes"):
        model_from_hf(config)
    config["use_sliding_window"] = False  # Qwen2Config then drops the window
    assert model_from_hf(config)["sliding_window"] is None


def test_other_model_types_are_refused_naming_the_supported_ones(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    shutil.copytree(FIXTURES / "mistral", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    err = _cli_error(capsys, ["import-hf", str(folder), "--out", str(tmp_path / "out")])
    assert "model_type='gpt2'" in err and "'llama' or 'mistral' or 'qwen2'" in err


@pytest.mark.parametrize("case", CASES)
def test_import_export_round_trip_is_byte_identical(tmp_path, case):
    out = export_hf(import_hf(FIXTURES / case, tmp_path / "ckpt"), tmp_path / "hf")
    assert _tensors(out) == _tensors(FIXTURES / case)
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(p.name for p in (FIXTURES / case).iterdir() if p.suffix != ".npy")
    for name in written:
        assert (out / name).read_bytes() == (FIXTURES / case / name).read_bytes(), name


@pytest.mark.parametrize("case, family", [
    ("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
    ("qwen2_window", "Qwen2ForCausalLM")])
def test_export_without_an_import_record_writes_the_family(tmp_path, case, family):
    """A checkpoint with no HF config to follow (as `train` writes) exports the model type
    its keys need, and reads back as the same model and params."""
    source = import_hf(FIXTURES / case, tmp_path / "ckpt")
    model = read_record(source)["model"]
    params = restore_params(source, saved_shapes(source))
    save_params(tmp_path / "plain", params, model=model)
    out = export_hf(tmp_path / "plain", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [family] and config["model_type"] in family.lower()
    assert model_from_hf(config) == model
    back = import_hf(out, tmp_path / "back")
    jax.tree.map(np.testing.assert_array_equal, restore_params(back, saved_shapes(back)), params)


TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
            max_seq_len=16, mlp="swiglu", tie_embeddings=False)
TOKENS = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)


def _init(model):
    return nn.unbox(jax.jit(model.init)(jax.random.key(1), TOKENS))


@pytest.mark.parametrize("impl", ["reference", "fused", "auto"])
def test_a_window_as_long_as_the_sequence_is_full_causal_attention(impl):
    full = GPT(**TINY, attention_impl=impl)
    params = _init(full)
    want = full.apply(params, TOKENS)
    for window in (16, 40):
        np.testing.assert_array_equal(
            GPT(**TINY, attention_impl=impl, sliding_window=window).apply(params, TOKENS), want)
    assert not np.allclose(GPT(**TINY, attention_impl=impl, sliding_window=3).apply(params, TOKENS),
                           want)


def test_window_keeps_the_last_w_keys_in_every_impl():
    """Query i sees keys i-w+1..i (transformers' Mistral mask), packed segments too."""
    q, k, v = jax.random.normal(jax.random.key(2), (3, 2, 12, 4, 8))
    w = 3
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
    i, j = np.arange(12)[:, None], np.arange(12)[None, :]
    segments = jnp.asarray([[0] * 5 + [1] * 7, [0] * 12])
    keep = (j <= i) & (j > i - w) & (segments[:, None, :, None] == segments[:, None, None, :])
    want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(keep, scores, -1e30)), v)
    rtol = program_rtol(width=12, depth=3)
    for impl in ("reference", "fused"):
        got = attend(q, k, v, impl=impl, block_q=4, block_kv=4, segment_ids=segments, window=w)
        assert_close(got, want, rtol=rtol)
    assert_close(  # the decode cache's form: queries after earlier keys
        causal_attention(q[:, 8:], k, v, q_positions=jnp.arange(8, 12), window=w),
        attend(q, k, v, impl="reference", block_q=4, block_kv=4, window=w)[:, 8:], rtol=rtol)


def test_zero_biases_are_the_unbiased_model():
    biased = GPT(**TINY, attention_bias=True)
    params = _init(biased)
    attn = params["params"]["layers"]["attn"]
    assert {attn[f"{n}_bias"].shape for n in ("query", "key", "value")} == {(2, 4, 8), (2, 2, 8)}
    plain = {"params": {**params["params"], "layers": {**params["params"]["layers"], "attn": {
        k: v for k, v in attn.items() if not k.endswith("_bias")}}}}
    np.testing.assert_array_equal(biased.apply(params, TOKENS), GPT(**TINY).apply(plain, TOKENS))
    attn["key_bias"] = attn["key_bias"] + 1.0
    assert not np.allclose(biased.apply(params, TOKENS), GPT(**TINY).apply(plain, TOKENS))


@pytest.mark.parametrize("overrides, what", [
    (["model.attention.impl=blocked"], "attention.impl: blocked"),
    (["model.sequence_parallel.impl=ring"], "sequence_parallel.impl: ring"),
    (["model.sparse_attention={mode: fixed, block: 8}"], "sparse_attention"),
])
def test_window_with_an_attention_that_has_none_is_refused(overrides, what):
    with pytest.raises(ConfigError, match=f"sliding_window=4 cannot run with {what}"):
        js.load_config(None, overrides=["model.sliding_window=4", *overrides])
    with pytest.raises(ConfigError, match="blocked"):
        q = jnp.zeros((1, 8, 2, 4))
        attend(q, q, q, impl="blocked", block_q=4, block_kv=4, window=4)


def test_ulysses_carries_the_window():
    base = ["model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
            "model.d_ff=64", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
            "train_batch_size=8", "model.sliding_window=5", "model.attention.impl=reference"]
    losses = {}
    for name, mesh in (("data8", ["mesh.data=8"]), ("seq4", ["mesh.sequence=4", "mesh.data=2"])):
        cfg = js.load_config(None, overrides=[*base, *mesh])
        engine = js.initialize(cfg)
        batch = TokenDataset.from_config(cfg.data, seed=0).batch(0, global_batch=8)
        _, metrics = engine.train_step(engine.init(jax.random.key(0)), batch)
        losses[name] = float(metrics["loss"])
    rtol = gpt_rtol(tokens=8 * 32, d_model=32, d_ff=64, n_layers=2, vocab=256)
    np.testing.assert_allclose(losses["seq4"], losses["data8"], rtol=rtol)
