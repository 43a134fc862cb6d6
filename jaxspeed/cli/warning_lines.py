"""Warnings on the command line: one line each, naming the command, not a source file.

Python prints a warning as its file path, line number, category and source line: four facts
about jaxspeed's internals that a user of `jaxspeed train` cannot act on. Under `one_line`
a warning that jaxspeed raises prints as `jaxspeed train: warning: <message>`; a library's as
`jaxspeed train: warning: <Category> (<package>): <message>`, so its origin stays findable.
The usual filters still decide which warnings show (once per place, by default).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # jaxspeed/


def _is_own(category: type[Warning], filename: str) -> bool:
    """Whether jaxspeed raised it: a jaxspeed warning class, or raised from jaxspeed's code."""
    if category.__module__.split(".")[0] == "jaxspeed":
        return True
    try:
        return Path(filename).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError):
        return False


def _origin(filename: str) -> str:
    """The package a file belongs to (`orbax` for `.../site-packages/orbax/...`), else its name."""
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return Path(parts[parts.index(marker) + 1]).stem
    return Path(filename).stem or "?"


def format_warning(command: str, message: Warning | str, category: type[Warning], filename: str) -> str:
    """The one line `jaxspeed <command>` prints for a warning (its message's lines joined)."""
    text = " ".join(str(message).split())
    if _is_own(category, filename):
        return f"jaxspeed {command}: warning: {text}"
    return f"jaxspeed {command}: warning: {category.__name__} ({_origin(filename)}): {text}"


@contextmanager
def one_line(command: str) -> Iterator[None]:
    """Within it, warnings print as one line each on stderr (see the module docstring)."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        stream = sys.stderr if file is None else file
        try:
            print(format_warning(command, message, category, filename), file=stream, flush=True)
        except (OSError, ValueError):  # stderr closed: a warning is not worth dying for
            pass

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
