"""jaxspeed under a real SLURM: the local two-node cluster of `tools/local_slurm.sh`.

`make test-slurm` brings the cluster up, runs these, and takes it down; elsewhere (no cluster
up) they skip. Each node is a network namespace of its own, so the processes meet over a real
link, found by the nodes' names as on a cluster.
"""

import re
import signal
import sys
from pathlib import Path

import pytest
from numerics import assert_close, program_rtol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _slurm_jobs import (  # noqa: E402
    ELASTIC, JAXSPEED, ROOT, TINY, Job, cluster_up, local_slurm, records, seconds_until_done,
    signal_rank, slurm, train_here)

STEPS = 3

pytestmark = [pytest.mark.slurm, pytest.mark.skipif(
    not cluster_up(), reason="no local SLURM cluster up (tools/local_slurm.sh up; make "
    "test-slurm does it)")]


def test_sbatch_trains_like_one_process_with_the_same_devices(tmp_path):
    job = Job(tmp_path, "--steps", str(STEPS), "--set", "logging.every_n_steps=1")
    assert seconds_until_done(240) < 240, job.text()
    text = job.text()
    (final,) = records(text)  # rank 0 only: one final line, one progress bar
    assert text.count("compiling the train step: done") == 1
    assert [r["step"] for r in job.metrics()] == list(range(1, STEPS + 1))  # each step once
    want = train_here(tmp_path / "one", STEPS, "--set", "logging.every_n_steps=1")[-1]
    # 2 processes x 1 device against 1 process x 2 devices: the same program, its gradient
    # sums over gloo instead of in-process (another order at most)
    assert_close(final["loss"], want["loss"], rtol=program_rtol(width=256, depth=64))
    assert final["step"] == want["step"] == STEPS
    assert final["sample_digest"] == want["sample_digest"]


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


def start_training(tmp_path, **env: str) -> Job:
    """A long run of the sbatch script, once rank 0 logs a step (both processes train)."""
    job = Job(tmp_path, "--steps", "100000", "--set", "logging.every_n_steps=1", env=env)
    job.wait_for_step(1)
    return job


def test_a_killed_rank_ends_the_job_within_30_s_naming_it(tmp_path):
    job = start_training(tmp_path)
    signal_rank(1, signal.SIGKILL)
    assert seconds_until_done(120) < 30
    text = job.text()
    assert "n2: task 1: Killed" in text  # srun --kill-on-bad-exit names it
    # rank 0's collective with the dead rank fails first when srun is slower: one line
    assert "Traceback" not in text, text[-3000:]


def test_a_hung_rank_stops_the_others_within_the_heartbeat_timeout_naming_it(tmp_path):
    job = start_training(tmp_path, JAXSPEED_HEARTBEAT_TIMEOUT="30")
    signal_rank(1, signal.SIGSTOP)
    assert seconds_until_done(180) < 30 + 20  # the timeout, then SLURM's teardown
    text = job.text()
    assert re.search(r"stopped sending heartbeats\):\s*1\b", text), text[-3000:]


def test_a_lost_node_a_preemption_and_the_time_limit_each_resume_the_same_samples(tmp_path):
    """One elastic job (`--nodes=1-2`, a checkpoint every 4 steps) through three faults:
    1. node 2 is lost: SLURM requeues the job, which resumes on node 1 alone (shrink);
    2. node 2 is back, and `scancel --signal=TERM` preempts the job: a checkpoint at the step
       boundary, exit 75, the script requeues it, and it resumes on both nodes (grow);
    3. the time limit comes within the script's 120 s warning: the same way.
    Then a plain `scancel` ends it: saved, not requeued. Its metrics equal an uninterrupted
    run's: the same samples, step by step, and the same losses up to the reduction order."""
    job = Job(tmp_path, "--steps", "100000", *ELASTIC, "--set", "checkpoint.every_n_steps=4",
              nodes="1-2")
    job.wait_for(r"run 0, on 2 nodes")
    job.wait_for_step(6)
    assert local_slurm("node-down", "2").returncode == 0
    shrunk = job.wait_for(
        r"elastic resume of step (\d+): 2 processes, 2 devices -> 1 processes, 1 devices; global "
        r"batch 8 kept \(micro batch per device x accumulation: 4 x 1 -> 4 x 2\)")
    assert "run 1, on 1 nodes" in job.text()
    assert int(shrunk.group(1)) >= 4  # at most the steps since the last checkpoint are lost
    job.wait_for_step(int(shrunk.group(1)) + 3)

    assert local_slurm("node-up", "2").returncode == 0
    job.signal("TERM")
    stopped = job.wait_for(r"stopped by SIGTERM after step (\d+); checkpoint saved .*exit code 75")
    grown = job.wait_for(r"elastic resume of step (\d+): 1 processes, 1 devices -> 2 processes")
    assert grown.group(1) == stopped.group(1)  # nothing lost
    assert "run 2, on 2 nodes" in job.text()
    job.wait_for_step(int(stopped.group(1)) + 3)

    slurm("scontrol", "update", f"jobid={job.id}", "timelimit=2")  # the warning is due at once
    timed = job.wait_for(r"stopped by SIGTERM after step (\d+)", count=3, limit=120)
    slurm("scontrol", "update", f"jobid={job.id}", "timelimit=UNLIMITED")
    job.wait_for(rf"restoring step {timed.group(1)}: done")
    job.wait_for_step(int(timed.group(1)) + 2)

    job.cancel()
    assert seconds_until_done(60) < 60, job.text()[-3000:]
    assert "the job was cancelled or ran out of time: submit it again" in job.text()
    logged = job.metrics()
    steps = [r["step"] for r in logged]
    assert steps == list(range(1, len(steps) + 1))  # each step once
    want = train_here(tmp_path / "one", len(steps), *ELASTIC)
    assert [r["sample_digest"] for r in logged] == [r["sample_digest"] for r in want]
    # accumulation 2 on one node, gloo on two, against 1 process: the gradient sums in another
    # order, at each step; the run is one program of `steps` chained steps (numerics.py, 2)
    assert_close([r["loss"] for r in logged], [r["loss"] for r in want],
                 rtol=program_rtol(width=256, depth=64 * len(steps)))
