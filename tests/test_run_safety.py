"""`jaxspeed train` loses little and surprises no one: periodic saves by wall clock, resuming
only the same run, and a clear word when the checkpoint is already at or past `--steps`."""

import json
import shutil

import pytest

import jaxspeed as js
from jaxspeed.checkpoint import Checkpointer
from jaxspeed.cli import main
from jaxspeed.train.loop import train
from jaxspeed.train.resume import NothingToTrain, ResumeRefused, check_config

TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000", "train_batch_size=8",
    "optimizer.params.lr=0.003", "logging.every_n_steps=1",
]


def config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


@pytest.fixture(scope="module")
def run_at_2(tmp_path_factory):
    """A run trained to step 2 (checkpoint at 2)."""
    out = tmp_path_factory.mktemp("run")
    train(config(), output_dir=out, steps=2, progress=False)
    return out


def test_saves_by_the_clock_by_default(tmp_path):
    assert js.load_config(None).checkpoint.every_n_minutes == 30
    cfg = config("checkpoint.every_n_minutes=0.00001", "checkpoint.keep=10")
    assert cfg.checkpoint.every_n_steps == 0
    train(cfg, output_dir=tmp_path, steps=3, progress=False)
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == [1, 2, 3]


def test_resumes_only_the_same_run(run_at_2, tmp_path):
    other = config("optimizer.params.lr=0.001")
    with pytest.raises(ResumeRefused) as err:
        train(other, output_dir=run_at_2, steps=3, progress=False)
    message = str(err.value)
    assert "optimizer.params.lr 0.003 -> 0.001" in message and "\n" not in message
    assert "--output" in message and "checkpoint.resume=force" in message
    assert Checkpointer(run_at_2 / "checkpoints").latest_step() == 2

    # what a resume may change: steps, logging, checkpoint cadence, hardware facts
    resumed = config("logging.every_n_steps=3", "checkpoint.every_n_minutes=5",
                     "hardware.peak_tflops=1.0")
    record = train(resumed, output_dir=run_at_2, steps=3, progress=False)
    assert record["step"] == 3

    forced = tmp_path / "forced"
    shutil.copytree(run_at_2, forced)
    record = train(config("optimizer.params.lr=0.001", "checkpoint.resume=force"),
                   output_dir=forced, steps=4, progress=False)
    assert record["step"] == 4


def test_refusal_names_a_handful_of_keys_and_old_checkpoints_warn(tmp_path, capsys):
    saved = config().to_dict()
    current = config("optimizer.params.lr=0.1", "seed=3", "model.d_ff=128", "data.seq_len=8",
                     "gradient_clipping=0.5", "model.n_layers=3")
    with pytest.raises(ResumeRefused, match=r"and 2 more\)"):
        check_config(current, {"config": saved}, global_batch=8, directory=tmp_path, step=5)
    with pytest.raises(ResumeRefused, match=r"train_batch_size 8 -> 16"):
        check_config(config(), {"config": saved, "global_batch": 8}, global_batch=16,
                     directory=tmp_path, step=5)
    split = {"config": saved, "global_batch": 8}  # the same batch, split otherwise
    check_config(config("train_micro_batch_size_per_device=1"), split, global_batch=8,
                 directory=tmp_path, step=5)
    check_config(current, {}, global_batch=8, directory=tmp_path, step=5)
    assert "has no saved config" in capsys.readouterr().err


def test_steps_at_or_below_the_checkpoint(run_at_2, tmp_path, capsys):
    with pytest.raises(NothingToTrain, match=r"at step \d+, past steps=1; nothing to train"):
        train(config(), output_dir=run_at_2, steps=1, progress=False)
    at = Checkpointer(run_at_2 / "checkpoints").latest_step()
    capsys.readouterr()
    record = train(config(), output_dir=run_at_2, steps=at, progress=False)
    assert record["step"] == at and "loss" in record
    err = capsys.readouterr().err
    assert "nothing to train (raise --steps to continue)" in err and len(err.splitlines()) == 1

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config().to_dict()))
    code = main(["train", str(path), "--output", str(run_at_2), "--steps", "1", "--no-progress"])
    assert code == 2
    assert "nothing to train" in capsys.readouterr().err
