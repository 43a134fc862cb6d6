"""SLURM faults: each fault of the SLURM issue's table injected into real `jaxspeed train` jobs
(`examples/slurm/train.sbatch`) on the local two-node cluster, and what it cost.

Each fault runs as its own job(s) on a fresh folder: the tiny GPT, elastic overrides (micro
batch 4 per device, global batch 8, a metrics record every step), a checkpoint every 4 steps
(`checkpoint.keep` high: retention deletes none), `--steps T`. A fault that ends the job without
a requeue is followed by the same job submitted again on the same folder: every row ends at T.

- time to detect: seconds from the injection to the reaction (printed under the table per row).
- steps lost: the last step logged before the injection (disk full: before the run stopped)
  minus the step the next run resumed; 0 when it resumed at or after it.
- samples repeated or skipped: steps whose `sample_digest` in the final metrics.jsonl differs
  from an uninterrupted reference run's (`jaxspeed train` outside SLURM, 1 process, 2 devices,
  run once for all rows; a step missing or logged twice counts), times the global batch (8).
- bytes lost: bytes of the checkpoints complete before the fault that are missing or changed
  at the end (each file's size and SHA-256), the one corrupted on purpose excluded.
- ok: the row's "must happen" all held, nothing lost, the run ended at T (else `why` in its
  JSON line names what did not).

Needs root and the cluster (`tools/local_slurm.sh up 2`) with an empty queue:

    python benchmarks/faults.py                        # every fault, T = 80 (about 15 minutes)
    python benchmarks/faults.py --quick                # preemption and a lost node, T = 16
    python benchmarks/faults.py --faults kill corrupt  # some of them

T = 80 lets the time limit's SIGTERM, which SLURM sends up to 30-40 s after the limit is set
(at step 1), come before the run ends (about 1.7 steps/s here).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]

import _common  # noqa: E402
from _slurm_jobs import (  # noqa: E402
    CLUSTER, ELASTIC, Job, cluster_up, local_slurm, mount_tmpfs, rank_pids, remount_tmpfs,
    seconds_until_done, signal_rank, slurm, train_here, unmount_tmpfs)

NAME = "faults"
BATCH = 8  # configs/gpt_tiny.yaml's train_batch_size
EVERY = 4  # checkpoint.every_n_steps
HEARTBEAT = 30  # JAXSPEED_HEARTBEAT_TIMEOUT for the hung rank
HUNG = 120  # seconds after which a job that should have ended is taken as hung
STOP = r"stopped by SIGTERM after step (\d+); checkpoint saved [^\n]*exit code 75"


def overrides(steps: int) -> list[str]:
    return ["--steps", str(steps), *ELASTIC, "--set", f"checkpoint.every_n_steps={EVERY}",
            "--set", "checkpoint.keep=1000"]


def until(done, what: str, limit: float = 180) -> float:
    """Polls `done()` every 0.2 s; the seconds it took."""
    start = time.monotonic()
    while not done():
        if time.monotonic() - start > limit:
            raise AssertionError(f"no {what} in {limit:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - start


def saved_steps(run: Path) -> list[int]:
    """The steps of a run's complete checkpoints (a folder named by its step)."""
    return sorted(int(f.name) for f in (run / "checkpoints").glob("*") if f.name.isdigit())


def checkpoints(run: Path) -> dict[int, dict[str, tuple[int, str]]]:
    """Each complete checkpoint of a run: its files' sizes and SHA-256."""
    found = {}
    for step in saved_steps(run):
        folder = run / "checkpoints" / str(step)
        try:
            found[step] = {str(f.relative_to(folder)): (f.stat().st_size, hashlib.sha256(
                f.read_bytes()).hexdigest()) for f in folder.rglob("*") if f.is_file()}
        except FileNotFoundError:  # set aside meanwhile
            continue
    return found


def bytes_lost(before: dict, after: dict, skip: set[int]) -> int:
    return sum(size for step, files in before.items() if step not in skip
               for name, (size, digest) in files.items()
               if after.get(step, {}).get(name) != (size, digest))


class Trial:
    """One fault's jobs on one fresh folder (one job.out, appended to), and its findings."""

    def __init__(self, folder: Path, steps: int, checkpoint_bytes: int):
        self.folder, self.steps, self.run = folder, steps, folder / "run"
        self.checkpoint_bytes = checkpoint_bytes  # the reference's largest checkpoint
        folder.mkdir(parents=True)
        self.jobs: list[Job] = []
        self.checks: dict[str, bool] = {}
        self.down: set[int] = set()  # nodes this row took down
        self.skip: set[int] = set()  # checkpoints damaged on purpose
        self.mounted, self.before, self.before_step, self.mark = False, {}, 0, 0

    def submit(self, **kwargs) -> Job:
        self.jobs.append(Job(self.folder, *overrides(self.steps), **kwargs))
        return self.jobs[-1]

    def after(self) -> str:
        """The jobs' output since the injection."""
        return self.jobs[-1].text()[self.mark:]

    def inject(self, job: Job, action) -> float:
        """Records the last step and the checkpoints, then injects; the injection's time."""
        self.before_step, self.before = job.last_step(), checkpoints(self.run)
        self.mark = len(job.text())
        start = time.monotonic()
        action()
        return start

    def wait_after(self, job: Job, pattern: str, limit: float = 180) -> re.Match:
        """Until `pattern` shows in the output after the injection; its match."""
        count = len(re.findall(pattern, job.text()[:self.mark])) + 1
        return job.wait_for(pattern, count=count, limit=limit)

    def check(self, what: str, held) -> None:
        self.checks[what] = bool(held)

    def resubmit(self, **kwargs) -> Job:
        """The job ended without a requeue: the same job again, once no rank is left."""
        assert seconds_until_done(HUNG) < HUNG, "the job did not end"
        for rank in (0, 1):  # a stopped rank SLURM did not end
            for pid in rank_pids(rank):
                os.kill(pid, signal.SIGKILL)
        return self.submit(**kwargs)

    def resumed(self) -> int | None:
        """The step the first run after the injection resumed."""
        found = (re.search(r"resuming step (\d+)", self.after())
                 or re.search(r"restoring step (\d+): done", self.after()))
        return int(found.group(1)) if found else None

    def node(self, state: str, k: int) -> None:
        """`tools/local_slurm.sh node-down K` or `node-up K`."""
        self.down.add(k)  # until it is up again (cleanup brings it up)
        done = local_slurm(f"node-{state}", str(k))
        assert done.returncode == 0, f"node-{state} {k}: {done.stderr.strip()}"
        if state == "up":
            self.down.discard(k)

    def cleanup(self) -> None:
        for job in self.jobs:
            job.cancel()
        seconds_until_done(90)
        for k in sorted(self.down):
            local_slurm("node-up", str(k))
        if self.mounted:
            unmount_tmpfs(self.run)


def kill(t: Trial) -> float:
    job = t.submit()
    job.wait_for_step(6)
    t.inject(job, lambda: signal_rank(1, signal.SIGKILL))
    took = seconds_until_done(HUNG)
    t.check("the job ended within 30 s", took < 30)
    t.check("rank 1 named", re.search(r"task 1: Killed", t.after()))
    t.check("no traceback", "Traceback" not in t.after())
    t.resubmit()
    return took


def hang(t: Trial) -> float:
    env = {"JAXSPEED_HEARTBEAT_TIMEOUT": str(HEARTBEAT)}
    job = t.submit(env=env)
    job.wait_for_step(6)
    t.inject(job, lambda: signal_rank(1, signal.SIGSTOP))
    took = until(lambda: not rank_pids(0), "exit of rank 0", limit=HEARTBEAT + HUNG)
    t.check(f"rank 0 exited within the {HEARTBEAT} s timeout (+10 s)", took < HEARTBEAT + 10)
    seconds_until_done(HUNG)
    t.check("rank 1 named", re.search(r"stopped sending heartbeats\):\s*1\b", t.after()))
    t.resubmit(env=env)
    return took


def _preempted(t: Trial, job: Job, start: float, then=None) -> float:
    """A SIGTERM's checks: checkpoint, exit 75, requeued, the saved step resumed; `then` runs
    once the stop line showed."""
    stopped = t.wait_after(job, STOP, limit=120)
    took = time.monotonic() - start
    if then is not None:
        then()
    restored = t.wait_after(job, r"restoring step (\d+): done")
    t.check("requeued", "checkpoint saved; requeueing job" in t.after())
    t.check("the requeued run resumed the saved step", restored.group(1) == stopped.group(1))
    return took


def preempt(t: Trial) -> float:
    job = t.submit()
    job.wait_for_step(6)
    return _preempted(t, job, t.inject(job, lambda: job.signal("TERM")))


def time_limit(t: Trial) -> float:
    job = t.submit()
    job.wait_for_step(1)
    start = t.inject(job, lambda: slurm("scontrol", "update", f"jobid={job.id}", "timelimit=2"))
    return _preempted(t, job, start, then=lambda: slurm(  # the requeued run is not stopped again
        "scontrol", "update", f"jobid={job.id}", "timelimit=UNLIMITED"))


def lost_node(t: Trial) -> float:
    job = t.submit(nodes="1-2")
    job.wait_for(r"run 0, on 2 nodes")
    job.wait_for_step(6)
    start = t.inject(job, lambda: t.node("down", 2))
    shrunk = t.wait_after(job, r"elastic resume of step \d+: 2 processes, 2 devices -> 1 "
                               r"processes[^\n]*")
    took = time.monotonic() - start
    t.check("resumed on 1 node", "run 1, on 1 nodes" in t.after())
    t.check("global batch kept", "global batch 8 kept" in shrunk.group(0))
    t.node("up", 2)
    return took


def grow(t: Trial) -> float:
    t.node("down", 2)
    job = t.submit(nodes="1-2")
    job.wait_for(r"run 0, on 1 nodes")
    job.wait_for_step(6)
    t.node("up", 2)
    start = t.inject(job, lambda: job.signal("TERM"))
    stopped = t.wait_after(job, STOP)
    grown = t.wait_after(job, r"elastic resume of step (\d+): 1 processes, 1 devices -> 2 "
                              r"processes[^\n]*")
    took = time.monotonic() - start
    t.check("resumed on 2 nodes", "run 1, on 2 nodes" in t.after())
    t.check("global batch kept", "global batch 8 kept" in grown.group(0))
    t.check("the saved step resumed", grown.group(1) == stopped.group(1))
    return took


def corrupt(t: Trial) -> float:
    job = t.submit()
    until(lambda: len(saved_steps(t.run)) >= 2, "second checkpoint")
    job.cancel()  # saves the step it is at, and ends the job
    assert seconds_until_done(HUNG) < HUNG, "the cancelled job did not end"
    *_, previous, newest = saved_steps(t.run)
    files = (t.run / "checkpoints" / str(newest) / "state").rglob("*")
    victim = max((f for f in files if f.is_file()), key=lambda f: f.stat().st_size)  # array data
    t.skip.add(newest)

    def damage():
        with victim.open("r+b") as f:
            f.truncate(8)
        t.submit()

    start = t.inject(job, damage)
    t.wait_after(t.jobs[-1], r"jaxspeed train: warning: [^\n]*set aside")
    took = time.monotonic() - start
    lines = [line for line in t.after().splitlines() if "warning:" in line]
    t.check("one warning line", len(lines) == 1)
    t.check("it names the checkpoint", lines and f"checkpoint step {newest} in" in lines[0])
    t.check("and the truncated file", lines and f"file {victim} is 8 bytes" in lines[0])
    t.check(f"the previous checkpoint (step {previous}) resumed", t.resumed() == previous)
    return took


def disk_full(t: Trial) -> float | None:
    fits = 2  # checkpoints: the third save fails
    t.mounted = True
    mount_tmpfs(t.run, f"{math.ceil((fits + 0.5) * t.checkpoint_bytes / 2**20)}M")
    job = t.submit()
    until(lambda: len(saved_steps(t.run)) >= fits, f"{fits} checkpoints")
    job.wait_for_step((fits + 1) * EVERY)
    t.inject(job, lambda: None)  # the save that fails is under way
    took = seconds_until_done(HUNG)
    t.check(f"the run stopped (within {HUNG} s)", took < HUNG)
    t.before_step = job.last_step()  # what it trained until it stopped is lost too
    said = [line for line in t.after().splitlines() if "cannot save step" in line]
    # one line: from each rank at most, the same one
    t.check("with one line", len(set(said)) == 1 and "Traceback" not in t.after())
    t.check(f"naming step {fits * EVERY} intact",
            said and f"step {fits * EVERY} is the newest intact one" in said[0])
    if took >= HUNG:
        job.cancel()
    remount_tmpfs(t.run, "1G")
    t.resubmit()
    return took if took < HUNG else None


FAULTS = {  # key: the row's name, the fault, what its time to detect times
    "kill": ("a rank is SIGKILLed", kill, "SIGKILL to rank 1 -> the job ended (queue empty)"),
    "hang": ("a rank hangs (SIGSTOP)", hang, "SIGSTOP to rank 1 -> rank 0's process exited"),
    "preempt": ("preemption (SIGTERM)", preempt,
                "scancel --signal=TERM -> 'checkpoint saved' (the stop line)"),
    "time_limit": ("the time limit", time_limit, "scontrol timelimit=2 (at step 1) -> "
                   "'checkpoint saved': SLURM's own delay (up to 30-40 s) included"),
    "lost_node": ("a lost node (2 -> 1)", lost_node,
                  "node-down 2 -> the requeued job resumed on 1 node ('elastic resume')"),
    "grow": ("a node added back (1 -> 2)", grow,
             "scancel --signal=TERM after node-up 2 -> the requeued job resumed on 2 nodes"),
    "corrupt": ("corrupt newest checkpoint", corrupt,
                "truncation and resubmission -> the warning line (start-up included)"),
    "disk_full": ("a save fails (disk full)", disk_full,
                  "the step whose save fails logged -> the job ended"),
}


def _time_up(signum, frame):
    raise TimeoutError("the row's time limit ran out")


def run_row(key: str, t: Trial, reference: list[str], limit: int) -> dict:
    """One fault end to end; its JSON line."""
    row = {"benchmark": NAME, "case": FAULTS[key][0], "detect_s": None, "steps_lost": None,
           "samples_wrong": None, "bytes_lost": None, "ok": False}
    signal.signal(signal.SIGALRM, _time_up)
    signal.alarm(limit)
    try:
        took = FAULTS[key][1](t)
        assert seconds_until_done(limit) < limit, "the last job did not end"
        logged = t.jobs[-1].metrics()
        digests = {r["step"]: r["sample_digest"] for r in logged}
        wrong = len(logged) - len(digests) + sum(
            digests.get(step) != want for step, want in enumerate(reference[:t.steps], 1))
        t.check(f"the run ended at step {t.steps}", sorted(digests) == list(range(1, t.steps + 1)))
        resumed = t.resumed()
        row.update(detect_s=None if took is None else round(took, 1),
                   steps_lost=None if resumed is None else max(0, t.before_step - resumed),
                   samples_wrong=wrong * BATCH,
                   bytes_lost=bytes_lost(t.before, checkpoints(t.run), t.skip))
        t.check("no sample repeated or skipped", wrong == 0)
        t.check("no checkpoint bytes lost", row["bytes_lost"] == 0)
        failed = [what for what, held in t.checks.items() if not held]
        row["ok"] = not failed
        if failed:
            row["why"] = "not: " + "; ".join(failed)
    except (AssertionError, OSError, subprocess.SubprocessError) as err:  # TimeoutError too
        row["why"] = f"{type(err).__name__}: {(str(err) or repr(err)).splitlines()[0]}"
    finally:
        signal.alarm(0)
        t.cleanup()
    return row


def reference_run(folder: Path, steps: int) -> tuple[list[str], int]:
    """The uninterrupted run's sample digests, step by step, and its largest checkpoint's bytes."""
    logged = train_here(folder, steps, *overrides(steps))
    sizes = [sum(size for size, _ in files.values()) for files in checkpoints(folder).values()]
    return [r["sample_digest"] for r in logged], max(sizes)


def cluster_ready() -> str | None:
    """Why the benchmark cannot run here, or None."""
    if not cluster_up() or slurm("sinfo").returncode:
        return f"no local SLURM cluster up in {CLUSTER}: run `tools/local_slurm.sh up 2` first"
    if os.geteuid():
        return "needs root (signals to the nodes' processes, node-down, mount)"
    states = slurm("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
    if states[1::2] != ["idle", "idle"]:
        return f"needs 2 idle nodes, found: {' '.join(states)} (`tools/local_slurm.sh up 2`)"
    if slurm("squeue", "-h").stdout.strip():
        return "the SLURM queue is not empty (each row waits for it to empty)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="T, every row's total steps")
    parser.add_argument("--faults", nargs="+", choices=list(FAULTS), default=None,
                        help="default: all (with --quick: preempt lost_node)")
    parser.add_argument("--quick", action="store_true", help="T = 16, preempt and lost_node")
    parser.add_argument("--out", type=Path, default=None,
                        help="keep the jobs' folders here (default: a temporary folder)")
    args = parser.parse_args(argv)
    steps = 16 if args.quick else args.steps
    keys = args.faults or (["preempt", "lost_node"] if args.quick else list(FAULTS))
    problem = cluster_ready()
    if problem:
        print(f"faults.py: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="jaxspeed-faults-") as tmp:
        folder = args.out or Path(tmp)
        reference, checkpoint_bytes = reference_run(folder / "reference", steps)
        results = [run_row(key, Trial(folder / key, steps, checkpoint_bytes), reference,
                           limit=300 + 5 * steps) for key in keys]
    _common.print_table(
        ["fault", "time to detect (s)", "steps lost", "samples repeated or skipped",
         "bytes lost", "ok"],
        [[r["case"], "-" if r["detect_s"] is None else f"{r['detect_s']:.1f}",
          *("-" if r[k] is None else r[k] for k in ("steps_lost", "samples_wrong", "bytes_lost")),
          "yes" if r["ok"] else "NO"] for r in results])
    print(f"T = {steps} steps, global batch {BATCH}, a checkpoint every {EVERY} steps. "
          f"Time to detect:")
    for key in keys:
        print(f"  {FAULTS[key][0]}: {FAULTS[key][2]}")
    for r in results:
        _common.print_json(r)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
