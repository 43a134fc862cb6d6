"""tools/find_python.sh: the Makefile's way to a Python >= 3.12, each candidate checked by running it."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "find_python.sh"


def run(tmp_path, python):
    env = {**os.environ, "PYTHON": str(python)}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)


def fake_python(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_new_enough_python_is_printed(tmp_path):
    result = run(tmp_path, sys.executable)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == sys.executable


def test_an_old_python_is_refused_in_one_line(tmp_path):
    # A Python 3.11 as seen from the outside: it prints its version and fails the check.
    old = fake_python(tmp_path, "python3.11", 'case "$2" in *print*) echo 3.11.7;; *) exit 1;; esac')
    result = run(tmp_path, old)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "needs Python >= 3.12" in lines[0] and f"{old} 3.11.7" in lines[0]


def test_a_shim_that_refuses_to_run_is_skipped(tmp_path):
    # pyenv's shim for an unselected version exits non-zero before running anything.
    shim = fake_python(tmp_path, "python3.12", "echo 'pyenv: python3.12: command not found' >&2; exit 127")
    result = run(tmp_path, shim)
    assert result.returncode == 1
    assert "no runnable python" in result.stderr
