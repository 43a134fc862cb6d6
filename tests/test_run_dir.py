"""The run folder: one writer at a time (its lock), a folder that cannot be made, and
metrics.jsonl after a crash and resume."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import jaxspeed as js
from jaxspeed.cli import main
from jaxspeed.errors import ConfigError
from jaxspeed.train import loop
from jaxspeed.train.metrics_log import drop_records_after
from jaxspeed.train.run_dir import LOCK_NAME, RunFolderBusy, acquire_lock, run_folder
from children import child_env

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000", "train_batch_size=8",
    "logging.every_n_steps=1", "logging.eval_every_n_steps=0",
]


def tiny_config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


def write_lock(folder: Path, *, pid: int, host: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    lock.write_text(json.dumps({"pid": pid, "host": host, "started": 0}))
    return lock


@pytest.fixture
def live_pid():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now
    return proc.pid


def test_a_live_run_keeps_the_folder(tmp_path, live_pid):
    lock = write_lock(tmp_path, pid=live_pid, host=socket.gethostname())
    before = lock.read_text()
    with pytest.raises(RunFolderBusy, match=rf"pid {live_pid} on host {socket.gethostname()}"):
        acquire_lock(tmp_path)
    assert lock.read_text() == before  # untouched


def test_a_dead_run_is_taken_over_with_a_warning(tmp_path, dead_pid, capsys):
    lock = write_lock(tmp_path, pid=dead_pid, host=socket.gethostname())
    assert acquire_lock(tmp_path) == lock
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert "warning" in err and f"pid {dead_pid}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # nothing left aside


def test_another_hosts_lock_is_refused_and_says_how_to_remove_it(tmp_path, dead_pid):
    lock = write_lock(tmp_path, pid=dead_pid, host="elsewhere-node-7")
    with pytest.raises(RunFolderBusy, match="another host") as refused:
        acquire_lock(tmp_path)
    assert "elsewhere-node-7" in str(refused.value) and f"delete {lock}" in str(refused.value)
    assert lock.exists()


def write_slurm_lock(folder: Path, *, job: str, restart: int, pid: int) -> Path:
    lock = write_lock(folder, pid=pid, host="node-that-was-lost")
    lock.write_text(json.dumps({**json.loads(lock.read_text()), "slurm_job": job,
                                "slurm_restart": restart}))
    return lock


def test_a_requeued_slurm_job_takes_its_earlier_runs_lock_from_another_host(
        tmp_path, live_pid, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = write_slurm_lock(tmp_path, job="4242", restart=0, pid=live_pid)
    assert acquire_lock(tmp_path) == lock
    taken = json.loads(lock.read_text())
    assert (taken["pid"], taken["slurm_job"], taken["slurm_restart"]) == (os.getpid(), "4242", 1)
    err = capsys.readouterr().err
    assert "warning" in err and "this SLURM job's run before its requeue" in err


@pytest.mark.parametrize("job, restart", [("4242", 1), ("4243", 0)])
def test_a_slurm_lock_of_another_job_or_the_same_run_is_refused(
        tmp_path, live_pid, monkeypatch, job, restart):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = write_slurm_lock(tmp_path, job=job, restart=restart, pid=live_pid)
    with pytest.raises(RunFolderBusy, match=f"another host .*SLURM job {job}"):
        acquire_lock(tmp_path)
    assert json.loads(lock.read_text())["slurm_job"] == job


def test_the_lock_is_released_on_an_exception(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="boom"):
        with run_folder(out):
            assert (out / LOCK_NAME).exists()
            (out / "metrics.jsonl").write_text("")
            raise RuntimeError("boom")
    assert not (out / LOCK_NAME).exists()
    with run_folder(out):  # a second run gets it
        pass
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_a_folder_created_and_left_empty_is_removed(tmp_path):
    with run_folder(tmp_path / "a" / "run"):
        pass
    assert not (tmp_path / "a" / "run").exists()


def test_a_second_train_into_a_locked_output_is_one_line(tmp_path, live_pid, capsys, monkeypatch):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config().to_dict()))
    out = tmp_path / "run"
    write_lock(out, pid=live_pid, host=socket.gethostname())
    monkeypatch.setattr(loop, "initialize", _not_reached)
    assert main(["train", str(config), "--output", str(out), "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pid {live_pid}" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written


def _not_reached(config):
    raise AssertionError("the model was initialized before the output folder was checked")


@pytest.mark.parametrize("where", ["under_a_file", "sys"])
def test_an_output_that_cannot_be_created_is_one_line(tmp_path, capsys, monkeypatch, where):
    if where == "sys":
        if not Path("/sys").is_dir():
            pytest.skip("needs Linux's /sys, where no one may create a folder")
        out = Path("/sys/jaxspeed-test-output")
    else:
        (tmp_path / "a_file").write_text("")
        out = tmp_path / "a_file" / "run"
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config().to_dict()))
    monkeypatch.setattr(loop, "initialize", _not_reached)
    assert main(["train", str(config), "--output", str(out), "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out) in err[0] and "cannot be created" in err[0], err
    with pytest.raises(ConfigError, match="cannot be created"):
        js.train_model(tiny_config(), output_dir=out, steps=2)


def test_an_existing_output_the_file_system_refuses_is_one_line(tmp_path, capsys, monkeypatch):
    """/sys/kernel exists, and root passes `os.access` there, but no file can be created."""
    out = Path("/sys/kernel")
    if not out.is_dir():
        pytest.skip("needs Linux's /sys/kernel")
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config().to_dict()))
    monkeypatch.setattr(loop, "initialize", _not_reached)
    assert main(["train", str(config), "--output", str(out), "--steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/sys/kernel (--output) is not writable" in err[0], err


def test_drop_records_after_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4))
                    + '{"step": 5, "lo')  # cut short by the crash
    assert drop_records_after(path, 2) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert drop_records_after(path, 2) == 0
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_resume_after_a_crash_logs_each_step_once(tmp_path):
    """A crash after step 4 was logged but before it was saved: the resume from step 2 logs
    steps 3 and 4 again, and metrics.jsonl holds each step once, as a straight run's does."""
    cfg = tiny_config("checkpoint.every_n_steps=2", "checkpoint.async=false")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    js.train_model(cfg, output_dir=straight, steps=4, progress=False)
    shutil.copytree(straight, crashed)
    shutil.rmtree(crashed / "checkpoints" / "4")  # the save of step 4 never happened
    js.train_model(cfg, output_dir=crashed, steps=4, progress=False)
    read = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["step"] for r in read(crashed)] == [1, 2, 3, 4]
    assert [r["loss"] for r in read(crashed)] == [r["loss"] for r in read(straight)]
    assert not (crashed / LOCK_NAME).exists()


def test_a_locked_output_stops_every_process_of_a_launch(tmp_path, live_pid, monkeypatch):
    """Process 0 holds the lock (the others write no metrics); when it is refused, every
    process stops with one line, none goes on to train."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("XLA_FLAGS", child_env()["XLA_FLAGS"])  # fast compiles, no device count
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config().to_dict()))
    out = tmp_path / "run"
    write_lock(out, pid=live_pid, host=socket.gethostname())
    cli = [sys.executable, "-m", "jaxspeed.cli"]
    proc = subprocess.run(
        [*cli, "launch", "--nproc", "2", "--cpu-devices", "4", "--timeout", "120", "--",
         *cli, "train", str(config), "--output", str(out), "--steps", "2", "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"[rank 0] jaxspeed train: error: output folder {out} is in use" in proc.stderr
    assert f"pid {live_pid}" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
