"""Token-file data across real processes (`jaxspeed launch`, gloo): a run saved by one process
and resumed by two continues at the same example, with the losses of one uninterrupted run."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxspeed.checkpoint import Checkpointer
from numerics import gpt_rtol
from children import child_env

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "jaxspeed.cli"]
MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 16, "vocab_size": 512}


def _records(run: Path) -> dict[int, dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


@pytest.mark.slow
def test_resume_on_two_processes_continues_a_one_process_run(tmp_path, monkeypatch):
    env = child_env()
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 500, size=6000).astype(np.uint16)
    tokens[rng.random(tokens.size) < 0.05] = 0  # documents end with EOS 0
    np.save(tmp_path / "tokens.npy", tokens)
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({
        "mesh": {"data": -1}, "train_micro_batch_size_per_device": 1, "model": MODEL,
        "data": {"source": "tokens", "files": [str(tmp_path / "tokens.npy")], "seq_len": 16,
                 "packing": True, "eos_id": 0},
        "zero_optimization": {"stage": 3}, "checkpoint": {"every_n_steps": 2},
        "logging": {"every_n_steps": 1}, "steps": 4,
    }))
    common = ["--no-progress"]

    def train_one(out: str, steps: int) -> subprocess.Popen:
        return subprocess.Popen(
            [*CLI, "train", str(config), "--cpu-devices", "8", "--output", str(tmp_path / out),
             "--steps", str(steps), *common],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    whole, first = train_one("whole", 4), train_one("split", 2)  # side by side: compile time
    for run in (whole, first):
        _, err = run.communicate(timeout=400)
        assert run.returncode == 0, err
    resumed = subprocess.run(
        [*CLI, "launch", "--nproc", "2", "--cpu-devices", "4", "--timeout", "300", "--",
         *CLI, "train", str(config), "--output", str(tmp_path / "split"), *common],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr
    a, b = _records(tmp_path / "whole"), _records(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    # the same samples in the same order, across the resume onto two processes
    assert [b[s]["sample_digest"] for s in a] == [a[s]["sample_digest"] for s in a]
    assert ("elastic resume of step 2: 1 processes, 8 devices -> 2 processes, 8 devices; "
            "global batch 8 kept") in resumed.stderr
    # Steps 3-4 ran on two processes: the all-reduces cross processes (gloo) and sum in
    # another order (tests/numerics.py); a batch read from the wrong rows would differ by far more.
    rho = gpt_rtol(tokens=8 * 16, d_model=32, d_ff=64, n_layers=2, vocab=512)
    np.testing.assert_allclose([b[s]["loss"] for s in (3, 4)], [a[s]["loss"] for s in (3, 4)], rtol=rho)
    ckpt = Checkpointer(tmp_path / "split" / "checkpoints")
    assert ckpt.read_meta(4)["data_state"] == {"next_index": 4}  # saved by the two processes
    ckpt.close()
