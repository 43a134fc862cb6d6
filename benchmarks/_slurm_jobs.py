"""jaxspeed's sbatch script on the local SLURM cluster (`tools/local_slurm.sh`): submit it, watch
it, and inject its faults. Shared by `tests/test_slurm.py` and `benchmarks/faults.py`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = Path(os.environ.get("LOCAL_SLURM_DIR", "/tmp/jaxspeed-slurm"))
JAXSPEED = ROOT / ".venv" / "bin" / "jaxspeed"
SCRIPT = "examples/slurm/train.sbatch"
TINY = "configs/gpt_tiny.yaml"
#: Elastic: the micro batch per device is fixed, so accumulation grows on fewer nodes.
ELASTIC = ["--set", "train_micro_batch_size_per_device=4", "--set", "gradient_accumulation_steps=null",
           "--set", "logging.every_n_steps=1"]

#: The tests' persistent compilation cache (conftest) stays out of the jobs: with it, one rank
#: of a 2-process run could load a step the other compiles afresh, and a run stuck in its
#: compile was seen that way (not investigated further).
JOB_ENV = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}


def cluster_up() -> bool:
    return (CLUSTER / "slurm.conf").exists()


def local_slurm(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`tools/local_slurm.sh ARGS`: `run CMD` runs a SLURM command where the cluster's commands
    work (its jobs take this environment: `--export=ALL`); `node-down K`, `node-up K`."""
    return subprocess.run([str(ROOT / "tools" / "local_slurm.sh"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env=JOB_ENV)


def slurm(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return local_slurm("run", *args, timeout=timeout)


def records(text: str) -> list[dict]:
    """The JSON lines of a text (the final record of `jaxspeed train`, or metrics.jsonl)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def train_here(folder: Path, steps: int, *args: str) -> list[dict]:
    """The same run outside SLURM, uninterrupted: one process with as many devices (2) as a
    two-node job; its metrics records."""
    subprocess.run([str(JAXSPEED), "train", TINY, "--cpu-devices", "2", "--steps", str(steps),
                    "--output", str(folder), "--no-progress", *args], cwd=ROOT, env=JOB_ENV,
                   capture_output=True, text=True, timeout=900, check=True)
    return records((folder / "metrics.jsonl").read_text())

class Job:
    """A submitted `examples/slurm/train.sbatch`: its output file and its run folder."""

    def __init__(self, folder: Path, *train_args: str, nodes: str = "2", env: dict | None = None,
                 sbatch: tuple[str, ...] = ()):
        self.out, self.run = folder / "job.out", folder / "run"
        extra = "".join(f",{k}={v}" for k, v in (env or {}).items())
        sent = slurm("sbatch", f"--nodes={nodes}", f"--chdir={ROOT}", f"--output={self.out}",
                     *sbatch, f"--export=ALL,CONFIG={TINY},OUTPUT={self.run},JAXSPEED={JAXSPEED}"
                     f"{extra}", SCRIPT, "--cpu-devices", "1", *train_args)
        found = re.search(r"Submitted batch job (\d+)", sent.stdout)
        assert found, sent.stdout + sent.stderr
        self.id = found.group(1)

    def text(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def metrics(self) -> list[dict]:
        path = self.run / "metrics.jsonl"
        return records(path.read_text()) if path.exists() else []

    def last_step(self) -> int:
        logged = self.metrics()
        return logged[-1]["step"] if logged else 0

    def wait_for_step(self, step: int, limit: float = 180) -> None:
        """Until the run has logged `step` (or later)."""
        self._wait(lambda: self.last_step() >= step, f"step {step}", limit)

    def wait_for(self, pattern: str, count: int = 1, limit: float = 180) -> re.Match:
        """Until the job's output matches `pattern` `count` times; the last match."""
        self._wait(lambda: len(re.findall(pattern, self.text())) >= count, repr(pattern), limit)
        return list(re.finditer(pattern, self.text()))[count - 1]

    def _wait(self, done, what: str, limit: float) -> None:
        deadline = time.monotonic() + limit
        while not done():
            assert time.monotonic() < deadline, f"no {what} in {limit} s:\n{self.text()[-3000:]}"
            time.sleep(0.5)

    def signal(self, name: str = "TERM") -> None:
        """`scancel --signal`: to every rank, not to the batch script."""
        slurm("scancel", f"--signal={name}", self.id)

    def cancel(self) -> None:
        slurm("scancel", self.id)


def rank_pids(rank: int) -> list[int]:
    """The pids of rank `rank`'s `jaxspeed train` (node `rank + 1`), every process of it: a
    process it forked carries the same command line. Not srun's (on node 1 with rank 0), whose
    command line holds `jaxspeed train` too."""
    found = subprocess.run(["ip", "netns", "pids", f"jsslurm{rank + 1}"], capture_output=True,
                           text=True, check=True).stdout.split()
    pids = []
    for pid in found:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"jaxspeed train" in b" ".join(argv) and not argv[0].endswith(b"srun"):
            pids.append(int(pid))
    return pids


def signal_rank(rank: int, signum: int) -> None:
    """Sends `signum` to rank `rank`'s `jaxspeed train` (node `rank + 1`), every process of
    it (`rank_pids`)."""
    pids = rank_pids(rank)
    assert pids, f"no jaxspeed train process of rank {rank}"
    for pid in pids:
        os.kill(pid, signum)


def seconds_until_done(limit: float) -> float:
    """Waits for the queue to empty; the seconds it took (past `limit`: a hang)."""
    start = time.monotonic()
    while slurm("squeue", "-h").stdout.strip() and time.monotonic() - start < limit:
        time.sleep(1)
    return time.monotonic() - start


# A tmpfs the jobs see. Each node's slurmd, and so each job on it, lives in a mount namespace of
# its own, copied (private) from this one when the node started: a mount made here afterwards
# does not reach it. The same tmpfs is attached to each node's namespace too (a clone of the
# mount, `open_tree`, moved into it, `move_mount`), so the nodes share one file system as on a
# cluster, and a remount here (its size) holds for all of them.
_ATTACH = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
folder, pid = sys.argv[1].encode(), sys.argv[2]
tree = libc.syscall(428, -100, folder, 1 | 0o2000000)  # open_tree(AT_FDCWD, CLONE | CLOEXEC)
if tree < 0:
    raise OSError(ctypes.get_errno(), "open_tree")
os.setns(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY), os.CLONE_NEWNS)
if libc.syscall(429, tree, b"", -100, folder, 4) < 0:  # move_mount(.., F_EMPTY_PATH)
    raise OSError(ctypes.get_errno(), "move_mount")
"""


def slurmd_pids() -> list[int]:
    """The slurmd of each node that is up (the nodes' mount namespaces)."""
    pids = []
    for pidfile in sorted((CLUSTER / "state").glob("slurmd-n*.pid")):
        pid = pidfile.read_text().strip()
        try:
            if b"slurmd" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def mount_tmpfs(folder: Path, size: str) -> None:
    """A tmpfs of `size` (`mount -o size=`, e.g. 130M) at `folder`, here and on every node."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                   check=True)
    for pid in slurmd_pids():
        subprocess.run([sys.executable, "-c", _ATTACH, str(folder), str(pid)], check=True)


def remount_tmpfs(folder: Path, size: str) -> None:
    """`mount_tmpfs`'s tmpfs resized (the nodes share it)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True)


def unmount_tmpfs(folder: Path) -> None:
    """`mount_tmpfs` undone on every node and here; what is not mounted is skipped."""
    for pid in slurmd_pids():
        subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "umount", str(folder)],
                       capture_output=True, check=False)
    subprocess.run(["umount", str(folder)], capture_output=True, check=False)
