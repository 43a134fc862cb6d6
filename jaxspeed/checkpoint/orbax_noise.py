"""What Orbax and TensorStore print around a failed read or write, reduced to jaxspeed's line.

A truncated checkpoint or a full disk is the user's storage, not a bug, and jaxspeed reports
it as one line (`checkpoint.state`). Around it, Orbax logs each failed write with its
traceback at ERROR, and TensorStore's reads or writes still in flight call Orbax's closed
event loop, each leaving a "RuntimeError: Event loop is closed" traceback. This module drops
those two kinds of output, and only those.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The storage's own reasons, as the OS words them (TensorStore quotes them, through Orbax,
#: in a ValueError such as `RESOURCE_EXHAUSTED: ... [OS error 28: No space left on device]`).
_OS_REASONS = ("No space left on device", "Read-only file system", "Permission denied",
               "Disk quota exceeded")
#: TensorStore's status codes for them, when the OS words are missing.
_STATUS_REASONS = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED")


def storage_reason(err: BaseException) -> str | None:
    """Why the storage refused a write (disk full, read-only, ...), in one short phrase, or
    None when `err` is not the storage's. Every process that hits a full disk words it the
    same way, whichever of its files TensorStore was writing."""
    if isinstance(err, OSError):
        return f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
    text = str(err)
    for reason in _OS_REASONS:
        if reason in text:
            return reason
    if any(status in text for status in _STATUS_REASONS):
        return " ".join(text.split("\n", 1)[0].split())[:300]
    return None


#: TensorStore's words for a read past a file's end: with the file, or with the OCDBT folder
#: it read and the size of the file it found.
_FILE_RANGE = re.compile(r'[Bb]yte range \[(\d+), (\d+)\) of local file "([^"]+)"')
_PAST_END = re.compile(r"byte range \[(\d+), (\d+)\) is not valid for value of size (\d+)")
_DATABASE = re.compile(r'at local file "([^"]+)"')


def torn_file(reason: str) -> str | None:
    """The data file a failed OCDBT read ran past the end of, in words, or None.

    TensorStore names either that file, or the array, the OCDBT folder and the byte range it
    needed from "a value of size N": its data files are named by hashes. Then the file is the
    one under that folder of N bytes (with several of that size, the first, and how many
    more).
    """
    if named := _FILE_RANGE.search(reason):
        path = Path(named.group(3))
        size = path.stat().st_size if path.is_file() else 0
        return f"file {path} is {size} bytes, the read needs bytes {named.group(1)} to {named.group(2)}"
    past_end, database = _PAST_END.search(reason), _DATABASE.search(reason)
    if not (past_end and database and Path(database.group(1)).is_dir()):
        return None
    first, end, size = (int(g) for g in past_end.groups())
    short = sorted(f for f in Path(database.group(1)).rglob("*")
                   if f.is_file() and f.stat().st_size == size)
    if not short:
        return None
    more = f" (and {len(short) - 1} more of that size)" if len(short) > 1 else ""
    return f"file {short[0]} is {size} bytes, the read needs bytes {first} to {end}{more}"


class _StorageErrorsReported(logging.Filter):
    """Drops Orbax's ERROR records of a write the storage refused (each with its traceback,
    one per array and thread); jaxspeed's own line names the step, the reason and the newest
    intact checkpoint.

    It also keeps each one's error (`failed_write`). With several processes that record is
    the only prompt sign of a failed background write: Orbax's threads on the failed process
    then wait at a barrier for the others, which wait for it, so neither raises until Orbax's
    timeout (300 s).
    """

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, BaseException]] = []  # (the record's text, its error)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or "orbax" not in record.pathname:
            return True
        error = (record.exc_info[1] if record.exc_info else None) or Exception(record.getMessage())
        if storage_reason(error) is None:
            return True
        if len(self.seen) < 64:
            self.seen.append((f"{record.getMessage()} {error}", error))
        return False


_FILTER = _StorageErrorsReported()


def quiet_storage_errors() -> int:
    """Installs the filter on absl's logger, which Orbax logs to (once per process). Returns
    how many failed writes it has seen so far: `failed_write`'s `since`."""
    logger = logging.getLogger("absl")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return len(_FILTER.seen)


def failed_write(directory: Path, *, since: int = 0) -> BaseException | None:
    """The error of a write under `directory` that Orbax logged as failed by the storage, among
    those seen after the first `since` (`quiet_storage_errors`), or None."""
    for text, error in _FILTER.seen[since:]:
        if str(directory) in text:
            return error
    return None


@contextmanager
def orphaned_reads_quiet(settle_s: float = 0.25) -> Iterator[None]:
    """Drops the "Event loop is closed" tracebacks a failed Orbax read or write leaves behind.

    When a read fails, Orbax closes its event loop while TensorStore still has reads in
    flight; each one that finishes later calls the closed loop, and Python prints the
    RuntimeError through `sys.unraisablehook` beside the real error (dozens of tracebacks for
    one truncated file). A write that fails on a full disk does the same. Within this context
    those are dropped; any other unraisable error still goes to the previous hook. On a
    failure the hook stays `settle_s` longer: the orphaned reads land after the error has left
    Orbax (within 3 ms of it, measured on a truncated local checkpoint).
    """
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        closed = unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
        if not closed:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    except BaseException:
        time.sleep(settle_s)
        raise
    finally:
        sys.unraisablehook = previous
