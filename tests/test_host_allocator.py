"""The cached host allocator: freed blocks are reused without page faults; opt-out and bad values;
opt-in for the library (`initialize` leaves it alone), and reaching children through GLIBC_TUNABLES."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxspeed.errors import JaxspeedError
from jaxspeed.runtime import host_allocator
from jaxspeed.runtime.host_allocator import ENV, keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]
PAGES_64_MIB = (64 << 20) // 4096
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt only")

#: `faults()`: frees and re-allocates a 64 MiB block ten times, touching every page; the minor
#: page faults of the last nine rounds (glibc's defaults mmap such a block afresh each time).
_FAULTS = textwrap.dedent("""
    import ctypes, resource

    def faults():
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
        libc.free.argtypes = (ctypes.c_void_p,)
        size, total = 64 << 20, 0
        for round_ in range(10):
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            block = libc.malloc(size)
            ctypes.memset(block, 1, size)
            libc.free(block)
            if round_:
                total += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
        return total // 9
""")


def _run(script: str, env: dict[str, str]) -> list[str]:
    """The stdout lines of `script` run after `_FAULTS` in a fresh process (the allocator
    settings are per process and cannot be undone)."""
    proc = subprocess.run([sys.executable, "-c", _FAULTS + textwrap.dedent(script)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


def _probe(choice: str) -> tuple[int, str]:
    out = _run("""
        from jaxspeed.runtime.host_allocator import keep_freed_memory
        said = keep_freed_memory()
        print(faults(), said, sep="\\n")
    """, {**os.environ, ENV: choice})
    return int(out[-2]), out[-1]


@linux_only
def test_cached_allocator_reuses_freed_blocks_without_faulting():
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


@linux_only
def test_initialize_leaves_the_allocator_alone_and_the_opt_in_changes_it():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", ENV: "cache"}
    env.pop("GLIBC_TUNABLES", None)
    out = json.loads(_run("""
        import json
        import jaxspeed as js
        from jaxspeed.runtime.host_allocator import applied
        js.initialize("configs/gpt_tiny.yaml")
        before, applied_before = faults(), applied()
        said = js.keep_freed_memory()
        print(json.dumps({"before": before, "applied_before": applied_before, "said": said,
                          "after": faults()}))
    """, env)[-1])
    assert out["applied_before"] is None and out["before"] > PAGES_64_MIB // 2, out
    assert out["said"] == host_allocator.CACHED and out["after"] < PAGES_64_MIB // 16, out


def test_the_tunables_say_what_mallopt_sets():
    assert host_allocator.TUNABLES == (
        "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1")


def test_child_env_adds_the_tunables_only_when_this_process_keeps_freed_memory(monkeypatch):
    monkeypatch.setattr(host_allocator, "applied", lambda: None)
    assert host_allocator.child_env({"A": "1"}) == {"A": "1"}
    monkeypatch.setattr(host_allocator, "applied", lambda: "system allocator (no glibc here)")
    assert host_allocator.child_env({"A": "1"}) == {"A": "1"}
    monkeypatch.setattr(host_allocator, "applied", lambda: host_allocator.CACHED)
    env = host_allocator.child_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:" + host_allocator.TUNABLES}


@linux_only
def test_a_child_started_with_the_tunables_keeps_freed_memory(monkeypatch):
    monkeypatch.setattr(host_allocator, "applied", lambda: host_allocator.CACHED)
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert int(_run("print(faults())", host_allocator.child_env(base))[-1]) < PAGES_64_MIB // 16
    assert int(_run("print(faults())", base)[-1]) > PAGES_64_MIB // 2
