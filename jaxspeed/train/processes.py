"""What the processes of one run agree on: a signal seen or a save due at the same step, and
the run folder that process 0 takes for all of them."""

from __future__ import annotations

import signal
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path

import jax
import numpy as np

from jaxspeed.errors import JaxspeedError
from jaxspeed.train.run_dir import run_folder


@contextmanager
def stop_on_signals():
    """Records SIGTERM/SIGINT instead of dying, so the loop can save first."""
    received: dict[str, int | None] = {"signum": None}
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        received["signum"] = signum

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def agreed(*flags: bool) -> tuple[bool, ...]:
    """Each flag, True on every process if it is True on any (a signal seen, a save due by the
    clock), so all of them stop or save at the same step. One all-gather for all the flags."""
    if jax.process_count() == 1:
        return flags
    from jax.experimental import multihost_utils

    seen = multihost_utils.process_allgather(np.array(flags, dtype=bool))
    return tuple(bool(x) for x in np.asarray(seen).reshape(-1, len(flags)).any(axis=0))


@contextmanager
def shared_run_folder(output_dir: Path, *, writer: bool):
    """The run folder, created and locked by the process that writes it (process 0) while the
    run lasts (`jaxspeed.train.run_dir`). The others wait for its verdict, so every process
    stops when it is refused."""
    with ExitStack() as held:
        failed: JaxspeedError | None = None
        if writer:
            try:
                held.enter_context(run_folder(output_dir))
            except JaxspeedError as err:
                failed = err
        (refused,) = agreed(failed is not None)
        if failed is not None:
            raise failed
        if refused:
            raise JaxspeedError(f"process 0 could not take the output folder {output_dir} (its error says why)")
        yield
