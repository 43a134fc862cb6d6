"""The example scripts train a user's own Linen / NNX model end to end (2 steps each)."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from children import child_env

ROOT = Path(__file__).resolve().parent.parent
LOSS = re.compile(r"^step\s+(\d+)\s+loss\s+(\S+)", re.MULTILINE)


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # Import the checked-out library (the script's own folder comes first on sys.path).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, f"examples/{script}", "--steps", "2", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.slow  # a subprocess that compiles a small model: ~30-60 s on 2 busy cores
@pytest.mark.parametrize("script", ["train_linen.py", "train_nnx.py"])
def test_example_trains_and_prints_a_finite_loss(script):
    result = _run(script, "--set", "data.max_bytes=100000")  # 5% of the 2 MB: a second less
    assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    losses = {int(step): float(loss) for step, loss in LOSS.findall(result.stdout)}
    assert sorted(losses) == [1, 2], result.stdout
    assert all(math.isfinite(loss) and 0 < loss < 10 for loss in losses.values()), losses
    assert "ZeRO stage 3" in result.stdout  # engine.plan.explain() ends the run
    # The embedding's `vocab` dimension was split over the tensor axis.
    assert re.search(r"^embedding\S*\s.*\btensor\b", result.stdout, re.MULTILINE), result.stdout


def test_onebit_adam_in_a_plain_flax_loop():
    result = _run("onebit_adam_flax.py", "--steps", "6", "--freeze-step", "3")
    assert result.returncode == 0, f"failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    losses = [float(loss) for _, loss in LOSS.findall(result.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0], result.stdout
    assert result.stdout.count("(compressed)") == 3


@pytest.mark.slow  # compiles three variants of the model
def test_long_context_example_trains_over_the_sequence_axis():
    result = _run("long_context.py", "--seq-len", "1024")
    assert result.returncode == 0, f"failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    losses = [float(loss) for _, loss in LOSS.findall(result.stdout)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), result.stdout
    summary = json.loads(result.stdout.splitlines()[-1])
    total = {name: m["total"] for name, m in summary["per_device_bytes"].items()}
    # one eighth of a sequence per device holds less than a whole one, and the L x L scores more
    assert total["sequence 8"] < total["data 8, blocked"] < total["data 8, reference"]


@pytest.mark.slow  # seven CLI steps, three of them compile a model: ~30 s
def test_finetune_llama_script_runs_every_step(tmp_path):
    # the script's --cpu-devices makes the devices; the fast-compile flags stay (conftest.py)
    env = child_env(STEPS="2", FILES="8", WORK=str(tmp_path), PYTHON=sys.executable)
    result = subprocess.run(["bash", "examples/finetune_llama.sh"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    for step in range(1, 8):
        assert f"== {step}." in result.stdout
    assert "sample @ step 2:" in result.stdout
    record = json.loads(next(line for line in result.stdout.splitlines()
                             if line.startswith('{"output"')))
    assert record["step"] == 2 and math.isfinite(record["loss"])
    assert (tmp_path / "hf-out" / "model.safetensors").is_file()
