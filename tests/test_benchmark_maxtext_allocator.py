"""The MaxText peer runs under the host allocator jaxspeed runs under (glibc tunables), unless
told to use glibc's defaults, so `throughput.py --maxtext` compares trainers, not allocators."""

import stat

from jaxspeed.runtime import host_allocator
from test_benchmarks import load_benchmark

#: A stand-in for a MaxText venv's python that records its GLIBC_TUNABLES and logs 2 steps.
FAKE = """#!/bin/sh
case "$1" in
-c) echo /nonexistent/base.yml ;;
-m) printf '%s' "$GLIBC_TUNABLES" > {record}
    echo "completed step: 0, seconds: 0.5"; echo "completed step: 1, seconds: 0.25" ;;
esac
"""


def test_maxtext_runs_under_jaxspeeds_allocator_or_glibcs(tmp_path, monkeypatch):
    peer = load_benchmark("maxtext_peer")
    record, python = tmp_path / "tunables", tmp_path / "python"
    python.write_text(FAKE.format(record=record))
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(host_allocator, "applied", lambda: host_allocator.CACHED)

    assert peer.run(str(python), {}, steps=2) == {0: 0.5, 1: 0.25}
    assert record.read_text() == host_allocator.TUNABLES
    assert peer.allocator() == f"GLIBC_TUNABLES={host_allocator.TUNABLES}"

    peer.run(str(python), {}, steps=2, same_allocator=False)
    assert record.read_text() == ""
    assert peer.allocator(same_allocator=False) == "glibc defaults"
