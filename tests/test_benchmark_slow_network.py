"""benchmarks/slow_network.py without a network: the refusal line, argument errors, the link's
cleanup on a failed build, and the summary arithmetic. (CI runs the real link: `make
bench-slow-network-quick`.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _slow_link  # noqa: E402
import slow_network  # noqa: E402


def test_without_root_one_line_and_exit_0(monkeypatch, capsys):
    monkeypatch.setattr(slow_network, "unavailable", lambda: "not root: network namespaces and tc need root")
    assert slow_network.main(["--quick"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["slow_network: cannot build a slow link here (not root: network namespaces "
                   "and tc need root); no ratio measured"]


def test_unavailable_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(_slow_link.os, "geteuid", lambda: 1000)
    assert "not root" in _slow_link.unavailable()
    monkeypatch.setattr(_slow_link.os, "geteuid", lambda: 0)
    monkeypatch.setattr(_slow_link.shutil, "which", lambda tool: None if tool == "tc" else "/bin/x")
    assert _slow_link.unavailable() == "missing tc (iproute2 / util-linux)"


@pytest.mark.parametrize("argv,message", [
    (["--configs", "adamw,nope"], "unknown configuration ['nope']"),
    (["--steps", "3"], "--steps must be >= 4"),
    (["--rate", "-1"], "--rate must be >= 0"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        slow_network.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_failed_build_removes_what_it_made(monkeypatch):
    calls = []

    def fake_run(*cmd):
        calls.append(cmd)
        if cmd[:3] == ("ip", "link", "add"):
            raise subprocess.CalledProcessError(1, cmd)

    removed = []
    monkeypatch.setattr(_slow_link, "_run", fake_run)
    monkeypatch.setattr(_slow_link.subprocess, "run", lambda cmd, **kw: removed.append(cmd))
    monkeypatch.setattr(_slow_link.os, "makedirs", lambda *a, **k: None)
    monkeypatch.setattr(_slow_link, "open", lambda *a, **k: _Sink(), raising=False)
    link = _slow_link.SlowLink(100)
    with pytest.raises(subprocess.CalledProcessError):
        with link:
            pass
    assert [c[:3] for c in calls[:2]] == [("ip", "netns", "add")] * 2
    assert removed == [["ip", "netns", "del", ns] for ns in link.namespaces]


class _Sink:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, text):
        return len(text)


def test_median_over_the_last_half_and_summary(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "loss": 5.0 - i, "tokens_per_second": t}
            for i, t in enumerate([10, 20, 1000, 300, 100, 200], 1)]
    metrics.write_text("\n".join(json.dumps(r) for r in rows))
    assert slow_network.median_tokens_per_second(metrics) == (200, -1.0, 6)
    summary = slow_network.summarize({
        "adamw": {"tokens_per_second": 100.0, "last_loss": 3.0},
        "onebit_adam": {"tokens_per_second": 350.0, "last_loss": 3.1},
        "zero_one_adam": {"error": "refused"},
    })
    assert summary == [
        {"config": "onebit_adam", "baseline": "adamw", "ratio": 3.5, "loss": 3.1, "baseline_loss": 3.0},
        {"config": "zero_one_adam", "baseline": "adamw", "ratio": None, "loss": None, "baseline_loss": 3.0},
    ]
