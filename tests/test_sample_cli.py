"""`jaxspeed sample`: the run's tokenizer, the run's folder, only the params in their stored dtype
(no training engine), a key/value cache sized for the request, and a block-sparse model decoding
with its own layout."""

import re
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.attention import FixedSparsityConfig
from jaxspeed.cli import main
from jaxspeed.models import GPT
from jaxspeed.models.sampling import generate

GQA = Path(__file__).resolve().parent / "fixtures" / "llama" / "gqa"
VOCAB = 300  # past the 256 values of the byte codec
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
        "model.max_seq_len=16", "model.tie_embeddings=false", f"model.vocab_size={VOCAB}",
        "data.seq_len=16", "train_batch_size=8"]


def _word_tokenizer(path: Path, word: str) -> Path:
    """A tokenizer.json of `VOCAB` words `{word}0`, `{word}1`, ... split at spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"{word}{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=f"{word}0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def _checkpoint(directory: Path, *overrides: str) -> None:
    """A train checkpoint whose model always picks the last token (`VOCAB - 1`): every token
    embeds to ones, the layers add nothing, and the head reads only that token's column."""
    cfg = js.load_config(None, overrides=[*TINY, *overrides])
    engine = js.initialize(cfg, mesh=js.make_mesh(cfg.mesh, devices=jax.devices()[:1]))
    state = engine.init(jax.random.key(0))
    params = jax.device_get(state.params)
    params = jax.tree.map(np.zeros_like, params)
    params["embedding"] = np.ones_like(params["embedding"])
    params["final_norm"]["scale"] = np.ones_like(params["final_norm"]["scale"])
    params["head"][:, VOCAB - 1] = 1.0
    engine.save(state.replace(params=params), directory=directory)
    engine.checkpointer(directory).wait()


def test_sample_decodes_with_the_runs_tokenizer_unless_one_is_given(tmp_path, capsys):
    words = _word_tokenizer(tmp_path / "words", "w")
    text = tmp_path / "text.txt"
    text.write_text("w1 w2 w3\n")
    _checkpoint(tmp_path / "run" / "checkpoints", "data.source=text", f"data.files={text}",
                f"data.tokenizer={words}")
    args = ["sample", str(tmp_path / "run" / "checkpoints"), "--prompt", "w1 w2",
            "--temperature", "0", "--max-new-tokens", "3"]
    assert main(args) == 0
    assert capsys.readouterr().out == "w1 w2w299 w299 w299\n"
    other = _word_tokenizer(tmp_path / "other", "x")  # an explicit --tokenizer wins
    assert main([*args[:2], "--prompt", "x1", *args[4:], "--tokenizer", str(other)]) == 0
    assert capsys.readouterr().out == "x1x299 x299 x299\n"


def test_sample_refuses_tokens_bytes_cannot_decode(tmp_path, capsys):
    _checkpoint(tmp_path / "ckpt")  # byte data: no tokenizer saved
    assert main(["sample", str(tmp_path / "ckpt"), "--prompt", "ab", "--temperature", "0",
                 "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxspeed sample: error:") and err.count("\n") == 1, err
    assert "token 299" in err and "--tokenizer" in err


def test_sample_and_export_take_the_runs_folder(tmp_path, capsys):
    _checkpoint(tmp_path / "run" / "checkpoints")
    assert main(["sample", str(tmp_path / "run"), "--prompt", "a", "--temperature", "0",
                 "--max-new-tokens", "1", "--tokenizer", str(_word_tokenizer(tmp_path / "w", "w"))]) == 0
    assert capsys.readouterr().out == "aw299\n"
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "p.msgpack")]) == 0
    assert (tmp_path / "p.msgpack").stat().st_size > 0


def test_sample_reads_the_stored_params_and_builds_no_engine(tmp_path, capsys, monkeypatch):
    import jaxspeed.models.sampling as sampling
    import jaxspeed.train.engine as engine

    assert main(["import-hf", str(GQA), "--out", str(tmp_path / "ckpt"), "--dtype", "bfloat16"]) == 0
    _checkpoint(tmp_path / "trained")

    def no_engine(*args, **kwargs):
        raise AssertionError("sampling built a training engine")

    # checkpoint.export imports it from train.engine when it builds one (load_trained)
    monkeypatch.setattr(engine, "initialize", no_engine)
    seen = []
    original = sampling.sample_tokens

    def spy(model, params, prompt, **options):
        seen.append(params["embedding"].dtype)
        return original(model, params, prompt, **options)

    monkeypatch.setattr(sampling, "sample_tokens", spy)
    args = ["--temperature", "0", "--max-new-tokens", "2"]
    assert main(["sample", str(tmp_path / "ckpt"), "--prompt", "0(", *args]) == 0
    assert main(["sample", str(tmp_path / "trained"), "--prompt", "0(", *args,
                 "--tokenizer", str(_word_tokenizer(tmp_path / "w", "w"))]) == 0
    assert [str(d) for d in seen] == ["bfloat16", "float32"]


def test_cache_holds_the_prompt_and_new_tokens_only():
    model = GPT(vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=64, max_seq_len=4099)
    prompt = jnp.zeros((1, 3), jnp.int32)
    params = nn.unbox(model.init(jax.random.key(0), prompt))["params"]
    program = str(jax.make_jaxpr(
        lambda p, x: generate(model, p, x, max_new_tokens=5, temperature=0))(params, prompt))
    assert "4099" not in program  # no array of max_seq_len positions
    assert ",8,4,8]" in program  # the cache: [layers, batch, 3 + 5, kv heads, head_dim]


def test_a_block_sparse_model_decodes_with_its_layout():
    """Greedy decoding equals the argmax of the sparse model run over the whole result (and
    not of the dense one, so the layout matters here)."""
    layout = FixedSparsityConfig(4, block=4, num_local_blocks=2, attention="unidirectional")
    kwargs = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
    sparse = GPT(**kwargs, sparse_attention=layout, sparse_impl="xla")
    prompt = jax.random.randint(jax.random.key(0), (2, 5), 0, 64)
    params = nn.unbox(sparse.init(jax.random.key(1), jnp.zeros((1, 16), jnp.int32)))["params"]
    params = jax.tree_util.tree_map_with_path(  # loud attention, so that the layout shows
        lambda path, p: p * 30 if "attn" in jax.tree_util.keystr(path) else p, params)
    got = generate(sparse, params, prompt, max_new_tokens=11, temperature=0)
    want = jnp.argmax(sparse.apply({"params": params}, got), -1)[:, 4:-1]  # 16 tokens: 4 blocks
    np.testing.assert_array_equal(got[:, 5:], want)
    dense = jnp.argmax(GPT(**kwargs).apply({"params": params}, got), -1)[:, 4:-1]
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(got[:, 5:], dense)


def test_sample_of_an_import_uses_its_folders_tokenizer(tmp_path, capsys):
    folder = tmp_path / "llama"
    shutil.copytree(GQA, folder)
    _word_tokenizer(folder, "w")
    assert main(["import-hf", str(folder), "--out", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "ckpt"), "--prompt", "w1 w2", "--temperature", "0",
                 "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"w1 w2w\d+ w\d+ w\d+\n", out), out
