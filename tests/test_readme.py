"""The README's first command, `make train`, trains the reference model (here for 2 steps);
its Flax snippet is `examples/custom_flax_model.py` and runs as written."""

import ast
import json
import math
import os
import shutil
import subprocess
import sys
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


EXAMPLE = ROOT / "examples" / "custom_flax_model.py"


def _python_block_after(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(heading, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_flax_snippet_is_the_example_file():
    """The README's Flax snippet is `examples/custom_flax_model.py`, character for character."""
    assert _python_block_after("### 4. From your own Flax script") == EXAMPLE.read_text()


def test_flax_snippet_runs_as_written():
    """It trains a step and reports the memory of a step compiled for its own batch shapes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(EXAMPLE)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = float(proc.stdout.split("loss ", 1)[1].split()[0])
    assert math.isfinite(loss) and loss > 0
    per_device = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert per_device["params"] == 16 * 64 * 4 and per_device["total"] > 0


def test_slurm_snippet_is_the_script_ci_runs():
    text = (ROOT / "README.md").read_text()
    marker = "# examples/slurm/train.sbatch below its header comments: 2 nodes, one process per node\n"
    block = text.split(marker, 1)[1].split("```", 1)[0]
    script = (ROOT / "examples" / "slurm" / "train.sbatch").read_text()
    assert block == script[script.index("#SBATCH --job-name"):]
