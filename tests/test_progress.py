"""Progress without a terminal: plain lines at a steady interval, with count, rate and ETA."""

import io
import time

from jaxspeed.runtime import progress


def test_plain_lines_at_the_interval_and_at_the_end(monkeypatch):
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "0.05")
    out = io.StringIO()
    with progress.Progress(4, desc="train", unit="step", stream=out, terminal=False) as bar:
        bar.update()  # before the interval: no line
        time.sleep(0.06)
        bar.set_postfix(loss="2.5")
        bar.update()
        bar.update()  # within the interval: no line until the end
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("train: 2/4 (50%)") and "loss=2.5" in lines[0], lines
    assert lines[-1].startswith("train: 3/4"), lines
    assert len(lines) == 2


def test_disabled_and_unstarted_print_nothing():
    out = io.StringIO()
    with progress.Progress(4, desc="train", stream=out, terminal=False, enabled=False) as bar:
        bar.update(4)
        bar.write("hidden")
    with progress.Progress(4, desc="train", stream=out, terminal=False):
        pass
    assert out.getvalue() == ""


def test_phase_heartbeat_without_a_terminal(monkeypatch):
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "0.05")
    out = io.StringIO()
    with progress.phase("compiling the train step", stream=out, terminal=False):
        time.sleep(0.18)
    lines = out.getvalue().splitlines()
    assert lines[0] == "compiling the train step ..."
    assert any("still running" in line for line in lines[1:-1]), lines
    assert lines[-1].startswith("compiling the train step: done in ")


def test_phase_on_a_terminal_has_no_heartbeat(monkeypatch):
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "0.02")
    out = io.StringIO()
    with progress.phase("searching", stream=out, terminal=True):
        time.sleep(0.08)
    assert len(out.getvalue().splitlines()) == 2


def test_bad_interval_falls_back_to_the_default(monkeypatch):
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "soon")
    assert progress.interval() == progress.DEFAULT_INTERVAL


def test_close_does_not_repeat_the_last_line(monkeypatch):
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "0.01")
    out = io.StringIO()
    with progress.Progress(2, desc="plans", stream=out, terminal=False) as bar:
        time.sleep(0.02)
        bar.update(2)
    assert len(out.getvalue().splitlines()) == 1, out.getvalue()


def test_quiet_work_shorter_than_the_interval_says_nothing(monkeypatch):
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "30")
    out = io.StringIO()
    with progress.phase("reading", stream=out, terminal=False, quiet=True):
        pass
    with progress.Progress(3, desc="export", stream=out, terminal=False, quiet=True) as bar:
        bar.update(3)
    assert out.getvalue() == ""
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "0.02")
    with progress.phase("reading", stream=out, terminal=False, quiet=True):
        time.sleep(0.05)
    lines = out.getvalue().splitlines()
    assert "still running" in lines[0] and lines[-1].startswith("reading: done in "), lines
