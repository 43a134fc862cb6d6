"""Error types that are part of jaxspeed's interface.

The CLI prints these as one readable message and exits non-zero; anything else is a bug and
keeps its traceback.
"""

import difflib
from collections.abc import Sequence


class JaxspeedError(Exception):
    """Base class for errors caused by user input (config, flags, data paths)."""


class ConfigError(JaxspeedError, ValueError):
    """A config value is missing, malformed or inconsistent. The message names the key path."""


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`" (did you mean 'x'?)"` for the closest of `choices`, or `""` when none is close."""
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


#: The exit code of a run stopped by SIGTERM after it saved a checkpoint (preempted, or out of
#: time): EX_TEMPFAIL of sysexits.h, "try again". `examples/slurm/train.sbatch` requeues the job
#: on it, and the requeued run resumes the checkpoint.
REQUEUE_EXIT_CODE = 75
