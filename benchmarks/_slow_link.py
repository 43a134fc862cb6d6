"""A real slow network on one machine: two network namespaces joined by a rate-limited veth pair.

Each end of the pair is limited with the `tbf` queueing discipline (`netem` is not in these
kernels), so a process in namespace A talks to one in namespace B at `rate_mbit`. Gloo
advertises the address the host name resolves to, so each namespace gets its own
`/etc/netns/NS/hosts` (which `ip netns exec` bind-mounts over `/etc/hosts`). The names and the
/24 are drawn afresh for each link and exist only inside the two namespaces; everything is
removed on exit, on an exception, on Ctrl-C, on SIGTERM and on SIGHUP.
`../shared/tools/slow_link.sh` is the recipe this grew from.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

_TOOLS = ("ip", "tc", "taskset")
#: `ip netns exec NS` bind-mounts the files of NETNS_ETC/NS over those of /etc
NETNS_ETC = "/etc/netns"
#: Signals that end a run the way Ctrl-C does, so the `with` block still removes the link.
_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class LinkUnavailable(RuntimeError):
    """This machine cannot build the link (no namespaces, no tbf); the message is one line."""


def unavailable() -> str | None:
    """Why a slow link cannot be built here (one line), or None when it may be."""
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need root"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (iproute2 / util-linux)"
    return None


def _run(*cmd: str) -> None:
    """Runs one setup command; its failure is a `CalledProcessError` carrying its stderr."""
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _run_unchecked(*cmd: str) -> None:
    """Runs one removal command, whose failure (already gone) is no error."""
    subprocess.run(cmd, capture_output=True)


def _first_line(err: subprocess.CalledProcessError) -> str:
    text = (err.stderr or "").strip() or f"exit {err.returncode}"
    return text.splitlines()[0][:200]


class SlowLink:
    """`with SlowLink(100) as link:` two namespaces, `link.namespaces[i]` at `link.addresses[i]`.

    Args:
      rate_mbit: the rate of each direction, Mbit/s; 0 = not shaped.
      burst: tbf's bucket size; latency: tbf's queueing limit (the issue's recipe).

    Raises (on entering):
      LinkUnavailable: namespaces cannot be made here, or tc has no tbf.
      subprocess.CalledProcessError: any later step of the build (nothing is left behind).
    """

    def __init__(self, rate_mbit: float, *, burst: str = "256kb", latency: str = "100ms"):
        if rate_mbit < 0:
            raise ValueError(f"rate must be >= 0 Mbit/s, got {rate_mbit}")
        tag = secrets.token_hex(3)  # interface names: at most 15 characters
        self.rate_mbit = rate_mbit
        self.namespaces = (f"jsnet{tag}a", f"jsnet{tag}b")
        self.veths = (f"jsv{tag}a", f"jsv{tag}b")
        subnet = f"10.213.{secrets.randbelow(250) + 2}"  # a private /24, only inside our namespaces
        self.addresses = (f"{subnet}.1", f"{subnet}.2")
        self._shaping = (burst, latency)
        self._made: list[str] = []  # namespaces made so far: close() removes exactly these
        self._old_handlers: dict[int, object] = {}

    def __enter__(self) -> SlowLink:
        for signum in _SIGNALS:
            self._old_handlers[signum] = signal.signal(signum, _raise_interrupt)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        host = socket.gethostname()
        for ns, address in zip(self.namespaces, self.addresses):
            try:
                _run("ip", "netns", "add", ns)
            except subprocess.CalledProcessError as err:
                if self._made:
                    raise
                raise LinkUnavailable(f"ip netns add failed: {_first_line(err)}") from None
            self._made.append(ns)
            os.makedirs(f"{NETNS_ETC}/{ns}", exist_ok=True)
            with open(f"{NETNS_ETC}/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{address} {host}\n")
        # made inside the first namespace, so removing the namespaces removes the pair
        _run("ip", "-n", self.namespaces[0], "link", "add", self.veths[0], "type", "veth",
             "peer", "name", self.veths[1], "netns", self.namespaces[1])
        for ns, dev, address in zip(self.namespaces, self.veths, self.addresses):
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", dev, "up")
            if self.rate_mbit:
                burst, latency = self._shaping
                try:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                         "tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", burst,
                         "latency", latency)
                except subprocess.CalledProcessError as err:
                    raise LinkUnavailable(f"tc tbf failed: {_first_line(err)}") from None

    def close(self) -> None:
        """Removes the namespaces this link made (and with them the veth pair) and their
        hosts files; restores the signal handlers. Safe to call twice."""
        while self._made:
            ns = self._made.pop()
            _run_unchecked("ip", "netns", "del", ns)
            shutil.rmtree(f"{NETNS_ETC}/{ns}", ignore_errors=True)
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers.clear()

    def popen(self, index: int, cmd: Sequence[str], *, core: int | None = None,
              env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Starts `cmd` inside namespace `index`, pinned to `core` when given, with `env` added
        to this process's environment. `ip`, `env` and `taskset` exec each other, so the
        returned process is `cmd` itself (killing it kills the command)."""
        pin = ["taskset", "-c", str(core)] if core is not None else []
        env_args = [f"{k}={v}" for k, v in (env or {}).items()]
        full = ["ip", "netns", "exec", self.namespaces[index], "env", *env_args, *pin, *cmd]
        return subprocess.Popen(full, **kwargs)

    def tcp_megabytes_per_second(self, seconds: float = 2.0, port: int = 7599) -> float:
        """One TCP stream from namespace 0 to namespace 1 for about `seconds` at the shaped
        rate (256 MB unshaped): MB/s of payload, timed by the receiver from the first byte."""
        size = int(self.rate_mbit * 1e6 / 8 * seconds) if self.rate_mbit else 256_000_000
        receiver = self.popen(1, [sys.executable, "-c", _RECEIVER, str(port)],
                              stdout=subprocess.PIPE, text=True)
        sender = None
        try:
            if receiver.stdout.readline().strip() != "ready":
                raise RuntimeError("the TCP receiver did not start")
            sender = self.popen(0, [sys.executable, "-c", _SENDER, self.addresses[1], str(port),
                                    str(max(size, 1_000_000))])
            sender.wait(timeout=120 + 10 * seconds)
            out, _ = receiver.communicate(timeout=60)
        finally:
            for proc in (receiver, sender):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
        received, elapsed = map(float, out.split())
        return received / elapsed / 1e6


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n, time.perf_counter() - t0)
"""
_SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
left, chunk = int(sys.argv[3]), b"x" * (1 << 20)
while left > 0:
    s.sendall(chunk[:left]); left -= len(chunk)
s.close()
"""
