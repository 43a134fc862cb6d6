"""The run folder of `jaxspeed train --output`: created before anything starts, one writer at a time.

Two runs writing one folder interleave their checkpoints and metrics, so the process that
writes (process 0) holds `OUTPUT/jaxspeed.lock` for as long as the run lasts. The lock is a
small JSON file, `{"pid", "host", "started"}`, created with `O_EXCL`; it is removed when the
run ends, an exception included. A lock left by a process that died without removing it
(`kill -9`, a lost node) is:

- taken over, with a warning, when it names this host and a pid that is not running (or this
  process's own pid: a container restarted under the same pid and hostname);
- taken over, with a warning, when it names this SLURM job (`SLURM_JOB_ID`) and an earlier
  run of it (`SLURM_RESTART_COUNT`): SLURM ended every step of a job before it requeued it,
  and the requeued job may run on other nodes;
- refused when it names another host, whose processes cannot be checked from here: the
  message says which file to delete once that run is known to be gone.

A folder that cannot be created (`/sys/foo`, a path under a regular file, no permission) is a
`ConfigError` naming it, before the model is initialized or anything compiles.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jaxspeed.errors import ConfigError, JaxspeedError

#: The lock's file name inside the run folder.
LOCK_NAME = "jaxspeed.lock"


class RunFolderBusy(JaxspeedError):
    """Another `jaxspeed train` holds the run folder's lock (or may: on another host)."""


def make_run_folder(path: Path) -> bool:
    """Creates `path` (and its parents) when missing; returns whether it did.

    Raises:
      ConfigError: `path` cannot be created or is not a writable folder, with the OS's reason.
    """
    existed = path.is_dir()
    if path.exists() and not existed:
        raise ConfigError(f"output folder {path} (--output) is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"output folder {path} (--output) cannot be created: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"output folder {path} (--output) is not writable")
    return not existed


def _pid_running(pid: int) -> bool:
    """Whether a process `pid` exists on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_holder(lock: Path) -> dict[str, Any] | None:
    """The lock's `{"pid", "host", "started"}`; None when it vanished; `{}` when unreadable."""
    try:
        text = lock.read_text()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:  # cut short by a crash while it was written
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    started = holder.get("started")
    since = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if isinstance(
        started, (int, float)) else ""
    job = f", SLURM job {holder['slurm_job']}" if "slurm_job" in holder else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{job}{since}"


def _slurm_run() -> tuple[str, int] | None:
    """This process's SLURM job and how often it was requeued before, or None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return job, int(restarts) if restarts.isdigit() else 0


def _earlier_run_of_this_job(holder: dict[str, Any]) -> bool:
    """Whether the lock was taken by an earlier run of this SLURM job (before a requeue)."""
    ours = _slurm_run()
    theirs = holder.get("slurm_job"), holder.get("slurm_restart")
    if ours is None or theirs[0] != ours[0] or not isinstance(theirs[1], int):
        return False
    return theirs[1] < ours[1]


def _is_stale(holder: dict[str, Any], host: str) -> bool:
    """Whether the lock's holder is certainly gone: this host, and its pid not running (or ours);
    or an earlier run of this SLURM job."""
    if _earlier_run_of_this_job(holder):
        return True
    pid = holder.get("pid")
    if holder.get("host") != host or not isinstance(pid, int):
        return False
    return pid == os.getpid() or not _pid_running(pid)


def _create(lock: Path, host: str) -> bool:
    """Creates the lock naming this process (and its SLURM job); False when it exists already."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError as err:  # root passes `os.access` where the file system refuses (/sys)
        raise ConfigError(f"output folder {lock.parent} (--output) is not writable: "
                          f"{err.strerror or err}") from None
    holder: dict[str, Any] = {"pid": os.getpid(), "host": host, "started": time.time()}
    slurm = _slurm_run()
    if slurm is not None:
        holder["slurm_job"], holder["slurm_restart"] = slurm
    with os.fdopen(fd, "w") as f:
        json.dump(holder, f)
    return True


def _take_over(lock: Path, holder: dict[str, Any]) -> bool:
    """Removes the stale lock `holder` was read from; False when another process took it first.

    The lock is renamed aside before it is judged again, so of two runs that both found it
    stale, only one removes it, and a fresh lock written in between is put back.
    """
    aside = lock.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return False
    if _read_holder(aside) != holder:  # not the one judged stale: give it back
        try:
            os.link(aside, lock)
        except FileExistsError:
            pass
        aside.unlink()
        return False
    aside.unlink()
    return True


def acquire_lock(folder: Path) -> Path:
    """Takes `folder`'s run lock for this process; returns the lock's path.

    Raises:
      RunFolderBusy: a live run on this host, or any run on another host, holds it.
    """
    lock = folder / LOCK_NAME
    host = socket.gethostname()
    for _ in range(10):  # another run may take, write or drop it between our reads
        if _create(lock, host):
            return lock
        holder = _read_holder(lock)
        if holder is None:  # its run ended between our create and read
            continue
        if not holder:  # being written, or cut short by a crash: look again
            time.sleep(0.1)
            continue
        if _is_stale(holder, host):
            if _take_over(lock, holder):
                which = ("this SLURM job's run before its requeue" if _earlier_run_of_this_job(
                    holder) else "a run that is no longer running")
                print(f"jaxspeed train: warning: taking over the lock of {folder} from {which} "
                      f"({_describe(holder)})", file=sys.stderr)
            continue
        if holder.get("host") == host:
            raise RunFolderBusy(
                f"output folder {folder} is in use by another jaxspeed train "
                f"({_describe(holder)}); wait for it to end or use another --output")
        raise RunFolderBusy(
            f"output folder {folder} is locked by a jaxspeed train on another host "
            f"({_describe(holder)}), which cannot be checked from {host}; if that run has "
            f"ended, delete {lock}")
    raise RunFolderBusy(
        f"output folder {folder} has a lock that cannot be read or taken ({lock}); if no "
        f"jaxspeed train is writing there, delete it")


def release_lock(lock: Path) -> None:
    """Removes `lock` when it is still this process's (a run that took it over keeps its own)."""
    holder = _read_holder(lock)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)


@contextmanager
def run_folder(path: str | Path) -> Iterator[Path]:
    """Creates the run folder and holds its lock while the `with` block runs.

    On the way out the lock is released, and the folder is removed again when this run
    created it and left nothing there (a refused plan, Ctrl-C before the first save).

    Raises:
      ConfigError: the folder cannot be created.
      RunFolderBusy: another run holds it.
    """
    folder = Path(path)
    created = make_run_folder(folder)
    try:
        lock = acquire_lock(folder)
    except BaseException:
        if created and not any(folder.iterdir()):
            folder.rmdir()
        raise
    try:
        yield folder
    finally:
        release_lock(lock)
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
