"""tests/conftest.py: the XLA flags the suite runs under, its JAXSPEED_TEST_XLA_OPT switch, and
the run's shared compilation cache (JAXSPEED_TEST_XLA_CACHE)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_child(tmp_path, **env):
    """Runs one tiny test file under this conftest in a child pytest, with `env` on top."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_flags.py").write_text(
        "import os\n\ndef test_print_flags():\n    print('FLAGS=' + os.environ['XLA_FLAGS'])\n"
        "    cache = os.environ.get('JAX_COMPILATION_CACHE_DIR')\n"
        "    if cache:\n"
        "        import jax, jax.numpy as jnp\n"
        "        jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()\n"
        "        print('CACHE=' + cache, len(os.listdir(cache)))\n"
    )
    base = {k: v for k, v in os.environ.items()
            if k not in ("XLA_FLAGS", "JAXSPEED_TEST_XLA_OPT", "_JAXSPEED_TEST_FLAGS_CHECKED",
                         "JAXSPEED_TEST_XLA_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:xdist",
         str(tmp_path / "test_flags.py")],
        env={**base, **env}, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )


def flags_of(result) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return next(line for line in result.stdout.splitlines() if "FLAGS=" in line)


@pytest.mark.parametrize("level, fast", [(None, True), ("fast", True), ("default", False)])
def test_the_switch_picks_the_optimisation_level(tmp_path, level, fast):
    env = {} if level is None else {"JAXSPEED_TEST_XLA_OPT": level}
    flags = flags_of(pytest_child(tmp_path, **env))
    assert "--xla_force_host_platform_device_count=8" in flags
    assert ("--xla_backend_optimization_level=0" in flags) == fast


def test_a_bad_switch_value_is_named(tmp_path):
    result = pytest_child(tmp_path, JAXSPEED_TEST_XLA_OPT="fastest")
    assert result.returncode == 4
    assert "JAXSPEED_TEST_XLA_OPT must be 'fast' or 'default', got 'fastest'" in result.stdout + result.stderr


def test_a_flag_this_jaxlib_rejects_stops_the_run_with_its_name(tmp_path):
    result = pytest_child(tmp_path, XLA_FLAGS="--xla_no_such_flag_anywhere=1")
    assert result.returncode == 4
    out = result.stdout + result.stderr
    assert "this jaxlib rejects the test XLA flags" in out and "--xla_no_such_flag_anywhere" in out


def cache_of(result) -> tuple[str, int] | None:
    """The child's cache directory and the entries it held after one compile (None: no cache)."""
    assert result.returncode == 0, result.stdout + result.stderr
    line = next((line for line in result.stdout.splitlines() if "CACHE=" in line), None)
    if line is None:
        return None
    cache, entries = line.split("CACHE=", 1)[1].rsplit(" ", 1)
    return cache, int(entries)


def test_a_run_compiles_into_a_cache_of_its_own_and_removes_it(tmp_path):
    cache, entries = cache_of(pytest_child(tmp_path))
    assert entries >= 1  # the child's compile was written there
    assert not Path(cache).exists()  # and the directory went with the run


@pytest.mark.parametrize("given", [False, True])
def test_the_cache_can_be_switched_off(tmp_path, given):
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path)} if given else {}
    assert cache_of(pytest_child(tmp_path, JAXSPEED_TEST_XLA_CACHE="off", **env)) is None


def test_a_cache_directory_given_is_used_and_kept(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    cache, entries = cache_of(pytest_child(tmp_path, JAX_COMPILATION_CACHE_DIR=str(mine)))
    assert cache == str(mine) and entries >= 1 and len(list(mine.iterdir())) == entries


def test_a_bad_cache_switch_value_is_named(tmp_path):
    result = pytest_child(tmp_path, JAXSPEED_TEST_XLA_CACHE="maybe")
    assert result.returncode == 4
    assert "JAXSPEED_TEST_XLA_CACHE must be 'on' or 'off', got 'maybe'" in result.stdout + result.stderr
