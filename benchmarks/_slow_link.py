"""A real slow network on one machine: two network namespaces joined by a rate-limited veth pair.

Each end of the pair is limited with the `tbf` queueing discipline (`netem` is not in these
kernels), so a process in namespace A talks to one in namespace B at `rate_mbit`. Gloo
advertises the address the host name resolves to, so each namespace gets its own
`/etc/netns/NS/hosts` (which `ip netns exec` bind-mounts over `/etc/hosts`). Names and the /24
are unique to this process; everything is removed on exit, on an exception, on Ctrl-C and on
SIGTERM. `../shared/tools/slow_link.sh` is the recipe this grew from.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence

_TOOLS = ("ip", "tc", "taskset")


def unavailable() -> str | None:
    """Why a slow link cannot be built here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need root"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (iproute2 / util-linux)"
    return None


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class SlowLink:
    """`with SlowLink(100) as link:` two namespaces, `link.namespaces[i]` at `link.addresses[i]`.

    Args:
      rate_mbit: the rate of each direction, Mbit/s; 0 = not shaped.
      burst: tbf's bucket size; latency: tbf's queueing limit.
    """

    def __init__(self, rate_mbit: float, *, burst: str = "256kb", latency: str = "100ms"):
        if rate_mbit < 0:
            raise ValueError(f"rate must be >= 0 Mbit/s, got {rate_mbit}")
        tag = f"{os.getpid() % 100000}"
        self.rate_mbit = rate_mbit
        self.namespaces = (f"jsA{tag}", f"jsB{tag}")
        subnet = 10, 213, os.getpid() % 250
        self.addresses = tuple(".".join(map(str, (*subnet, i))) for i in (1, 2))
        self._veth = (f"jsa{tag}", f"jsb{tag}")
        self._shaping = (burst, latency)
        self._old_term = None

    def __enter__(self) -> SlowLink:
        self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
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
            _run("ip", "netns", "add", ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{address} {host}\n")
        a, b = self._veth
        _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        for ns, dev, address in zip(self.namespaces, self._veth, self.addresses):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", dev, "up")
            if self.rate_mbit:
                burst, latency = self._shaping
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", f"{self.rate_mbit:g}mbit", "burst", burst, "latency", latency)

    def close(self) -> None:
        """Removes both namespaces (and with them the veth pair) and their hosts files."""
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def popen(self, index: int, cmd: Sequence[str], *, core: int | None = None, env=None,
              **kwargs) -> subprocess.Popen:
        """Starts `cmd` inside namespace `index`, pinned to `core` when given."""
        pin = ["taskset", "-c", str(core)] if core is not None else []
        full = ["ip", "netns", "exec", self.namespaces[index], "env", *_env_args(env), *pin, *cmd]
        return subprocess.Popen(full, **kwargs)

    def tcp_megabytes_per_second(self, megabytes: float = 4.0, port: int = 7599) -> float:
        """One TCP stream from namespace 0 to namespace 1: MB/s of payload."""
        size = int(megabytes * 1e6)
        receiver = self.popen(1, ["python3", "-c", _RECEIVER, str(port)], stdout=subprocess.PIPE,
                              text=True)
        time.sleep(0.5)
        sender = self.popen(0, ["python3", "-c", _SENDER, self.addresses[1], str(port), str(size)])
        sender.wait(timeout=600)
        out, _ = receiver.communicate(timeout=600)
        received, seconds = map(float, out.split())
        return received / seconds / 1e6


def _env_args(env) -> list[str]:
    return [f"{k}={v}" for k, v in (env or {}).items()]


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1)
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
s.sendall(b"x" * int(sys.argv[3])); s.close()
"""
