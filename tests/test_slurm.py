"""jaxspeed under a real SLURM: the local two-node cluster of `tools/local_slurm.sh`.

`make test-slurm` brings the cluster up, runs these, and takes it down; elsewhere (no cluster
up) they skip. Each node is a network namespace of its own, so the processes meet over a real
link, found by the nodes' names as on a cluster.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from numerics import assert_close, program_rtol

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = Path(os.environ.get("LOCAL_SLURM_DIR", "/tmp/jaxspeed-slurm"))
JAXSPEED = ROOT / ".venv" / "bin" / "jaxspeed"
TINY = "configs/gpt_tiny.yaml"
STEPS = 3

pytestmark = [pytest.mark.slurm, pytest.mark.skipif(
    not (CLUSTER / "slurm.conf").exists(), reason="no local SLURM cluster up "
    "(tools/local_slurm.sh up; make test-slurm does it)")]


def slurm(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """A SLURM command run where the local cluster's commands work."""
    return subprocess.run([str(ROOT / "tools" / "local_slurm.sh"), "run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_sbatch_trains_like_one_process_with_the_same_devices(tmp_path):
    out = tmp_path / "job.out"
    job = slurm("sbatch", "--wait", f"--chdir={ROOT}", f"--output={out}",
                f"--export=ALL,CONFIG={TINY},OUTPUT={tmp_path / 'run'},JAXSPEED={JAXSPEED}",
                "examples/slurm/train.sbatch", "--cpu-devices", "1", "--steps", str(STEPS),
                "--set", "logging.every_n_steps=1")
    assert job.returncode == 0, job.stdout + job.stderr + out.read_text()
    text = out.read_text()
    (final,) = records(text)  # rank 0 only: one final line, one progress bar
    assert text.count("compiling the train step: done") == 1
    logged = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in logged] == list(range(1, STEPS + 1))  # once
    one = subprocess.run([str(JAXSPEED), "train", TINY, "--cpu-devices", "2", "--steps",
                          str(STEPS), "--output", str(tmp_path / "one"), "--set",
                          "logging.every_n_steps=1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240, check=True)
    (want,) = records(one.stdout)
    # 2 processes x 1 device against 1 process x 2 devices: the same program, its gradient
    # sums over gloo instead of in-process (another order at most)
    assert_close(final["loss"], want["loss"], rtol=program_rtol(width=256, depth=64))
    assert final["step"] == want["step"] == STEPS


@pytest.mark.parametrize("absent, says", [
    (1, r"ranks that never came to the coordinator at n1:\d+ within 8 s: 1 \(of 2 processes\)"),
    (0, r"process 1 of 2: the coordinator at n1:\d+ did not let the run start within 8 s"),
])
def test_a_rank_that_never_comes_is_named_within_the_timeout(tmp_path, absent, says):
    start = (f'if [ "$SLURM_PROCID" = {absent} ]; then sleep 15; else exec {JAXSPEED} train '
             f"{TINY} --distributed --cpu-devices 1 --steps 1 --output {tmp_path / 'run'}; fi")
    job = slurm("srun", "-N", "2", "-n", "2", f"--chdir={ROOT}",
                "--export=ALL,JAXSPEED_INIT_TIMEOUT=8", "sh", "-c", start, timeout=120)
    text = job.stdout + job.stderr
    assert job.returncode != 0
    waiting = "waiting at n1:" if absent == 1 else "waiting for the coordinator at n1:"
    assert waiting in text, text  # said while it waited, naming the address
    assert re.search(says, text), text
