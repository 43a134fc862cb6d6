"""`import-hf` and `export --format hf` lose nothing and leave nothing behind: an export refuses a
folder that is not empty, an import never touches a `<out>.tmp` of someone else's, a run
trained from an import exports with the import's token ids and generation config, a run's folder
names its checkpoints, and long conversions report progress in a log."""

import json
from pathlib import Path

import jax

import jaxspeed as js
from jaxspeed.checkpoint.hf import export_hf, import_hf
from jaxspeed.checkpoint.params import read_record, start_from
from jaxspeed.cli import main

GQA = Path(__file__).resolve().parent / "fixtures" / "llama" / "gqa"


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxspeed {argv[0]}: error:") and err.count("\n") == 1, err
    return err


def test_export_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    ckpt = import_hf(GQA, tmp_path / "ckpt")
    out = tmp_path / "hf"
    out.mkdir()
    stale = out / "model.safetensors.index.json"
    stale.write_text('{"weight_map": {}}')
    err = _one_line_error(capsys, ["export", str(ckpt), "--format", "hf", "--out", str(out)])
    assert "not empty" in err and str(out) in err
    assert [p.name for p in out.iterdir()] == [stale.name]  # nothing written, nothing removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]  # no staging left
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    written = export_hf(ckpt, tmp_path / "empty")
    assert sorted(p.name for p in written.iterdir()) == sorted(
        p.name for p in GQA.iterdir() if p.suffix != ".npy")


def test_import_leaves_an_existing_tmp_folder_alone(tmp_path, capsys):
    theirs = tmp_path / "ckpt.tmp"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    import_hf(GQA, tmp_path / "ckpt")
    assert (theirs / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.tmp"]
    # a failed import leaves neither the output nor its staging folder
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((GQA / "config.json").read_text())
    (bad / "model.safetensors").write_bytes((GQA / "model.safetensors").read_bytes()[:2000])
    _one_line_error(capsys, ["import-hf", str(bad), "--out", str(tmp_path / "out")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "ckpt", "ckpt.tmp"]


def test_a_run_trained_from_an_import_exports_its_token_ids(tmp_path):
    """The run's checkpoint holds only its config; the token ids and generation config come
    from the import it started from (`checkpoint.load_from`). The run's folder names its
    checkpoints."""
    ckpt = import_hf(GQA, tmp_path / "ckpt")
    config = js.load_config(
        {"model": read_record(ckpt)["model"], "data": {"seq_len": 16}},
        overrides=["train_batch_size=8", f"checkpoint.load_from={ckpt}"])
    engine = js.initialize(config, mesh=js.make_mesh(config.mesh, devices=jax.devices()[:1]))
    engine.save(start_from(engine, ckpt, jax.random.key(0)), directory=tmp_path / "run" / "checkpoints")
    engine.checkpointer(tmp_path / "run" / "checkpoints").wait()

    out = export_hf(tmp_path / "run", tmp_path / "hf")
    exported = json.loads((out / "config.json").read_text())
    source = json.loads((GQA / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (1, 2)
    assert {k: v for k, v in exported.items() if k != "dtype"} == {
        k: v for k, v in source.items() if k != "dtype"}
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (GQA / "generation_config.json").read_text())


def test_import_and_export_report_progress_without_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "1e-9")  # a line at every tensor
    assert main(["import-hf", str(GQA), "--out", str(tmp_path / "ckpt")]) == 0
    err = capsys.readouterr().err
    assert "import-hf gqa: 21/21 (100%)" in err, err
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    out, err = capsys.readouterr()
    assert "export hf: 21/21 (100%)" in err and out == f"wrote {tmp_path / 'hf'}\n"

