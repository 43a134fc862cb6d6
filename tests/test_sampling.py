"""Sampling: greedy decoding with the key/value cache equals argmax decoding without it, token
for token; nucleus sampling; the engine's plan; bad requests."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.errors import ConfigError
from jaxspeed.models import GPT
from jaxspeed.models.sampling import Codec, choose, generate, sample_from_engine, sample_text

PROMPT_LEN, NEW = 5, 11


@pytest.mark.parametrize("arch", [
    dict(positions="rotary", n_kv_heads=2, mlp="swiglu", tie_embeddings=False),
    dict(positions="learned"),
    dict(positions="rotary", sliding_window=3),  # the window is shorter than what is decoded
], ids=["llama", "learned", "mistral"])
def test_greedy_with_cache_equals_argmax_without(arch):
    model = GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=16,
                **arch)
    prompt = np.random.default_rng(0).integers(0, 64, (2, PROMPT_LEN), np.int32)
    params = jax.jit(lambda key: nn.unbox(model.init(key, prompt))["params"])(jax.random.key(1))
    got = jax.jit(lambda p, x: generate(model, p, x, max_new_tokens=NEW, temperature=0))(
        params, prompt)
    logits_of = jax.jit(lambda p, x: model.apply({"params": p}, x))
    want = np.zeros((2, PROMPT_LEN + NEW), np.int32)
    want[:, :PROMPT_LEN] = prompt
    for t in range(PROMPT_LEN, PROMPT_LEN + NEW):
        # the whole prefix again at every step; the positions after it, still 0, are causally
        # masked, so one length (one program) serves every step
        want[:, t] = np.argmax(logits_of(params, want)[:, t - 1], -1)
    np.testing.assert_array_equal(got, want)


def test_top_p_keeps_the_most_likely_tokens_only():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 400)
    drawn = jax.jit(jax.vmap(lambda k: choose(logits, k, temperature=1.0, top_p=0.7)))(keys)
    assert set(np.unique(drawn).tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.7; 0.15 never drawn
    greedy = choose(logits, keys[0], temperature=0, top_p=0.1)
    assert int(greedy[0]) == 0


def test_engine_samples_with_its_plan_and_the_byte_codec():
    cfg = js.load_config(None, overrides=[
        "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.d_ff=64",
        "model.max_seq_len=32", "data.seq_len=32", "mesh.data=4", "mesh.tensor=2",
        "zero_optimization.stage=3", "train_batch_size=8"])
    engine = js.initialize(cfg)
    state = engine.init(jax.random.key(0))
    text = sample_text(engine, state.params, "def ", Codec(), max_new_tokens=8,
                       temperature=0.8, top_p=0.9, key=jax.random.key(1))
    assert isinstance(text, str) and len(text.encode("utf-8", errors="replace")) > 0
    params = jax.device_get(state.params)
    greedy = sample_from_engine(engine, state.params, [[100, 101, 102]], max_new_tokens=6,
                                temperature=0)
    plain = jax.jit(lambda p, x: generate(engine.model, p, x, max_new_tokens=6, temperature=0))(
        params, np.array([[100, 101, 102]], np.int32))  # jitted: eagerly each op compiles
    np.testing.assert_array_equal(greedy, plain)


@pytest.mark.parametrize("options, match", [
    (dict(max_new_tokens=30), "max_seq_len"),
    (dict(max_new_tokens=0), "max-new-tokens"),
    (dict(max_new_tokens=2, top_p=0.0), "top-p"),
])
def test_bad_requests_are_config_errors(options, match):
    model = GPT(vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=64, max_seq_len=16)
    prompt = np.zeros((1, 4), np.int32)
    # the request is checked before the params are read: their shapes will do
    params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(1), prompt))["params"])
    with pytest.raises(ConfigError, match=match):
        generate(model, params, prompt, key=jax.random.key(0), **options)


def test_cli_samples_a_train_checkpoint(tmp_path, capsys):
    from jaxspeed.cli import main

    cfg = js.load_config(None, overrides=[
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
        "model.max_seq_len=16", "data.seq_len=16", "mesh.data=8", "train_batch_size=8"])
    engine = js.initialize(cfg)
    engine.save(engine.init(jax.random.key(0)), directory=tmp_path)
    engine.checkpointer(tmp_path).wait()
    args = ["sample", str(tmp_path), "--prompt", "def", "--max-new-tokens", "5"]
    assert main([*args, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("def") and main([*args, "--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy  # greedy decoding is deterministic
    assert main([*args[:-1], "20"]) == 2  # 3 + 20 tokens > max_seq_len 16
    assert "max_seq_len" in capsys.readouterr().err


def test_train_prints_a_sample_every_n_steps(tmp_path, capsys):
    from jaxspeed.train.loop import train

    cfg = js.load_config(None, overrides=[
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
        "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=100000", "mesh.data=8",
        "train_batch_size=8", "steps=4", "logging.sample_every_n_steps=2",
        "logging.sample_tokens=6"])
    train(cfg, output_dir=tmp_path, progress=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sample")]
    assert [line.split(":")[0] for line in lines] == ["sample @ step 2", "sample @ step 4"]
    assert all(line.split(": ", 1)[1].startswith("'def ") for line in lines)


def test_cli_samples_an_imported_checkpoint(tmp_path, capsys):
    from pathlib import Path

    from jaxspeed.cli import main

    fixture = Path(__file__).parent / "fixtures" / "llama" / "gqa"
    assert main(["import-hf", str(fixture), "--out", str(tmp_path / "imported")]) == 0
    capsys.readouterr()
    args = ["sample", str(tmp_path / "imported"), "--temperature", "0", "--max-new-tokens", "4"]
    assert main([*args, "--prompt", "0("]) == 0  # bytes below the fixture's vocabulary of 64
    assert capsys.readouterr().out.startswith("0(")
    assert main([*args, "--prompt", "ab"]) == 2
    assert "outside model.vocab_size=64" in capsys.readouterr().err
