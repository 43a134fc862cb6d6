"""jaxspeed commands across a `SlowLink`: one process per namespace, and what they measure.

`run_pair` starts `python -m jaxspeed.cli ARGS` once in each namespace, as processes 0 and 1 of
one `jax.distributed` job (coordinator on namespace 0's address), each pinned to its own core.
On top of it: `train` (tokens/s over the last half of the logged steps), `calibrate` (the link
as a cluster file) and, outside the link, `predict` (`plan --cluster FILE --json`'s
`predicted.tokens_per_second`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from _slow_link import SlowLink

ROOT = Path(__file__).resolve().parent.parent
#: seconds a process may outlive its partner's failure (it is then waiting for it)
_GRACE = 20.0


def child_env() -> dict[str, str]:
    """What every child adds to this process's environment: the CPU platform and this checkout
    first on the import path (so a worktree's jaxspeed wins over an installed one)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {"JAX_PLATFORMS": "cpu", "PYTHONPATH": path}


def cores() -> tuple[int, int]:
    """The cores processes 0 and 1 are pinned to: two distinct allowed cores when there are."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[0], allowed[1 % len(allowed)]


def run_pair(link: SlowLink, args: list[str], *, logs: Path, port: int,
             timeout: float) -> list[int | str]:
    """Runs `jaxspeed ARGS` as a 2-process job across the link; the exit codes of ranks 0, 1.

    `{rank}` in an argument becomes the process's rank. Each process's output goes to
    `logs.rank{r}.log`. A process still running `timeout` seconds after the start, or
    `_GRACE` seconds after its partner failed, is killed (its code is "timeout" / "killed").
    Both are killed on any exception (Ctrl-C, SIGTERM), so none outlives the link.
    """
    env = {**child_env(), "JAXSPEED_COORDINATOR": f"{link.addresses[0]}:{port}",
           "JAXSPEED_NUM_PROCESSES": "2", "JAXSPEED_INIT_TIMEOUT": str(int(min(timeout, 300)))}
    files = [open(f"{logs}.rank{r}.log", "w") for r in (0, 1)]
    procs: list[subprocess.Popen] = []
    codes: list[int | str | None] = [None, None]
    try:
        for r, core in enumerate(cores()):
            cmd = [sys.executable, "-m", "jaxspeed.cli", *(a.format(rank=r) for a in args)]
            procs.append(link.popen(r, cmd, core=core, cwd=ROOT, stdout=files[r],
                                    stderr=subprocess.STDOUT,
                                    env={**env, "JAXSPEED_PROCESS_ID": str(r)}))
        deadline, failed_at = time.monotonic() + timeout, None
        while None in codes:
            time.sleep(0.2)
            for r, p in enumerate(procs):
                if codes[r] is None and p.poll() is not None:
                    codes[r] = p.returncode
                    if p.returncode and failed_at is None:
                        failed_at = time.monotonic()
            now = time.monotonic()
            late = "timeout" if now > deadline else (
                "killed" if failed_at is not None and now > failed_at + _GRACE else None)
            if late:
                codes = [late if c is None else c for c in codes]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    return codes


def last_line(log: Path) -> str:
    """The last non-empty line of a log (where jaxspeed puts its one-line error), cut short."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return lines[-1][:300] if lines else "(no output)"


@dataclass(frozen=True)
class Throughput:
    """A training run's figures from its `metrics.jsonl`."""

    tokens_per_second: float  # the measured steps' tokens over their time
    last_loss: float | None  # held-out (the run's final eval) where logged, else the last step's
    steps_logged: int
    steps_measured: int  # the last half of the logged steps
    first_measured_step: int


def throughput(metrics: Path) -> Throughput:
    """Tokens/s over the last half of the logged steps (after start-up, compiling and a 1-bit
    optimizer's freeze): their tokens over their time, the harmonic mean of the steps' rates
    (a median would report 0/1 Adam's local steps alone, never its syncs), and the loss at
    the end: the held-out `eval_loss` the run
    logs with its last step (one batch's training loss is too noisy to hold to 3%: AdamW's
    swings 8% between consecutive steps of the tiny GPT), else the last step's loss."""
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in logged if "tokens_per_second" in r]
    if not rows:
        raise RuntimeError(f"{metrics} has no logged step")
    half = rows[len(rows) // 2:]
    evals = [r["eval_loss"] for r in logged if "eval_loss" in r]
    return Throughput(statistics.harmonic_mean([r["tokens_per_second"] for r in half]),
                      evals[-1] if evals else rows[-1].get("loss"), len(rows), len(half),
                      half[0].get("step", -1))


def train(link: SlowLink, config: str, overrides: list[str], *, steps: int, devices: int,
          out: Path, port: int, timeout: float) -> tuple[Throughput | None, str | None]:
    """Trains `config` for `steps` across the link on 2 hosts x `devices` emulated devices.

    Returns:
      (the run's figures, None), or (None, a one-line error).
    """
    sets = [f"mesh.data={2 * devices}", "logging.every_n_steps=1",
            "checkpoint.every_n_minutes=0", *overrides]
    args = ["train", config, "--steps", str(steps), "--cpu-devices", str(devices),
            "--output", str(out), "--no-progress", *[a for s in sets for a in ("--set", s)]]
    codes = run_pair(link, args, logs=out, port=port, timeout=timeout)
    if codes != [0, 0]:
        return None, f"exit {codes}: {last_line(Path(f'{out}.rank0.log'))}"
    return throughput(out / "metrics.jsonl"), None


@dataclass(frozen=True)
class Calibration:
    """The link as `jaxspeed calibrate` measured it (`cluster` is None when it failed)."""

    cluster: Path | None
    hosts: int
    inter_host_gbps: float | None
    latency_us: float | None
    efficiency: float | None = None  #: the model's step's share of the matmul peak
    error: str | None = None


def calibrate(link: SlowLink, *, devices: int, out: Path, port: int, timeout: float,
              quick: bool, config: str, overrides: list[str]) -> Calibration:
    """`jaxspeed calibrate` as a 2-process job across the link, into `out/cluster.rank0.yaml`
    (each process names its own file, in case every process writes one). Its `efficiency` is
    a step of `config`'s model with `overrides` (`calibrate --config`), so the planner prices
    that model's compute as this machine runs it.

    A calibration whose file says `hosts: 1` did not cross the link (a calibrate that does not
    join the processes into one job measures each process's own devices)."""
    sizes = ["--repeats", "3", "--matmul-size", "512", "--collective-mib", "4"] if quick else []
    args = ["calibrate", "--out", str(out / "cluster.rank{rank}.yaml"), "--name", "slow_link",
            "--cpu-devices", str(devices), *sizes, "--config", config,
            *[a for s in overrides for a in ("--set", s)]]
    codes = run_pair(link, args, logs=out / "calibrate", port=port, timeout=timeout)
    cluster = out / "cluster.rank0.yaml"
    if codes != [0, 0] or not cluster.exists():
        return Calibration(None, 0, None, None,
                           error=f"exit {codes}: {last_line(out / 'calibrate.rank0.log')}")
    data = yaml.safe_load(cluster.read_text())
    inter = data.get("inter_host") or {}
    return Calibration(cluster, int(data.get("hosts", 0)), inter.get("bandwidth_gbps"),
                       inter.get("latency_us"), data.get("efficiency"))


def predict(config: str, overrides: list[str], *, cluster: Path, devices: int,
            timeout: float) -> tuple[float | None, str | None]:
    """`plan CONFIG --cluster FILE --json`'s `predicted.tokens_per_second` for 2 hosts x
    `devices`, planned in one process on `2 * devices` emulated devices, which `plan` places on
    the cluster's hosts (a `host` axis split off `data`, or, where the MoE's `mesh.data=1`
    leaves none to split, the devices standing for the two processes).

    Returns:
      (tokens/s, None), or (None, why there is no prediction, one line).
    """
    sets = [f"mesh.data={2 * devices}", *overrides]
    cmd = [sys.executable, "-m", "jaxspeed.cli", "plan", config, "--cluster", str(cluster),
           "--json", "--cpu-devices", str(2 * devices), *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, **child_env()}
    env.pop("JAXSPEED_NUM_PROCESSES", None)
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"plan took over {timeout:g} s"
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        return None, f"plan: {lines[-1][:200]}"
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1])
        return float(report["predicted"]["tokens_per_second"]), None
    except (ValueError, IndexError, KeyError, TypeError):
        return None, "plan --json has no predicted.tokens_per_second"
