"""`jaxspeed launch`: N processes of one command on this machine, wired for `jax.distributed`.

Each child gets the coordinator address (127.0.0.1 and a free port), the process count and its
rank in `JAXSPEED_*` environment variables, which `jaxspeed.runtime.distributed.initialize()` reads.
With `cpu_devices=K`, each child runs on the CPU platform with K emulated devices and gloo
collectives, so N processes form one mesh of N*K devices.

The launcher streams every child's output with a `[rank i]` prefix. When a child exits
non-zero it stops the others (SIGTERM, then SIGKILL after a grace period) and reports the rank,
its exit code and its last error line. SIGINT / SIGTERM sent to the launcher are forwarded to
the children. It never waits forever: the children's start-up barrier has a timeout, and an
optional overall timeout ends everything.
"""

from __future__ import annotations

import collections
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from jaxspeed.runtime.distributed import (
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_INIT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from jaxspeed.errors import REQUEUE_EXIT_CODE, JaxspeedError

DEFAULT_INIT_TIMEOUT = 120  # seconds for the children's start-up barrier
DEFAULT_GRACE = 10.0  # seconds between SIGTERM and SIGKILL
EXIT_TIMEOUT = 124  # like coreutils `timeout`
_TAIL_LINES = 100  # enough to reach past a native stack trace to its fatal line
_ABSL_PREFIX = re.compile(r"^[FEWI]\d{4} [\d:.]+\s+\d+ [^\]\s]+\] ")
_ERRORISH = re.compile(r"error|exception|fatal|terminat|abort|failed|exceeded|killed", re.I)
_STACK_FRAME = re.compile(r"^(@\s+0x|\*\*\* |File \"|Traceback \(most recent call last\))")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it when binding port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def child_env(
    base: Mapping[str, str],
    *,
    coordinator: str,
    nproc: int,
    rank: int,
    cpu_devices: int | None = None,
    init_timeout: int = DEFAULT_INIT_TIMEOUT,
) -> dict[str, str]:
    """The environment of child `rank`: `base` plus the `JAXSPEED_*` wiring.

    With `cpu_devices`, also JAX's own variables for K emulated CPU devices with gloo
    collectives, so a plain script that calls `jax.distributed.initialize` works too.
    """
    env = dict(base)
    env.update({
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(nproc),
        ENV_PROCESS_ID: str(rank),
        ENV_INIT_TIMEOUT: str(init_timeout),
        "PYTHONUNBUFFERED": "1",  # prefixed lines appear as they are printed
    })
    if cpu_devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={cpu_devices}")
        env.update({
            ENV_CPU_DEVICES: str(cpu_devices),
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(cpu_devices),
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "XLA_FLAGS": " ".join(flags),
        })
    return env


@dataclass
class _Child:
    rank: int
    proc: subprocess.Popen
    readers: list[threading.Thread]
    tail: collections.deque  # last stderr lines
    out_tail: collections.deque  # last stdout lines


def _pump(stream, sink: TextIO, prefix: str, tail: collections.deque, lock):
    """Copies `stream` line by line to `sink` with `prefix`, keeping the last lines in `tail`."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if line.strip():
            tail.append(line)
        with lock:
            sink.write(f"{prefix}{line}\n")
            sink.flush()
    stream.close()


def last_error_line(lines: Sequence[str]) -> str | None:
    """The last line of a process's output that looks like an error, or None.

    Python exceptions and absl fatal log lines count (the `F1130 12:00:00.000 123 file.cc:80]`
    prefix is dropped); native stack-trace frames and traceback headers are skipped.
    """
    cleaned = [_ABSL_PREFIX.sub("", line.strip()) for line in lines if line.strip()]
    for line in reversed(cleaned):
        if _ERRORISH.search(line) and not _STACK_FRAME.match(line):
            return _shorten(line)
    return None


def _shorten(line: str, limit: int = 400) -> str:
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _last_words(child: _Child) -> str:
    """'its last error line: ...', else its last output line, for the failure message."""
    for lines in (child.tail, child.out_tail):
        line = last_error_line(lines)
        if line is not None:
            return f"its last error line: {line}"
    lines = child.tail or child.out_tail
    return f"its last output line: {_shorten(lines[-1].strip())}" if lines else "it printed nothing"


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Launcher:
    def __init__(self, command, *, nproc, cpu_devices, init_timeout, grace, stdout, stderr, env):
        self.command = list(command)
        self.nproc = nproc
        self.cpu_devices = cpu_devices
        self.init_timeout = init_timeout
        self.grace = grace
        self.stdout, self.stderr = stdout, stderr
        self.env = os.environ if env is None else env
        self.lock = threading.RLock()  # the signal handler may say() while main holds it
        self.exits: queue.Queue = queue.Queue()  # (rank, returncode) in the order they end
        self.children: list[_Child] = []
        self.signalled: int | None = None

    def say(self, message: str) -> None:
        with self.lock:
            self.stderr.write(f"jaxspeed launch: {message}\n")
            self.stderr.flush()

    def start(self) -> None:
        coordinator = f"127.0.0.1:{free_port()}"
        for rank in range(self.nproc):
            env = child_env(
                self.env, coordinator=coordinator, nproc=self.nproc, rank=rank,
                cpu_devices=self.cpu_devices, init_timeout=self.init_timeout,
            )
            try:
                proc = subprocess.Popen(
                    self.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True,
                )
            except OSError as err:
                self.kill_all()
                raise JaxspeedError(f"cannot start {self.command[0]!r}: {err.strerror}") from err
            child = _Child(rank, proc, [], collections.deque(maxlen=_TAIL_LINES),
                           collections.deque(maxlen=_TAIL_LINES))
            prefix = f"[rank {rank}] "
            for stream, sink, tail in ((proc.stdout, self.stdout, child.out_tail),
                                       (proc.stderr, self.stderr, child.tail)):
                reader = threading.Thread(
                    target=_pump, args=(stream, sink, prefix, tail, self.lock), daemon=True
                )
                reader.start()
                child.readers.append(reader)
            threading.Thread(target=self._wait, args=(child,), daemon=True).start()
            self.children.append(child)

    def _wait(self, child: _Child) -> None:
        self.exits.put((child.rank, child.proc.wait()))

    def signal_all(self, signum: int) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                try:
                    os.killpg(child.proc.pid, signum)  # the child's own session: its whole group
                except ProcessLookupError:
                    pass

    def kill_all(self) -> None:
        """SIGTERM to every live child, SIGKILL to those still alive after the grace period."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.children):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for child in self.children:
            child.proc.wait()

    def _flush(self, child: _Child) -> None:
        for reader in child.readers:
            reader.join(timeout=2.0)

    def run(self, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        done = 0
        codes: list[int] = []
        forward_deadline = None
        while done < self.nproc:
            if self.signalled is not None and forward_deadline is None:
                forward_deadline = time.monotonic() + self.grace
            try:
                rank, code = self.exits.get(timeout=0.1)
            except queue.Empty:
                now = time.monotonic()
                if forward_deadline is not None and now > forward_deadline:
                    self.signal_all(signal.SIGKILL)
                    forward_deadline = float("inf")
                if deadline is not None and now > deadline:
                    alive = [c.rank for c in self.children if c.proc.poll() is None]
                    self.say(f"timed out after {timeout:g} s; stopping ranks {alive}")
                    self.kill_all()
                    return EXIT_TIMEOUT
                continue
            done += 1
            codes.append(code)
            if code == 0:
                continue
            if self.signalled is not None:  # told to stop: let the others finish within grace
                continue
            child = self.children[rank]
            self._flush(child)
            others = [c.rank for c in self.children if c.proc.poll() is None]
            self.say(f"rank {rank} {_describe_exit(code)}; {_last_words(child)}")
            if any("RegisterTask" in line for line in child.tail):
                self.say(
                    f"(the start-up barrier timed out: not every rank reached "
                    f"jax.distributed.initialize within {self.init_timeout} s; see --init-timeout)"
                )
            if others:
                self.say(f"stopping the other ranks {others}")
            self.kill_all()
            return code if code > 0 else 128 - code
        for child in self.children:
            self._flush(child)
        if self.signalled is None:
            return 0
        if set(codes) == {REQUEUE_EXIT_CODE}:  # every rank saved its checkpoint: requeue it
            return REQUEUE_EXIT_CODE
        return 128 + self.signalled


def launch(
    command: Sequence[str],
    *,
    nproc: int,
    cpu_devices: int | None = None,
    timeout: float | None = None,
    init_timeout: int = DEFAULT_INIT_TIMEOUT,
    grace: float = DEFAULT_GRACE,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Runs `nproc` copies of `command` wired for `jax.distributed`; returns the exit code.

    Args:
      command: program and arguments, e.g. `["jaxspeed", "train", "cfg.yaml"]`.
      nproc: number of processes (ranks 0 .. nproc-1).
      cpu_devices: emulated CPU devices per process (None: the platform's own devices).
      timeout: seconds after which every child is stopped (None: no limit).
      init_timeout: seconds the children's `jax.distributed` start-up barrier waits.
      grace: seconds between SIGTERM and SIGKILL when stopping children.
      stdout: where children's stdout goes, line-prefixed (default `sys.stdout`).
      stderr: where children's stderr and the launcher's messages go (default `sys.stderr`).
      env: base environment of the children (default `os.environ`).

    Returns:
      0 when every child exited 0; the failing child's exit code (128 + signal number when
      it was killed by a signal) when one failed; 124 on `timeout`; 75
      (`REQUEUE_EXIT_CODE`) when the launcher got SIGTERM and every child exited 75 (each
      `jaxspeed train` saved its checkpoint); else 128 + signal number when the launcher
      got SIGINT / SIGTERM (forwarded to the children, which get `grace`
      seconds to exit before SIGKILL).

    Raises:
      JaxspeedError: for an empty command, `nproc` < 1, `cpu_devices` < 1, non-positive
        timeouts, or a command that cannot be started.
    """
    command = list(command)
    if not command:
        raise JaxspeedError(
            "no command given; usage: jaxspeed launch --nproc N [--cpu-devices K] -- COMMAND ..."
        )
    if nproc < 1:
        raise JaxspeedError(f"--nproc must be >= 1, got {nproc}")
    if cpu_devices is not None and cpu_devices < 1:
        raise JaxspeedError(f"--cpu-devices must be >= 1, got {cpu_devices}")
    if timeout is not None and timeout <= 0:
        raise JaxspeedError(f"--timeout must be > 0 seconds, got {timeout:g}")
    if init_timeout < 1:
        raise JaxspeedError(f"--init-timeout must be >= 1 second, got {init_timeout}")
    launcher = _Launcher(
        command, nproc=nproc, cpu_devices=cpu_devices, init_timeout=init_timeout, grace=grace,
        stdout=stdout or sys.stdout, stderr=stderr or sys.stderr, env=env,
    )
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}

    def forward(signum, _frame):
        launcher.signalled = signum
        launcher.say(f"got {signal.Signals(signum).name}; forwarding it to every rank")
        launcher.signal_all(signum)

    if in_main:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, forward)
    try:
        launcher.start()
        return launcher.run(timeout)
    except BaseException:
        launcher.kill_all()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
