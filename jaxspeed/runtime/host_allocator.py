"""Keep freed host memory for reuse, so CPU steps stop paying page faults for their scratch.

XLA:CPU allocates a step's temporaries with `malloc` when the step starts and frees them when
it ends. glibc serves blocks above its mmap threshold (at most 32 MiB) with fresh `mmap`s and
gives them back with `munmap`, and trims freed heap tops back to the OS, so every step faults
its scratch in again, page by page, and the kernel zeroes each page. Measured on a 2-core
EPYC with jax 0.12 (`benchmarks/moe_layer.py`, E = 64): the jaxspeed MoE layer faulted 121 MiB
per step and spent about a third of its time doing so; the one-hot einsum layer faulted 728 MiB.

`keep_freed_memory()` tells glibc, through `mallopt`, to serve every block from its heaps
(`M_MMAP_MAX = 0`), never to trim them (`M_TRIM_THRESHOLD`), and to keep one arena
(`M_ARENA_MAX = 1`, so XLA's worker threads reuse what the step before freed). The process
then holds its high-water mark of host memory, as PyTorch's caching allocator does on a GPU.

It changes the allocator of the whole process and cannot be undone, so the library never
calls it on its own: the `jaxspeed` command applies it first thing (before XLA's threads have
arenas of their own, where it helps most), and so do the benchmarks, before JAX starts; a
script opts in with `jaxspeed.keep_freed_memory()`. `JAXSPEED_HOST_ALLOCATOR=system` leaves
glibc's defaults. Elsewhere (another libc, or no `mallopt`) it does nothing and says so.

`mallopt` reaches only this process. A child process (a baseline timed beside jaxspeed) gets the
same settings as glibc tunables (`TUNABLES`, read by glibc when a process starts) through
`child_env()`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import types
from collections.abc import Mapping

from jaxspeed.errors import JaxspeedError

#: The largest trim threshold `mallopt` takes (an int): 2 GiB, i.e. never in practice.
_NEVER_TRIM = 2**31 - 1
#: glibc tunable name → (`mallopt` parameter from glibc's `malloc.h`, value): the settings.
SETTINGS: Mapping[str, tuple[int, int]] = types.MappingProxyType({
    "mmap_max": (-4, 0),  # M_MMAP_MAX: no block is served by mmap
    "trim_threshold": (-1, _NEVER_TRIM),  # M_TRIM_THRESHOLD: freed heap tops stay
    "arena_max": (-8, 1),  # M_ARENA_MAX: one arena for every thread
})
#: The same settings for `GLIBC_TUNABLES`, which glibc reads when a process starts.
TUNABLES = ":".join(f"glibc.malloc.{name}={value}" for name, (_, value) in SETTINGS.items())
ENV = "JAXSPEED_HOST_ALLOCATOR"
CHOICES = ("cache", "system")
CACHED = "cached host allocator (glibc heap kept, no mmap, one arena)"


@functools.cache
def keep_freed_memory() -> str:
    """Applies the settings above to this process, once; returns what happened, in a few words.

    Call it early (before JAX starts, ideally). It cannot be undone: every later allocation
    of the process keeps its freed memory. `JAXSPEED_HOST_ALLOCATOR=system` makes it a no-op.

    Raises:
      JaxspeedError: `JAXSPEED_HOST_ALLOCATOR` is neither `cache` nor `system`.
    """
    choice = os.environ.get(ENV, "cache")
    if choice not in CHOICES:
        raise JaxspeedError(f"{ENV} must be one of {CHOICES}, got {choice!r}")
    if choice == "system":
        return f"system allocator ({ENV}=system)"
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return "system allocator (no glibc mallopt here)"
    if not all(mallopt(param, value) == 1 for param, value in SETTINGS.values()):
        return "system allocator (mallopt refused)"
    return CACHED


def applied() -> str | None:
    """What `keep_freed_memory` did in this process, or None when it has not been called."""
    return keep_freed_memory() if keep_freed_memory.cache_info().currsize else None


def child_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process that should allocate as this one does.

    A copy of `environ` (default `os.environ`); when this process keeps freed memory
    (`applied()` is the cached allocator), `TUNABLES` are added to `GLIBC_TUNABLES`.
    """
    env = dict(os.environ if environ is None else environ)
    if applied() == CACHED:
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), TUNABLES]))
    return env


def _glibc_mallopt():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
