"""Test setup: 8 emulated CPU devices, set before JAX is imported anywhere.

The tests compile hundreds of small programs, and on CPU compiling is most of their time, so by
default XLA's backend optimizations are off (`--xla_backend_optimization_level=0`). SPMD
partitioning, and so every sharding and collective, is unaffected, and the tests that compare
compiled memory sizes (remat, pipeline schedules, offload, fit) hold at this level too.

`JAXSPEED_TEST_XLA_OPT=default` runs the suite at XLA's default optimisation level instead.
Its other fusions sum floats in another order, which stands in for another CPU: every
comparison of two programs must hold at both levels (see `tests/numerics.py`).

A flag that the installed jaxlib does not know aborts the process, so the fast-compile flags
are checked once, in a child process, before they are set; an unknown one stops the run with a
message naming it. Subprocesses (examples, benchmarks, the CLI) inherit the flags.

Many tests build the same engine, a benchmark's subprocess compiles what a test already
compiled, and the next run compiles what this one did. JAX's persistent compilation cache lets
every later compile of the same program (its key covers the HLO, the XLA flags, jaxlib and the
devices) load the executable instead; the workers and subprocesses share it through
`JAX_COMPILATION_CACHE_DIR`. A loaded executable reports the same `memory_analysis()`, costs and
HLO text as a compiled one. `JAXSPEED_TEST_XLA_CACHE` picks where it lives:
- `on` (the default): `$XDG_CACHE_HOME/jaxspeed/test-xla-cache` (`~/.cache/...`), one folder
  per CPU feature set (`kept_cache_dir`), kept between runs, each folder bounded to
  `CACHE_MAX_BYTES` at the start of each run, the least recently used entries removed first
  (`prune`; JAX's own bound, `jax_compilation_cache_max_size`, rescans the whole folder under
  a lock at every write, which made a cold run of the suite 50% longer). On a 2-core AVX2 VM,
  `tests/test_engine.py` and `tests/test_sequence_parallel.py` took 260 s into an empty cache
  and 88 s from a warm one.
- `run`: a directory made for this run and removed when it ends (every run starts cold, as a
  fresh CI machine does).
- `off`: everything compiled afresh (a `JAX_COMPILATION_CACHE_DIR` of the environment is set
  aside too).
With `on` or `run`, a `JAX_COMPILATION_CACHE_DIR` of the environment is used as it is, and kept.
"""

import atexit
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

#: XLA flags that make compiling fast (used unless JAXSPEED_TEST_XLA_OPT=default).
FAST_COMPILE = ("--xla_backend_optimization_level=0",)
DEVICES = "--xla_force_host_platform_device_count=8"
#: The kept compilation cache's bound (one run of the whole suite writes about 76 MiB).
CACHE_MAX_BYTES = 2**30
_CHECKED = "_JAXSPEED_TEST_FLAGS_CHECKED"  # set once the controller has checked the flags


def _switch(name: str, choices: tuple[str, ...]) -> str:
    """The environment switch `name`, one of `choices` (the first is the default); any other
    value stops the run."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        allowed = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
        pytest.exit(f"{name} must be {allowed}, got {value!r}", returncode=4)
    return value


def _opt_flags() -> tuple[str, ...]:
    level = _switch("JAXSPEED_TEST_XLA_OPT", ("fast", "default"))
    return FAST_COMPILE if level == "fast" else ()


def _check_flags_accepted(flags: str) -> None:
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=300,
    )
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["(no output)"])[-1].split("] ")[-1]
        pytest.exit(
            f"this jaxlib rejects the test XLA flags {flags!r}: {tail}. "
            "Set JAXSPEED_TEST_XLA_OPT=default to run without the fast-compile flags.",
            returncode=4,
        )


def kept_cache_dir() -> Path:
    """Where `JAXSPEED_TEST_XLA_CACHE=on` keeps the compiled programs between runs: one
    directory per CPU feature set. XLA:CPU compiles for the host's features and its cache key
    does not name them, so a home directory shared by an AVX-512 and an AVX2 machine would
    hand each the other's programs (XLA:CPU's loader rejects a feature mismatch, and JAX never
    replaces a rejected entry)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    features = next((line for line in cpuinfo.splitlines()
                     if line.split(":")[0].strip() in ("flags", "Features")), "")
    host = f"{platform.machine()}-{hashlib.sha256(features.encode()).hexdigest()[:12]}"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxspeed" / "test-xla-cache" / host


def prune(cache: Path, limit: int) -> None:
    """Removes the least recently used files of `cache` until it holds at most `limit` bytes
    (used: the later of the file's access and modification times)."""
    entries = sorted((max(st.st_atime, st.st_mtime), st.st_size, path)
                     for path in cache.iterdir() if path.is_file() for st in [path.stat()])
    total = sum(size for _, size, _ in entries)
    for _, size, path in entries:
        if total <= limit:
            break
        path.unlink(missing_ok=True)
        total -= size


def _use_compilation_cache() -> None:
    mode = _switch("JAXSPEED_TEST_XLA_CACHE", ("on", "run", "off"))
    if mode == "off":
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        return
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    if mode == "run":
        cache = tempfile.mkdtemp(prefix="jaxspeed-test-xla-cache-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)  # the process that made it
    else:
        cache = kept_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        if not os.environ.get(_CHECKED):  # once, in the process that starts the run
            prune(cache, CACHE_MAX_BYTES)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    # every program the tests compile, however small or quick (the defaults skip those)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


_use_compilation_cache()
_flags = " ".join((os.environ.get("XLA_FLAGS", ""), DEVICES, *_opt_flags())).strip()
if not os.environ.get(_CHECKED):
    _check_flags_accepted(_flags)
    os.environ[_CHECKED] = "1"
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
