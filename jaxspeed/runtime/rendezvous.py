"""A start-up barrier before `jax.distributed.initialize`, which names who is missing.

JAX's own barrier (its coordination service's task registration) aborts the process when its
timeout runs out, with a C++ stack trace and no word of which processes never came, and it
says nothing while it waits. This one runs first, on process 0's host: process 0 listens,
every other process connects and says its rank. Each prints a line every `REPORT_SECONDS`
while it waits, naming the address (and, on process 0, the ranks still missing); when the
timeout runs out, process 0 names the ranks that never came and every process stops with one
line. Once all have come, process 0 tells them to go on, and `jax.distributed.initialize`
then finds everyone there.

Where it listens (`barrier_address`): with `jaxspeed launch`'s variables, the coordinator's
port + 1; under SLURM, the step's first node at a port from the job id (SLURM's own
variables: the same on every task, and outside the range JAX's SLURM detection takes its
coordinator port from). Elsewhere there is no barrier, and JAX's own start-up applies.
"""

from __future__ import annotations

import re
import selectors
import socket
import sys
import time

from jaxspeed.errors import JaxspeedError

#: How often a waiting process says so (seconds).
REPORT_SECONDS = 5
_GO = b"go\n"


#: Under SLURM: the barrier's port is `_SLURM_PORTS + job id % 4096`, below the ports JAX's
#: SLURM detection uses for its coordinator (61440 + job id % 4096).
_SLURM_PORTS = 57344


def port_after(address: str) -> str:
    """The barrier's `host:port` for the coordinator `host:port`: its port + 1 (- 1 at the top
    of the range)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise JaxspeedError(f"coordinator address {address!r} is not host:port")
    port = int(port)
    return f"{host}:{port + 1 if port < 65535 else port - 1}"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `n[1-2]` -> `n1`, `node[001,007-015],gpu2` ->
    `node001`, `a,b` -> `a`."""
    prefix, _, rest = nodelist.partition("[")
    if "," in prefix or not rest:
        return prefix.split(",")[0]
    return prefix + re.split(r"[,\-\]]", rest)[0]


def barrier_address(coordinator: str | None, count: int | None, rank: int | None,
                    environ) -> tuple[str, int, int] | None:
    """`(host:port, process count, rank)` of the start-up barrier: from the coordinator and
    the count and rank given (`jaxspeed launch`'s variables), else from SLURM's variables;
    None where neither says (then JAX's own start-up applies)."""
    if coordinator and count is not None and rank is not None:
        return port_after(coordinator), count, rank
    try:
        host = first_host(environ["SLURM_STEP_NODELIST"])
        port = _SLURM_PORTS + int(environ["SLURM_JOB_ID"]) % 4096
        return f"{host}:{port}", int(environ["SLURM_NTASKS"]), int(environ["SLURM_PROCID"])
    except (KeyError, ValueError):
        return None


def rendezvous(address: str, count: int, rank: int, timeout: float, *, out=None) -> None:
    """Waits until all `count` processes have come, or raises after `timeout` seconds.

    Args:
      address: the barrier's `host:port` on process 0's host (`barrier_address`).
      count: the number of processes.
      rank: this process's rank; 0 is the coordinator.
      timeout: seconds to wait.
      out: where the waiting lines go (default stderr).

    Raises:
      JaxspeedError: the timeout ran out: on process 0 naming the ranks that never came, on
        the others naming the coordinator that did not answer.
    """
    if count <= 1:
        return
    out = sys.stderr if out is None else out
    if rank == 0:
        _gather(address, count, timeout, out)
    else:
        _join(address, count, rank, timeout, out)


class _Reporter:
    """Prints `text()` every `REPORT_SECONDS` while a wait lasts."""

    def __init__(self, out, timeout: float):
        self.out, self.timeout = out, timeout
        self.start = self.last = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def tick(self, text: str) -> None:
        if time.monotonic() - self.last >= REPORT_SECONDS:
            self.last = time.monotonic()
            print(f"{text} ({self.elapsed():.0f} s of {self.timeout:.0f} s)", file=self.out,
                  flush=True)


def _gather(address: str, count: int, timeout: float, out) -> None:
    port = int(address.rpartition(":")[2])
    try:
        server = socket.create_server(("", port), reuse_port=False)
    except OSError as err:
        raise JaxspeedError(
            f"process 0 cannot listen on port {port} for the start-up barrier (the "
            f"coordinator's port + 1): {err.strerror or err}") from None
    arrived: dict[int, socket.socket] = {}
    pending: list[socket.socket] = []
    report = _Reporter(out, timeout)
    with server, selectors.DefaultSelector() as selector:
        selector.register(server, selectors.EVENT_READ)
        while len(arrived) < count - 1:
            missing = [r for r in range(1, count) if r not in arrived]
            if report.elapsed() > timeout:
                for conn in [*arrived.values(), *pending]:
                    conn.close()
                raise JaxspeedError(
                    f"ranks that never came to the coordinator at {address} within "
                    f"{timeout:.0f} s: {', '.join(map(str, missing))} (of {count} processes)")
            report.tick(f"process 0 of {count}: waiting at {address} for ranks "
                        f"{', '.join(map(str, missing))}")
            for key, _ in selector.select(timeout=0.5):
                if key.fileobj is server:
                    conn, _ = server.accept()
                    conn.settimeout(5)
                    pending.append(conn)
                    selector.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                selector.unregister(conn)
                pending.remove(conn)
                try:
                    rank = int(conn.recv(32).decode().strip())
                except (OSError, ValueError):
                    conn.close()
                    continue
                arrived[rank] = conn
        for conn in arrived.values():
            with conn:
                conn.sendall(_GO)


def _join(address: str, count: int, rank: int, timeout: float, out) -> None:
    host, _, port = address.rpartition(":")
    report = _Reporter(out, timeout)
    while True:
        if report.elapsed() > timeout:
            raise JaxspeedError(
                f"process {rank} of {count}: the coordinator at {address} did not let the run "
                f"start within {timeout:.0f} s")
        report.tick(f"process {rank} of {count}: waiting for the coordinator at {address}")
        try:
            conn = socket.create_connection((host, port), timeout=1)
        except OSError:
            time.sleep(0.5)
            continue
        with conn:
            _await_go(conn, rank, count, address, report)
            return


def _await_go(conn: socket.socket, rank: int, count: int, address: str, report: _Reporter):
    """Says this process's rank, then waits for process 0's go."""
    try:
        conn.sendall(f"{rank}\n".encode())
    except OSError:
        pass
    conn.settimeout(1.0)
    while report.elapsed() <= report.timeout:
        try:
            answer = conn.recv(8)
        except TimeoutError:
            report.tick(f"process {rank} of {count}: at the coordinator {address}, waiting "
                        "for the other processes")
            continue
        except OSError:
            answer = b""
        if answer == _GO:
            return
        raise JaxspeedError(  # process 0 gave up (it names the missing ranks) or died
            f"process {rank} of {count}: the coordinator at {address} closed the start-up "
            "barrier without starting the run")
    raise JaxspeedError(
        f"process {rank} of {count}: the coordinator at {address} did not let the run start "
        f"within {report.timeout:.0f} s")
