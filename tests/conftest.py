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

Many tests build the same engine, or a benchmark's subprocess compiles what a test already
compiled. JAX's persistent compilation cache, in a directory made for this run and removed when
it ends, lets every later compile of the same program (same HLO, flags and devices) load the
executable instead: the workers and subprocesses share it through `JAX_COMPILATION_CACHE_DIR`.
A loaded executable reports the same `memory_analysis()`, costs and HLO text as a compiled one.
`JAXSPEED_TEST_XLA_CACHE=off` compiles everything afresh (it also sets aside a
`JAX_COMPILATION_CACHE_DIR` of the environment); otherwise an existing one is used as it is, and
kept.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

#: XLA flags that make compiling fast (used unless JAXSPEED_TEST_XLA_OPT=default).
FAST_COMPILE = ("--xla_backend_optimization_level=0",)
DEVICES = "--xla_force_host_platform_device_count=8"
_CHECKED = "_JAXSPEED_TEST_FLAGS_CHECKED"  # set once the controller has checked the flags


def _switch(name: str, choices: tuple[str, str]) -> str:
    """The environment switch `name`, one of `choices` (the first is the default); any other
    value stops the run."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        pytest.exit(f"{name} must be {choices[0]!r} or {choices[1]!r}, got {value!r}", returncode=4)
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


def _use_compilation_cache() -> None:
    if _switch("JAXSPEED_TEST_XLA_CACHE", ("on", "off")) == "off":
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        return
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    cache = tempfile.mkdtemp(prefix="jaxspeed-test-xla-cache-")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)  # the process that made it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
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
