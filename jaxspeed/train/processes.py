"""What the processes of one run agree on: a signal seen or a save due at the same step, a save
written or failed, the run folder that process 0 takes for all of them, and the digest of the
samples trained on; and what one says when another is gone."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import jax
import numpy as np

from jaxspeed.checkpoint.state import Checkpointer, CheckpointError, SaveFailedOnAProcess
from jaxspeed.data.sample_digest import START, batch_fingerprint, chained
from jaxspeed.errors import JaxspeedError
from jaxspeed.train.run_dir import run_folder


@contextmanager
def stop_on_signals(*signums: int, received: dict[str, int | None] | None = None):
    """Records `signums` (default SIGTERM and SIGINT) in `received["signum"]` instead of dying,
    so the loop can save first; yields `received` (a new dict when None)."""
    received = {"signum": None} if received is None else received
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        received["signum"] = signum

    previous = {s: signal.signal(s, handler) for s in signums or (signal.SIGTERM, signal.SIGINT)}
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


#: What a collective says when the process at its other end is gone (Gloo's TCP pairs).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
#: The C++ source location Gloo puts in its message.
_SOURCE = re.compile(r"\[[^\]]*\.(cc|h):\d+\] ")


class PeerGone(JaxspeedError):
    """A collective failed because another process is gone (killed, or its node lost). The
    scheduler or `jaxspeed launch` names that rank; this process stops at once (`exit_now`:
    JAX's shutdown would wait for the dead one)."""

    exit_now = True


def peer_gone(err: Exception) -> PeerGone | None:
    """One line for a collective's error that says another process is gone, else None."""
    text = str(err)
    if jax.process_count() == 1 or not any(words in text for words in _PEER_GONE):
        return None
    first = " ".join(_SOURCE.sub("", text.split("\n", 1)[0]).split())
    return PeerGone(f"another process of this run is gone (killed, or its node lost): {first}")


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


def summed(values: Sequence[int]) -> list[int]:
    """Each of `values` (64-bit unsigned) added up over the processes, modulo 2**64; every
    process passes as many values. One all-gather, as two 32-bit halves (JAX without x64)."""
    values = list(values)
    if jax.process_count() == 1 or not values:
        return values
    from jax.experimental import multihost_utils

    halves = np.array([[v >> 32, v & 0xFFFFFFFF] for v in values], dtype=np.uint32)
    seen = np.asarray(multihost_utils.process_allgather(halves)).astype(np.uint64)
    seen = seen.reshape(-1, len(values), 2)
    # uint64 sums wrap around: modulo 2**64, as the fingerprints add
    return [int(v) for v in ((seen[..., 0] << np.uint64(32)) | seen[..., 1]).sum(axis=0)]


class SampleOrder:
    """The digest of the samples trained on so far (`jaxspeed.data.sample_digest`), kept step by
    step: each process adds its rows' share of every step's fingerprint, and `digest()` adds
    up the processes' shares of the steps since its last call and chains them.

    `digest()` is collective: every process calls it at the same steps.

    Args:
      digest: the digest saved with the checkpoint the run resumes (`START` when None: a
        fresh run, or a checkpoint saved before digests were).
      step: the steps already done.
      first_row: this process's first row in each global batch.
    """

    def __init__(self, digest: str | None, *, step: int, first_row: int):
        self._digest = digest or START
        self._step = step
        self._first_row = first_row
        self._pending: list[int] = []

    def add(self, batch: Mapping[str, np.ndarray]) -> None:
        """Counts the next step's batch (this process's rows)."""
        self._pending.append(batch_fingerprint(batch, first_row=self._first_row))

    def digest(self) -> str:
        """The digest after every batch added so far."""
        for fingerprint in summed(self._pending):
            self._step += 1
            self._digest = chained(self._digest, self._step, fingerprint)
        self._pending.clear()
        return self._digest


def settle_save(ckpt: Checkpointer, poll_s: float = 0.05) -> None:
    """Waits until the newest save is written on every process, and stops every process when
    it failed on any (`save_failed`). Orbax's own wait would keep a process whose write went
    through at a barrier for the failed one, until Orbax's timeout (300 s)."""
    while True:
        failed = ckpt.failure()
        running, failed_anywhere = agreed(ckpt.in_progress, failed is not None)
        if failed_anywhere:
            raise save_failed(ckpt, failed)
        if not running:
            return
        time.sleep(poll_s)


def save_failed(ckpt: Checkpointer, failed: BaseException | None) -> BaseException:
    """What a process raises once a save failed on any process (`Checkpointer.failure`): its
    own error, or a line saying that another process's failed. The processes whose writes
    went through wait for the failed one at Orbax's barrier: they stop waiting (`abandon`),
    and with several processes the error is a `SaveFailedOnAProcess`, which the CLI ends at
    once instead of joining Orbax's threads. With one process too: there the threads of the
    failed write (a read-only folder) were joined at exit, until Orbax's timeout (300 s)."""
    ckpt.abandon()
    if not (failed is None or isinstance(failed, CheckpointError)):
        return failed  # a bug in the save: its traceback
    if jax.process_count() == 1:
        failed.exit_now = True  # as `SaveFailedOnAProcess`
        return failed
    if failed is not None:
        return SaveFailedOnAProcess(str(failed))
    step = ckpt.saving
    return SaveFailedOnAProcess(f"stopped: another process could not save step {step} in "
                                f"{ckpt.directory} (its line says why; {ckpt.intact(step)})")
