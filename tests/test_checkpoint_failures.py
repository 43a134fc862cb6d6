"""Checkpoints that cannot be read or written: one line each, and resume falls back.

A truncated data file, a resume past a corrupt newest checkpoint (and `--resume-step`), no
readable checkpoint left, `jaxspeed sample` on a corrupt checkpoint, and a save that fails.
"""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp
import pytest

import jaxspeed as js
from jaxspeed.checkpoint import Checkpointer, CheckpointError
from jaxspeed.cli import main
from jaxspeed.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000", "train_batch_size=8",
    "logging.every_n_steps=1", "checkpoint.every_n_steps=2",
]


def config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of 4 steps with checkpoints at steps 2 and 4 (copy it before changing it)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train(config(), output_dir=out, steps=4, progress=False)
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of `trained`, and its config as `cfg.json` beside it."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    (tmp_path / "cfg.json").write_text(json.dumps(config().to_dict()))
    return copy


def truncate_data(step_dir: Path, pattern: str = "d/*") -> None:
    """Cuts the data files of a checkpoint step to their first 16 bytes (a torn copy): by
    default all of them (the OCDBT index too), with `"ocdbt.*/d/*"` the array chunks only.
    Not to half their size: which arrays sit in a file's second half depends on the order of
    the asynchronous writes, so a half cut could leave the params whole."""
    files = [f for f in (step_dir / "state").rglob(pattern) if f.is_file()]
    assert files
    for f in files:
        os.truncate(f, min(16, f.stat().st_size // 2))


def train_cli(run: Path, *flags: str) -> list[str]:
    return ["train", str(run.parent / "cfg.json"), "--output", str(run), "--no-progress", *flags]


@pytest.mark.parametrize("pattern", ["ocdbt.*/d/*", "d/*"], ids=["chunks", "index-and-chunks"])
def test_a_truncated_shard_is_one_line_naming_the_step_and_the_array(run, pattern):
    truncate_data(run / "checkpoints" / "4", pattern)
    engine = js.initialize(config())
    with pytest.raises(CheckpointError) as err:
        Checkpointer(run / "checkpoints").restore(engine.abstract_state(), step=4)
    message = str(err.value)
    assert "\n" not in message and len(message) < 600, message
    assert "step 4" in message and str(run / "checkpoints") in message
    assert "TensorStore(" not in message and "'driver'" not in message
    assert "array " in message  # the array that could not be read is named
    # and a data file (TensorStore names the index; for a chunk, the file of its size)
    assert re.search(r"/4/state/(ocdbt\.process_\d+/)?d/[0-9a-f]{32}\b", message), message


def test_one_torn_file_is_named_exactly(run):
    files = sorted((run / "checkpoints" / "4" / "state").rglob("ocdbt.*/d/*"))
    torn = max(files, key=lambda f: f.stat().st_size)  # the largest holds arrays for certain
    os.truncate(torn, 16)
    engine = js.initialize(config())
    with pytest.raises(CheckpointError, match=f"file {torn} is 16 bytes, the read needs bytes "
                                              r"\d+ to \d+$"):
        Checkpointer(run / "checkpoints").restore(engine.abstract_state(), step=4)


def test_resume_falls_back_past_a_corrupt_newest_checkpoint(run, capsys):
    truncate_data(run / "checkpoints" / "4")
    record = train(config(), output_dir=run, steps=6, progress=True)
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "step 4" in warning[0] and "step 2" in warning[0], err
    # the phase's end line says what it restored, not what it set out to
    assert "restoring step 4 ..." in err and "restoring step 2: done" in err, err
    assert "restoring step 4: done" not in err, err
    assert record["step"] == 6
    ckpt = Checkpointer(run / "checkpoints")
    assert ckpt.all_steps()[-2:] == [4, 6]  # step 4 again, from step 2, and step 6
    assert (run / "checkpoints" / "4.corrupt").is_dir()  # the bad one is set aside, not deleted
    ckpt.restore(js.initialize(config()).abstract_state(), step=4)  # the new step 4 reads


def test_resume_step_picks_a_checkpoint_by_hand(run, capsys):
    assert main(train_cli(run, "--steps", "6", "--resume-step", "2")) == 0
    err = capsys.readouterr().err
    assert "resuming step 2" in err and "step 4" in err, err
    assert Checkpointer(run / "checkpoints").all_steps()[-2:] == [4, 6]
    assert main(train_cli(run, "--steps", "8", "--resume-step", "5")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--resume-step 5" in err and "[" in err, err


def test_no_readable_checkpoint_left_is_one_line(run, capsys):
    for step in (2, 4):
        truncate_data(run / "checkpoints" / str(step))
    assert main(train_cli(run, "--steps", "6")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("jaxspeed train: error: ") and "no readable checkpoint" in lines[-1], lines
    assert "step 2" in lines[-1] and "step 4" in lines[-1]
    assert all("warning" in line for line in lines[:-1]) and len(lines) <= 3, lines


def test_a_corrupt_resume_step_is_one_line(run, capsys):
    truncate_data(run / "checkpoints" / "2")
    assert main(train_cli(run, "--steps", "6", "--resume-step", "2")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "step 2" in lines[0] and "error" in lines[0], lines


@pytest.mark.parametrize("error", [
    lambda where: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where),
    # what a full disk under TensorStore raises through Orbax (seen on a real full tmpfs)
    lambda where: ValueError(f"RESOURCE_EXHAUSTED: Error writing local file \"{where}/d/x\": "
                             "[OS error 28: No space left on device]\n(traceback of the writer)"),
])
def test_a_failed_save_keeps_the_previous_checkpoint_and_stops_in_one_line(
        run, capsys, monkeypatch, error):
    real_save = ocp.CheckpointManager.save

    def disk_full(self, step, *args, **kwargs):
        if step >= 6:
            raise error(str(self.directory))
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full)
    assert main(train_cli(run, "--steps", "8")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("jaxspeed train: error: ") and "step 6" in lines[0], lines
    assert "No space left on device" in lines[0] and "step 4" in lines[0], lines
    ckpt = Checkpointer(run / "checkpoints")
    assert ckpt.all_steps() == [2, 4]
    state, _ = ckpt.restore(js.initialize(config()).abstract_state(), step=4)
    assert int(jax.device_get(state.step)) == 4


def test_sample_of_a_corrupt_checkpoint_prints_only_the_error(run):
    truncate_data(run / "checkpoints" / "4", "ocdbt.*/d/*")  # on main: "Event loop is closed" x N
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "jaxspeed.cli", "sample", str(run), "--prompt", "a",
         "--max-new-tokens", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxspeed sample: error: "), out.stderr[-3000:]
    assert "step 4" in lines[0] and "array params." in lines[0], lines
