"""tests/conftest.py: the XLA flags the suite runs under, and its JAXSPEED_TEST_XLA_OPT switch."""

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
    )
    base = {k: v for k, v in os.environ.items()
            if k not in ("XLA_FLAGS", "JAXSPEED_TEST_XLA_OPT", "_JAXSPEED_TEST_FLAGS_CHECKED")}
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
