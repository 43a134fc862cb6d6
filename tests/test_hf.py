"""Hugging Face Llama checkpoints in and out, against transformers' own LlamaForCausalLM.

The oracle's logits were computed by transformers (PyTorch, fp32, eager attention) when the
fixtures were generated (tests/fixtures/llama/generate.py); where transformers is importable,
`test_live_transformers_loads_the_export` also runs it on an export.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

import jaxspeed as js
from jaxspeed.checkpoint import CheckpointError
from jaxspeed.cli import main
from jaxspeed.checkpoint.hf import export_hf, import_hf
from jaxspeed.models import build_gpt
from jaxspeed.checkpoint.params import read_record, restore_params, save_params, saved_shapes, start_from
from jaxspeed.train.loop import train
from numerics import assert_close, gpt_rtol, program_rtol

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llama"
CASES = ["gqa", "llama3_sharded", "tf4_config"]


def fixture_folder(case: str, tmp_path: Path) -> Path:
    """The case's HF folder; tf4_config is gqa's weights under its own config.json."""
    if case != "tf4_config":
        return FIXTURES / case
    folder = tmp_path / case
    shutil.copytree(FIXTURES / "gqa", folder)
    shutil.copy(FIXTURES / case / "config.json", folder / "config.json")
    return folder


def model_config(record: dict, *overrides: str):
    return js.load_config({"model": record["model"], "data": {"seq_len": 16}}, overrides=list(overrides))


def logits_of(checkpoint: Path, tokens: np.ndarray) -> np.ndarray:
    record = read_record(checkpoint)
    params = restore_params(checkpoint, saved_shapes(checkpoint))
    model = build_gpt(model_config(record).model)
    out = model.apply({"params": params}, jnp.asarray(tokens))
    return np.asarray(out[0] if isinstance(out, tuple) else out)


def forward_rtol(model: dict, length: int) -> float:
    """`program_rtol` of the forward pass alone: per layer 8 chained reductions (as
    `numerics.gpt_rtol` counts them), plus the final norm, head and softmax-free logits; the
    widest sum is a matmul over d_ff or the embedding, or attention over the length."""
    width = max(model["d_model"], model["d_ff"], length)
    return program_rtol(width=width, depth=8 * model["n_layers"] + 2)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tmp_path, case):
    folder = fixture_folder(case, tmp_path)
    ckpt = import_hf(folder, tmp_path / "ckpt")
    tokens = np.load(FIXTURES / ("gqa" if case == "tf4_config" else case) / "tokens.npy")
    want = np.load(FIXTURES / case / "logits.npy")
    record = read_record(ckpt)
    assert_close(logits_of(ckpt, tokens), want, rtol=forward_rtol(record["model"], tokens.shape[1]))


def test_config_mapping(tmp_path):
    gqa = read_record(import_hf(FIXTURES / "gqa", tmp_path / "a"))["model"]
    assert (gqa["n_heads"], gqa["n_kv_heads"], gqa["tie_embeddings"]) == (4, 2, False)
    assert gqa["rope_theta"] == 50_000.0 and gqa["rope_scaling"] is None
    llama3 = read_record(import_hf(FIXTURES / "llama3_sharded", tmp_path / "b"))["model"]
    assert llama3["tie_embeddings"] and llama3["n_kv_heads"] == 1
    assert llama3["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    tf4 = read_record(import_hf(fixture_folder("tf4_config", tmp_path), tmp_path / "c"))["model"]
    assert tf4["rope_theta"] == 20_000.0 and tf4["rope_scaling"]["factor"] == 4.0


def _tensors(folder: Path) -> dict[str, tuple]:
    """name -> (dtype, shape, raw bytes) over every safetensors file of a folder."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = (str(t.dtype), t.shape, t.tobytes())
    return out


@pytest.mark.parametrize("case", ["gqa", "llama3_sharded"])
def test_import_export_round_trip_is_byte_identical(tmp_path, case):
    """Same tensors (names, dtypes, shapes, bytes); and since the export writes the import's
    layout (shards, file metadata, index) through the same serializer, the same files."""
    ckpt = import_hf(FIXTURES / case, tmp_path / "ckpt")
    out = export_hf(ckpt, tmp_path / "hf")
    assert _tensors(out) == _tensors(FIXTURES / case)
    written = sorted(p.name for p in out.iterdir())
    source = sorted(p.name for p in (FIXTURES / case).iterdir() if p.suffix != ".npy")
    assert written == source
    for name in written:
        assert (out / name).read_bytes() == (FIXTURES / case / name).read_bytes(), name


def test_export_casts_dtype(tmp_path):
    out = export_hf(import_hf(FIXTURES / "gqa", tmp_path / "ckpt"), tmp_path / "hf", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    again = read_record(import_hf(out, tmp_path / "again"))
    assert again["dtype"] == "bfloat16"  # bf16 files read back (numpy has no bf16 of its own)
    params = restore_params(tmp_path / "again", saved_shapes(tmp_path / "again"))
    want = restore_params(tmp_path / "ckpt", saved_shapes(tmp_path / "ckpt"))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(
        np.asarray(a), np.asarray(b.astype(jnp.bfloat16))), params, want)


def test_sharded_import_reads_every_shard(tmp_path):
    index = json.loads((FIXTURES / "llama3_sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # the fixture is really sharded
    shapes = saved_shapes(import_hf(FIXTURES / "llama3_sharded", tmp_path / "ckpt"))
    assert "head" not in shapes  # tied: the head is the embedding
    assert shapes["layers"]["attn"]["key"].shape == (2, 32, 1, 8)


def _batch(vocab: int, rows: int = 8, length: int = 16) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(1).integers(0, vocab, (rows, length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_zero3_on_8_devices_starts_from_the_import(tmp_path):
    ckpt = import_hf(FIXTURES / "gqa", tmp_path / "ckpt")
    record = read_record(ckpt)
    common = ["train_batch_size=8", "optimizer.params.lr=0.001"]
    batch = _batch(record["model"]["vocab_size"])
    losses = {}
    for name, overrides in {
        "one": ["mesh.data=1", "train_micro_batch_size_per_device=8"],
        "zero3": ["mesh.data=8", "zero_optimization.stage=3", "train_micro_batch_size_per_device=1"],
    }.items():
        cfg = model_config(record, *common, *overrides)
        mesh = js.make_mesh(cfg.mesh, devices=jax.devices()[: cfg.mesh.data])
        engine = js.initialize(cfg, mesh=mesh)
        state = start_from(engine, ckpt, jax.random.key(0))
        assert int(state.step) == 0
        key = state.params["layers"]["mlp"]["wi_gate"]
        assert key.sharding == engine.plan.params["layers"]["mlp"]["wi_gate"]
        if name == "zero3":  # restored sharded: each device holds a slice, not the whole leaf
            assert key.addressable_shards[0].data.size < key.size
        _, metrics = engine.train_step(state, batch)
        losses[name] = float(metrics["loss"])
    m = record["model"]
    rtol = gpt_rtol(tokens=8 * 16, d_model=m["d_model"], d_ff=m["d_ff"], n_layers=m["n_layers"],
                    vocab=m["vocab_size"])
    assert_close(losses["zero3"], losses["one"], rtol=rtol)


TRAIN = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.d_ff=48", "model.max_seq_len=16", "model.mlp=swiglu", "model.norm=rmsnorm",
         "model.tie_embeddings=false", "model.rope_theta=50000", "data.seq_len=16",
         "data.max_bytes=200000", "train_batch_size=8", "logging.every_n_steps=1"]


def test_train_load_from_starts_at_step_0_from_the_params(tmp_path):
    """`checkpoint.load_from` in `train`: its first loss is the loaded params' loss."""
    cfg = js.load_config(None, overrides=TRAIN)
    engine = js.initialize(cfg)
    params = jax.device_get(engine.init(jax.random.key(7)).params)
    save_params(tmp_path / "ckpt", params, model=cfg.model.model_dump(mode="json"))
    run = js.load_config(None, overrides=[*TRAIN, f"checkpoint.load_from={tmp_path / 'ckpt'}"])
    record = train(run, output_dir=tmp_path / "run", steps=1, progress=False)
    fresh = js.initialize(run)
    state = start_from(fresh, tmp_path / "ckpt", jax.random.key(run.seed))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), params)
    from jaxspeed.data import TokenDataset

    batch = TokenDataset.from_config(run.data, seed=run.seed).batch(0, global_batch=8)
    _, metrics = fresh.train_step(state, batch)
    assert record["loss"] == pytest.approx(float(metrics["loss"]), rel=0, abs=0)

    # and a train checkpoint exports as a Llama folder that imports back to the same params
    out = export_hf(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_theta"] == 50_000.0
    back = import_hf(out, tmp_path / "back")
    saved = js.initialize(run).restore(directory=tmp_path / "run" / "checkpoints")
    jax.tree.map(np.testing.assert_array_equal,
                 jax.device_get(restore_params(back, saved_shapes(back))), jax.device_get(saved.params))


def test_load_from_refuses_another_shape(tmp_path):
    ckpt = import_hf(FIXTURES / "gqa", tmp_path / "ckpt")
    cfg = model_config(read_record(ckpt), "model.d_ff=64", "train_batch_size=8")
    engine = js.initialize(cfg, mesh=js.make_mesh(cfg.mesh, devices=jax.devices()[:1]))
    with pytest.raises(CheckpointError, match=r"model.d_ff: checkpoint has 48, this run has 64"):
        start_from(engine, ckpt, jax.random.key(0))


def _edit_config(tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(FIXTURES / "gqa", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _cli_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxspeed {argv[0]}: error:") and "Traceback" not in err, err
    assert err.count("\n") == 1, err  # one line
    return err


@pytest.mark.parametrize(
    "changes, field",
    [({"hidden_act": "gelu"}, "hidden_act='gelu'"),
     ({"attention_bias": True}, "attention_bias=True"),
     ({"head_dim": 4}, "head_dim=4"),
     ({"model_type": "gpt2"}, "model_type='gpt2'"),
     ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
      "rope_parameters.rope_type='yarn'"),
     ({"intermediate_size": None}, "intermediate_size")],
    ids=["act", "bias", "head-dim", "model-type", "rope-type", "missing"],
)
def test_import_refuses_a_config_that_is_not_llama_like(tmp_path, capsys, changes, field):
    folder = _edit_config(tmp_path, **changes)
    err = _cli_error(capsys, ["import-hf", str(folder), "--out", str(tmp_path / "out")])
    assert field in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_import_refuses_a_corrupt_safetensors_file(tmp_path, capsys, damage):
    folder = tmp_path / "corrupt"
    shutil.copytree(FIXTURES / "gqa", folder)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\xff" * 64 if damage == "garbage" else data[: len(data) // 2])
    err = _cli_error(capsys, ["import-hf", str(folder), "--out", str(tmp_path / "out")])
    assert "model.safetensors" in err


def test_import_refuses_a_folder_without_weights(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    shutil.copy(FIXTURES / "gqa" / "config.json", tmp_path / "empty")
    err = _cli_error(capsys, ["import-hf", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert "model.safetensors" in err


def test_cli_import_then_export(tmp_path, capsys):
    assert main(["import-hf", str(FIXTURES / "gqa"), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (
        FIXTURES / "gqa" / "model.safetensors").read_bytes()
    err = _cli_error(capsys, ["import-hf", str(FIXTURES / "gqa"), "--out", str(tmp_path / "ckpt")])
    assert "not empty" in err


def test_export_refuses_a_model_hf_cannot_express(tmp_path, capsys):
    cfg = js.load_config(None, overrides=[*TRAIN, "model.mlp=gelu"])
    engine = js.initialize(cfg, mesh=js.make_mesh(cfg.mesh, devices=jax.devices()[:1]))
    engine.save(engine.init(jax.random.key(0)), directory=tmp_path / "ck")
    engine.checkpointer(tmp_path / "ck").wait()
    err = _cli_error(capsys, ["export", str(tmp_path / "ck"), "--format", "hf", "--out", str(tmp_path / "o")])
    assert "model.mlp='gelu'" in err


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                    or importlib.util.find_spec("torch") is None,
                    reason="transformers and torch are not installed (the fixtures hold their logits)")
@pytest.mark.parametrize("case", ["gqa", "llama3_sharded"])
def test_live_transformers_loads_the_export(tmp_path, case):
    import torch
    from transformers import AutoModelForCausalLM

    out = export_hf(import_hf(FIXTURES / case, tmp_path / "ckpt"), tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = np.load(FIXTURES / case / "tokens.npy")
    with torch.no_grad():
        got = model(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()
    record = read_record(tmp_path / "ckpt")
    assert_close(logits_of(tmp_path / "ckpt", tokens), got,
                 rtol=forward_rtol(record["model"], tokens.shape[1]))


@pytest.mark.slow
def test_benchmark_quick_run():
    from test_benchmarks import check_result, run_quick

    results = run_quick("import_export")
    assert [r["case"].split(":")[0] for r in results[:2]] == ["import", "export"]
    for obj in results:
        check_result(obj, "import_export")
        assert obj["round_trip_identical"] is True
    assert results[-1]["ratio"] == min(r["ratio"] for r in results[:2])
