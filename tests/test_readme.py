"""The README's first command, `make train`, trains the reference model (here for 2 steps)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    assert "make train" in block and "make test" in block


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_train_runs_the_default_config(tmp_path):
    proc = subprocess.run(
        ["make", "-s", "train", f"OUTPUT={tmp_path}", "TRAIN_ARGS=--steps 2 --no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2 and records[-1]["loss"] > 0
