"""`jaxspeed launch`: N processes form one mesh, a dying rank stops the run, nothing hangs."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from jaxspeed.cli import main
from jaxspeed.errors import REQUEUE_EXIT_CODE
from jaxspeed.runtime.launch import child_env, last_error_line, launch
from numerics import gpt_rtol

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "jaxspeed.cli"]
TINY = {
    "mesh": {"data": -1},
    "train_micro_batch_size_per_device": 1,
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 32},
    "data": {"seq_len": 32, "max_bytes": 300000},
    "logging": {"every_n_steps": 1},
    "steps": 3,
}


@pytest.fixture
def env(monkeypatch):
    """Children import jaxspeed from this checkout, with the suite's XLA flags (fast compiles,
    tests/conftest.py): `--cpu-devices` replaces their device count (`child_env`)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return dict(os.environ)


STAGE3 = ["--set", "zero_optimization.stage=3", "--no-progress"]


class _OneProcessRun:
    """`jaxspeed train` on one process of 8 devices, ZeRO-3, 4 steps, a checkpoint every 2:
    the baseline of the 2-process run, and the run a read-only checkpoint folder then stops."""

    def __init__(self, folder: Path):
        self.config = folder / "tiny.json"
        self.config.write_text(json.dumps({**TINY, "steps": 4, "checkpoint": {"every_n_steps": 2}}))
        self.output = folder / "B"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(self.command(self.output), cwd=ROOT, env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._err = None

    def command(self, output: Path) -> list[str]:
        return [*CLI, "train", str(self.config), "--cpu-devices", "8", "--output", str(output),
                *STAGE3]

    def wait(self) -> Path:
        """Its output folder, once it ended well."""
        if self._err is None:
            _, self._err = self.proc.communicate(timeout=400)
        assert self.proc.returncode == 0, self._err
        return self.output


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """Started by its first user and left to run beside it (both are mostly compile time)."""
    run = _OneProcessRun(tmp_path_factory.mktemp("one_process"))
    yield run
    run.proc.kill()


def script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def digests(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["sample_digest"] for line in lines]


def test_two_processes_match_one_process(tmp_path, env, one_process_run):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    multi = subprocess.run(
        [*CLI, "launch", "--nproc", "2", "--cpu-devices", "4", "--timeout", "300", "--",
         *CLI, "train", str(config), "--output", str(tmp_path / "A"), *STAGE3],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    single = one_process_run.wait()
    assert multi.returncode == 0, multi.stderr
    finals = dict(  # rank 0 alone prints the last record as JSON
        line.split(" ", 2)[1:] for line in multi.stdout.splitlines()
        if line.startswith("[rank ") and line.endswith("}")
    )
    assert set(finals) == {"0]"}
    assert all(json.loads(r)["step"] == 3 for r in finals.values())
    a, b = losses(tmp_path / "A"), losses(single)[:3]  # its first 3 of 4 steps
    assert len(a) == len(b) == 3
    # The same 8-device mesh, but its all-reduces cross two processes: another collective
    # implementation, which sums in another order (tests/numerics.py; 8 x 32 tokens a step).
    rho = gpt_rtol(tokens=8 * 32, d_model=32, d_ff=64, n_layers=2, vocab=256)
    np.testing.assert_allclose(a, b, rtol=rho)
    assert digests(tmp_path / "A") == digests(single)[:3]  # each process its own rows


def test_dying_rank_stops_the_others(tmp_path, env, capsys):
    pids = tmp_path / "pids"
    pids.mkdir()
    child = script(tmp_path, "die.py", f"""
        import os, sys, time
        rank = int(os.environ["JAXSPEED_PROCESS_ID"])
        open(os.path.join({str(pids)!r}, str(rank)), "w").write(str(os.getpid()))
        waiting = os.path.join({str(pids)!r}, "..", "rank0-in-initialize")
        if rank == 1:
            for _ in range(300):  # fail once rank 0 blocks in the start-up barrier
                if os.path.exists(waiting):
                    break
                time.sleep(0.1)
            time.sleep(1)
            print("RuntimeError: rank one broke", file=sys.stderr)
            sys.exit(3)
        from jaxspeed.runtime.distributed import initialize
        open(waiting, "w").close()
        initialize()  # waits for rank 1, which never comes
        print("rank 0 got past initialize", flush=True)
    """)
    start = time.monotonic()
    code = main(["launch", "--nproc", "2", "--cpu-devices", "4", "--grace", "5", "--",
                 sys.executable, child])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 3
    assert elapsed < 60
    assert "rank 1 exited with code 3; its last error line: RuntimeError: rank one broke" in err
    assert "stopping the other ranks [0]" in err
    for pid_file in pids.iterdir():  # nothing left running
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def _tmpfs(folder: Path, size: str) -> bool:
    """A tmpfs of `size` at `folder` (root only); False when it cannot be mounted."""
    folder.mkdir(parents=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True)
    return done.returncode == 0


def test_a_save_that_fails_on_one_process_stops_both_at_once(tmp_path, env):
    """A full disk under 2 processes: one line, both stop, the older checkpoint intact.

    At 1250 KiB one or two checkpoints (about 590 KiB each) fit, and the next one's background
    write failed on process 0 alone (seen); process 1's went through and waited at Orbax's
    barrier for process 0, and both waited 300 s before jaxspeed agreed on each save."""
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({**TINY, "steps": 12, "checkpoint": {"every_n_steps": 2}}))
    checkpoints = tmp_path / "A" / "checkpoints"
    if not _tmpfs(checkpoints, "1250k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        start = time.monotonic()
        run = subprocess.run(
            [*CLI, "launch", "--nproc", "2", "--cpu-devices", "4", "--timeout", "150", "--",
             *CLI, "train", str(config), "--output", str(tmp_path / "A"), "--no-progress"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=200,
        )
        elapsed = time.monotonic() - start
        steps = sorted(p.name for p in checkpoints.iterdir())
    finally:
        subprocess.run(["umount", str(checkpoints)], check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 2, output[-3000:]
    assert elapsed < 120, elapsed
    said = {line.split("] ", 1)[1] for line in output.splitlines()
            if line.startswith("[rank ") and "cannot save step" in line}
    assert len(said) == 1, said  # each process that says it, the same line
    (line,) = said
    # which save fails first depends on how well each checkpoint compresses (2 or 3 fit)
    match = re.search(r"cannot save step (\d+) in .*: No space left on device "
                      r"\(step (\d+) is the newest intact one\)", line)
    assert match and int(match[1]) == int(match[2]) + 2, line
    assert "Traceback" not in output and "ERROR:absl" not in output, output[-3000:]
    assert match[2] in steps  # the intact one is still there


def test_a_save_that_fails_in_one_process_ends_it_at_once(tmp_path, one_process_run):
    """A read-only checkpoints folder under one process: its line, exit 2, at once. The run
    joined Orbax's threads of the failed write at exit, until Orbax's timeout (300 s).

    It resumes a copy of the 2-process test's baseline (4 steps, checkpoints at 2 and 4)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a read-only bind mount")
    run_dir = tmp_path / "A"
    shutil.copytree(one_process_run.wait(), run_dir)
    train = one_process_run.command(run_dir)
    checkpoints = run_dir / "checkpoints"
    if subprocess.run(["mount", "--bind", "-o", "ro", str(checkpoints), str(checkpoints)]).returncode:
        pytest.skip("needs root for a read-only bind mount")
    try:
        start = time.monotonic()
        run = subprocess.run([*train, "--steps", "8"], cwd=ROOT, env=one_process_run.env,
                             capture_output=True, text=True, timeout=400)
        elapsed = time.monotonic() - start
    finally:
        subprocess.run(["umount", str(checkpoints)], check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 2, output[-3000:]
    assert elapsed < 120, elapsed
    assert re.search(r"error: cannot save step 6 in .*: Read-only file system.*"
                     r"\(step 4 is the newest intact one\)", output), output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_rank_killed_after_initialize(tmp_path, env):
    """A rank killed mid-run (after the start-up barrier) ends the run, named, in bounded time."""
    child = script(tmp_path, "kill9.py", """
        import os, signal, time
        from jaxspeed.runtime.distributed import initialize
        initialize()
        import jax
        import jax.numpy as jnp
        rank = jax.process_index()
        print("devices", rank, jax.device_count(), jax.local_device_count(), flush=True)
        if rank == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # rank 0 keeps working until it is stopped
            jax.block_until_ready(jnp.ones(4) + 1)
            time.sleep(0.05)
    """)
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = launch([sys.executable, child], nproc=2, cpu_devices=4, grace=2, timeout=120,
                  stdout=out, stderr=err)
    assert code == 128 + signal.SIGKILL
    assert time.monotonic() - start < 60
    assert sorted(line for line in out.getvalue().splitlines() if "devices" in line) == [
        "[rank 0] devices 0 8 4", "[rank 1] devices 1 8 4"]
    assert "jaxspeed launch: rank 1 was killed by SIGKILL" in err.getvalue()
    assert "stopping the other ranks [0]" in err.getvalue()


@pytest.mark.parametrize("processes", [1, 2])
def test_a_gone_peer_is_one_line(monkeypatch, processes):
    """What rank 0 of a SLURM job printed as a 50-line traceback when rank 1 was SIGKILLed."""
    from jaxspeed.train import processes as procs

    seen = ("UNKNOWN: Gloo AllGather failed: [external/xla++third_party_ext+gloo/gloo/transport/"
            "tcp/pair.cc:547] Connection closed by peer [10.78.0.2]:64194\n(stack of C++ frames)")
    monkeypatch.setattr(procs.jax, "process_count", lambda: processes)
    gone = procs.peer_gone(RuntimeError(seen))
    if processes == 1:
        assert gone is None  # no other process: a real error, with its traceback
        return
    assert str(gone) == ("another process of this run is gone (killed, or its node lost): UNKNOWN: "
                         "Gloo AllGather failed: Connection closed by peer [10.78.0.2]:64194")
    assert gone.exit_now  # the CLI does not wait for JAX's shutdown, which waits for the peer
    assert procs.peer_gone(RuntimeError("INTERNAL: something else")) is None


class _Saving:
    """A checkpointer whose newest save (step 4) is still running here, or failed here."""

    def __init__(self, failed=None):
        self.in_progress, self.saving, self.directory = failed is None, 4, Path("/ckpt")
        self._failed, self.abandoned = failed, False

    def failure(self):
        return self._failed

    def abandon(self):
        self.abandoned = True

    def intact(self, step):
        return "step 2 is the newest intact one"


@pytest.mark.parametrize("here", [True, False])
def test_settle_save_stops_every_process_when_one_failed(monkeypatch, here):
    """Before a save, a failure of the last one on any process stops this one with a line.
    (Seen: a local name shadowed `save_failed`, so this raised a TypeError, and the loop's
    final wait then hung at Orbax's barrier until `jaxspeed launch` timed out.)"""
    from jaxspeed.checkpoint.state import CheckpointError, SaveFailedOnAProcess
    from jaxspeed.train import processes as procs

    reason = "cannot save step 4 in /ckpt: No space left on device (step 2 is the newest intact one)"
    ckpt = _Saving(CheckpointError(reason) if here else None)
    monkeypatch.setattr(procs.jax, "process_count", lambda: 2)
    monkeypatch.setattr(procs, "agreed", lambda *flags: (True, True))  # the other one failed
    with pytest.raises(SaveFailedOnAProcess) as raised:
        procs.settle_save(ckpt, poll_s=0)
    assert ckpt.abandoned  # its own write waits at Orbax's barrier for the failed one
    assert raised.value.exit_now
    assert str(raised.value) == reason if here else str(raised.value) == (
        "stopped: another process could not save step 4 in /ckpt (its line says why; "
        "step 2 is the newest intact one)")


def test_start_up_barrier_times_out(tmp_path, env):
    child = script(tmp_path, "late.py", """
        import os, time
        if os.environ["JAXSPEED_PROCESS_ID"] == "1":
            time.sleep(600)  # never reaches jax.distributed.initialize
        from jaxspeed.runtime.distributed import initialize
        initialize()
    """)
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = launch([sys.executable, child], nproc=2, cpu_devices=2, init_timeout=3, grace=2,
                  stdout=out, stderr=err)
    assert code != 0
    assert time.monotonic() - start < 60
    message = err.getvalue()
    assert "jaxspeed launch: rank 0 " in message and "stopping the other ranks [1]" in message
    # process 0 names the rank that never came (jaxspeed.runtime.rendezvous)
    assert re.search(r"ranks that never came to the coordinator at 127\.0\.0\.1:\d+ within 3 s: "
                     r"1 \(of 2 processes\)", message), message


def test_overall_timeout_kills_everything(tmp_path, env):
    child = script(tmp_path, "sleep.py", "import time; time.sleep(600)\n")
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = launch([sys.executable, child], nproc=2, timeout=1, grace=1, stdout=out, stderr=err)
    assert code == 124
    assert time.monotonic() - start < 20
    assert "timed out after 1 s; stopping ranks [0, 1]" in err.getvalue()


def test_children_get_rank_env_and_prefixed_output(tmp_path, env, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the device count is then the children's only flag
    child = script(tmp_path, "env.py", """
        import os, sys
        e = os.environ
        print(e["JAXSPEED_PROCESS_ID"], e["JAXSPEED_NUM_PROCESSES"], e["JAXSPEED_COORDINATOR"],
              e["JAX_NUM_CPU_DEVICES"], e["XLA_FLAGS"])
        print("to stderr", file=sys.stderr)
    """)
    out, err = io.StringIO(), io.StringIO()
    assert launch([sys.executable, child], nproc=3, cpu_devices=2, stdout=out, stderr=err) == 0
    lines = sorted(out.getvalue().splitlines())
    assert len(lines) == 3
    coordinators = set()
    for rank, line in enumerate(lines):
        assert line.startswith(f"[rank {rank}] {rank} 3 127.0.0.1:")
        coordinator, devices, flags = line.split(" ")[4:]
        assert devices == "2" and flags == "--xla_force_host_platform_device_count=2"
        coordinators.add(coordinator)
    assert len(coordinators) == 1
    assert sorted(err.getvalue().splitlines()) == [f"[rank {r}] to stderr" for r in range(3)]


@pytest.mark.parametrize("child_exit, launcher_exit", [
    (0, 128 + signal.SIGTERM),
    (REQUEUE_EXIT_CODE, REQUEUE_EXIT_CODE),  # every rank saved its checkpoint: requeue
])
def test_signal_is_forwarded_to_children(tmp_path, env, child_exit, launcher_exit):
    marks = tmp_path / "marks"
    marks.mkdir()
    child = script(tmp_path, "trap.py", f"""
        import os, signal, sys, time
        rank = os.environ["JAXSPEED_PROCESS_ID"]
        def stop(signum, frame):
            open(os.path.join({str(marks)!r}, "term-" + rank), "w").close()
            sys.exit({child_exit})
        signal.signal(signal.SIGTERM, stop)
        open(os.path.join({str(marks)!r}, "ready-" + rank), "w").close()
        time.sleep(600)
    """)
    launcher = subprocess.Popen(
        [*CLI, "launch", "--nproc", "2", "--grace", "5", "--", sys.executable, child],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 60
    while len(list(marks.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == launcher_exit
    assert "got SIGTERM; forwarding it to every rank" in err
    assert sorted(p.name for p in marks.glob("term-*")) == ["term-0", "term-1"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--nproc", "0", "--", sys.executable, "-c", "pass"], "--nproc must be >= 1, got 0"),
        (["--nproc", "2"], "no command given"),
        (["--nproc", "2", "--"], "no command given"),
        (["--nproc", "2", "--cpu-devices", "0", "--", "true"], "--cpu-devices must be >= 1"),
        (["--nproc", "1", "--", "/no/such/program"], "cannot start '/no/such/program'"),
    ],
    ids=["nproc-0", "no-command", "empty-command", "cpu-devices-0", "missing-program"],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, match):
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxspeed launch: error:") and match in err
    assert len(err.strip().splitlines()) == 1


def test_child_env_replaces_device_count():
    env = child_env({"XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8"},
                    coordinator="127.0.0.1:1234", nproc=2, rank=1, cpu_devices=4, init_timeout=7)
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    assert env["JAXSPEED_PROCESS_ID"] == "1" and env["JAXSPEED_NUM_PROCESSES"] == "2"
    assert env["JAXSPEED_INIT_TIMEOUT"] == "7"
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    assert "JAX_PLATFORMS" not in child_env({}, coordinator="h:1", nproc=1, rank=0)


def test_last_error_line_skips_native_stack_frames():
    fatal = ("F1130 19:41:06.667557   16646 client.h:80] Terminating process because the JAX "
             "distributed service detected fatal errors. absl::Status: DEADLINE_EXCEEDED")
    lines = [fatal, "", "*** Check failure stack trace: ***",
             "    @     0x7f8959ce40ee  xla::CoordinationServiceAgent::SetError()"]
    assert last_error_line(lines).startswith("Terminating process because")
    assert last_error_line(["Traceback (most recent call last):", '  File "x.py", line 1',
                            "ValueError: bad"]) == "ValueError: bad"
    assert last_error_line(["step 3", "done"]) is None


def test_distributed_flag_without_a_cluster_is_one_clear_error(tmp_path, env):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    proc = subprocess.run([*CLI, "plan", str(config), "--distributed"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("jaxspeed plan: error: jax.distributed.initialize failed")
    assert "Traceback" not in proc.stderr
