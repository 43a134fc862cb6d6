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

It changes the allocator of the whole process and cannot be undone. The `jaxspeed` command
applies it first thing (before XLA's threads have arenas of their own, where it helps most),
`initialize` on the CPU backend, and the benchmarks before JAX starts, so a baseline timed
beside jaxspeed runs under it too. `JAXSPEED_HOST_ALLOCATOR=system` leaves glibc's defaults.
Elsewhere (another libc, or no `mallopt`) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

from jaxspeed.errors import JaxspeedError

#: `mallopt` parameters, from glibc's `malloc.h`.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
#: The largest trim threshold `mallopt` takes (an int): 2 GiB, i.e. never in practice.
_NEVER_TRIM = 2**31 - 1
ENV = "JAXSPEED_HOST_ALLOCATOR"
CHOICES = ("cache", "system")


@functools.cache
def keep_freed_memory() -> str:
    """Applies the settings above once per process; returns what happened, in a few words."""
    choice = os.environ.get(ENV, "cache")
    if choice not in CHOICES:
        raise JaxspeedError(f"{ENV} must be one of {CHOICES}, got {choice!r}")
    if choice == "system":
        return f"system allocator ({ENV}=system)"
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return "system allocator (no glibc mallopt here)"
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM), (_M_ARENA_MAX, 1))
    if not all(mallopt(param, value) == 1 for param, value in settings):
        return "system allocator (mallopt refused)"
    return "cached host allocator (glibc heap kept, no mmap, one arena)"


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
