"""jaxspeed under a real SLURM: the local two-node cluster of `tools/local_slurm.sh`.

`make test-slurm` brings the cluster up, runs these, and takes it down; elsewhere (no cluster
up) they skip. Each node is a network namespace of its own, so the processes meet over a real
link, found by the nodes' names as on a cluster.
"""

import json
import os
import re
import signal
import subprocess
import time
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


#: The tests' persistent compilation cache (conftest) stays out of the jobs: with it, one rank
#: of a 2-process run could load a step the other compiles afresh, and a run stuck in its
#: compile was seen that way (not investigated further).
_JOB_ENV = {k: v for k, v in os.environ.items()
            if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}


def slurm(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """A SLURM command run where the local cluster's commands work (its jobs take this
    environment: `--export=ALL`)."""
    return subprocess.run([str(ROOT / "tools" / "local_slurm.sh"), "run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env=_JOB_ENV)


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


def start_training(tmp_path, **env: str) -> Path:
    """Submits a long run of the sbatch script; returns its output file once rank 0 logs a
    step (both processes are training)."""
    out = tmp_path / "job.out"
    extra = "".join(f",{k}={v}" for k, v in env.items())
    job = slurm("sbatch", f"--chdir={ROOT}", f"--output={out}",
                f"--export=ALL,CONFIG={TINY},OUTPUT={tmp_path / 'run'},JAXSPEED={JAXSPEED}{extra}",
                "examples/slurm/train.sbatch", "--cpu-devices", "1", "--steps", "100000",
                "--set", "logging.every_n_steps=1")
    assert job.returncode == 0, job.stderr
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.stat().st_size) and time.monotonic() < deadline:
        time.sleep(1)
    assert metrics.exists(), out.read_text() if out.exists() else "no job output"
    return out


def signal_rank(rank: int, signum: int) -> None:
    """Sends `signum` to rank `rank`'s `jaxspeed train` (node `rank + 1`), every process of
    it: a process it forked carries the same command line."""
    found = subprocess.run(["ip", "netns", "pids", f"jsslurm{rank + 1}"], capture_output=True,
                           text=True, check=True).stdout.split()
    sent = 0
    for pid in found:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"jaxspeed train" in command:
            os.kill(int(pid), signum)
            sent += 1
    assert sent, f"no jaxspeed train process of rank {rank}"


def seconds_until_done(limit: float) -> float:
    """Waits for the queue to empty; the seconds it took (past `limit`: a hang)."""
    start = time.monotonic()
    while slurm("squeue", "-h").stdout.strip() and time.monotonic() - start < limit:
        time.sleep(1)
    return time.monotonic() - start


def test_a_killed_rank_ends_the_job_within_30_s_naming_it(tmp_path):
    out = start_training(tmp_path)
    signal_rank(1, signal.SIGKILL)
    assert seconds_until_done(120) < 30
    assert "n2: task 1: Killed" in out.read_text()  # srun --kill-on-bad-exit names it


def test_a_hung_rank_stops_the_others_within_the_heartbeat_timeout_naming_it(tmp_path):
    out = start_training(tmp_path, JAXSPEED_HEARTBEAT_TIMEOUT="30")
    signal_rank(1, signal.SIGSTOP)
    assert seconds_until_done(180) < 30 + 20  # the timeout, then SLURM's teardown
    text = out.read_text()
    assert re.search(r"stopped sending heartbeats\):\s*1\b", text), text[-3000:]
