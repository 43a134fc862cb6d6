"""The environment of a process a test starts (`jaxspeed` commands, launched ranks)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """`os.environ` with this checkout importable and the suite's XLA flags (fast compiles,
    tests/conftest.py) without their device count: the child's `--cpu-devices` (or its
    launcher) sets its own. `extra` is added last."""
    flags = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                     if "device_count" not in flag)
    return {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags, **extra}
