"""Progress that reaches a log: a tqdm bar on a terminal, plain lines at a steady interval elsewhere.

Without a terminal (CI, nohup, a SLURM log) a redrawn bar is either invisible or a wall of
carriage returns, so `Progress` prints one plain line every `interval()` seconds instead, with
tqdm's own counts, rate and ETA, and a last line at the end. `phase` does the same for work
that has no count (compiling, a search): a line when it starts, a heartbeat while it runs, and
its time when it ends.

`JAXSPEED_PROGRESS_SECONDS` sets the interval of the plain lines (default 30).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import IO, Iterator

from tqdm import tqdm

DEFAULT_INTERVAL = 30.0
_LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
_OPEN_FORMAT = "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]"


def interval() -> float:
    """Seconds between the plain progress lines (`JAXSPEED_PROGRESS_SECONDS`, default 30)."""
    value = os.environ.get("JAXSPEED_PROGRESS_SECONDS", "")
    try:
        seconds = float(value) if value else DEFAULT_INTERVAL
    except ValueError:
        seconds = DEFAULT_INTERVAL
    return seconds if seconds > 0 else DEFAULT_INTERVAL


def is_terminal(stream: IO[str] | None = None) -> bool:
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    """A counter shown as a tqdm bar on a terminal, or as a plain line every `interval()` s.

    Args:
      total: the count at completion (None when unknown).
      desc: what is counted, e.g. "train".
      unit: the unit of the count, e.g. "step".
      initial: the count already done (a resumed run).
      enabled: False shows nothing (a process other than the first, `--no-progress`).
      terminal: force the bar (True) or the plain lines (False); default: whether `stream` is a TTY.
      stream: where to write (default stderr).
      quiet: without a terminal, no closing line for work shorter than one `interval()` (a
        small conversion says nothing).
    """

    def __init__(self, total: int | None, *, desc: str, unit: str = "it", initial: int = 0,
                 enabled: bool = True, terminal: bool | None = None, stream: IO[str] | None = None,
                 unit_scale: bool = False, quiet: bool = False):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.terminal = is_terminal(self.stream) if terminal is None else terminal
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.quiet = quiet
        self.n = self.initial = initial
        self.postfix: dict[str, str] = {}
        self._start = self._last = time.monotonic()
        self._printed = initial  # the count of the last plain line
        self._bar = None
        if enabled and self.terminal:
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit,
                             unit_scale=unit_scale, file=self.stream)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and time.monotonic() - self._last >= interval():
            self._print_line()

    def set_postfix(self, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}
        if self._bar is not None:
            self._bar.set_postfix(self.postfix, refresh=False)

    def write(self, text: str) -> None:
        """A message line that does not break the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def line(self) -> str:
        """The plain progress line for the count so far."""
        postfix = ", ".join(f"{k}={v}" for k, v in self.postfix.items())
        return tqdm.format_meter(
            self.n, self.total, time.monotonic() - self._start, prefix=self.desc, unit=self.unit,
            unit_scale=self.unit_scale, initial=self.initial, postfix=postfix or None,
            bar_format=_LINE_FORMAT if self.total else _OPEN_FORMAT,
        )

    def _print_line(self) -> None:
        self._last, self._printed = time.monotonic(), self.n
        print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self.n > self._printed and not (
                self.quiet and time.monotonic() - self._start < interval()):
            self._print_line()
        self.enabled = False


class Phase:
    """What `phase` yields: `desc` may change while it runs (the end line says the new one)."""

    def __init__(self, desc: str):
        self.desc = desc


@contextmanager
def phase(desc: str, *, enabled: bool = True, terminal: bool | None = None,
          stream: IO[str] | None = None, quiet: bool = False) -> Iterator[Phase]:
    """Reports a long step that has no count: "desc ...", a heartbeat, then its time.

    On a terminal it prints the start and end lines only; elsewhere it also prints
    "desc: still running (Ns)" every `interval()` seconds, so a log shows the process is alive.
    `quiet`: no start line, and the end line only when the step ran past one `interval()`.
    Yields a `Phase`: set its `desc` when the step turned out to be another (a fallback).
    """
    stream = sys.stderr if stream is None else stream
    current = Phase(desc)
    if not enabled:
        yield current
        return
    heartbeat = not (is_terminal(stream) if terminal is None else terminal)
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(interval()):
            print(f"{current.desc}: still running ({time.monotonic() - start:.0f}s)", file=stream, flush=True)

    if not quiet:
        print(f"{desc} ...", file=stream, flush=True)
    thread = threading.Thread(target=beat, daemon=True) if heartbeat else None
    if thread is not None:
        thread.start()
    try:
        yield current
    finally:
        done.set()
        if thread is not None:
            thread.join()
    if not (quiet and time.monotonic() - start < interval()):
        print(f"{current.desc}: done in {time.monotonic() - start:.1f}s", file=stream, flush=True)
