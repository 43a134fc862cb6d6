"""The cached host allocator: freed blocks are reused without page faults; opt-out and bad values."""

import os
import subprocess
import sys
import textwrap

import pytest

from jaxspeed.errors import JaxspeedError
from jaxspeed.runtime.host_allocator import ENV, keep_freed_memory

#: In a fresh process (the allocator settings are per process and cannot be undone): apply the
#: setting, then free and re-allocate a 64 MiB block ten times, touching every page each time;
#: print the minor page faults of the last nine rounds and the setting's own description.
_PROBE = textwrap.dedent("""
    import ctypes, resource, sys
    from jaxspeed.runtime.host_allocator import keep_freed_memory
    said = keep_freed_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    size, faults = 64 << 20, 0
    for round_ in range(10):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        if round_:
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
    print(faults // 9, said, sep="\\n")
""")
PAGES_64_MIB = (64 << 20) // 4096


def _probe(choice: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, env={**os.environ, ENV: choice}).stdout.splitlines()
    return int(out[0]), out[1]


def test_cached_allocator_reuses_freed_blocks_without_faulting():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt only")
    cached, said = _probe("cache")
    system, said_system = _probe("system")
    assert said.startswith("cached host allocator"), said
    assert said_system == f"system allocator ({ENV}=system)"
    # glibc's default mmaps a 64 MiB block and unmaps it on free: every round faults it in
    assert system > PAGES_64_MIB // 2, system
    assert cached < PAGES_64_MIB // 16, cached


def test_bad_choice_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(ENV, "tcmalloc")
    keep_freed_memory.cache_clear()
    try:
        with pytest.raises(JaxspeedError, match=f"{ENV} must be one of"):
            keep_freed_memory()
    finally:
        keep_freed_memory.cache_clear()


def test_cli_reports_a_bad_choice(monkeypatch, capsys):
    from jaxspeed.cli import main

    monkeypatch.setenv(ENV, "tcmalloc")
    keep_freed_memory.cache_clear()
    try:
        assert main(["plan", "configs/gpt_tiny.yaml"]) == 2
    finally:
        keep_freed_memory.cache_clear()
    assert f"{ENV} must be one of" in capsys.readouterr().err
