"""What the CLI prints on stderr besides errors: Ctrl-C, bad process flags and warnings, one line each."""

import os
import signal
import subprocess
import sys
import warnings

from jaxspeed.cli import main
from jaxspeed.cli.warning_lines import format_warning, one_line
from test_cli import ROOT, TINY, write

#: Runs `jaxspeed` with `Engine.init` stalled: it says READY on stderr and sleeps, so a SIGINT
#: sent after READY lands during start-up (after the checkpoint folder exists, before any step).
STALLED_INIT = """
import signal, sys, time
from jaxspeed.train import engine

# a shell's background job starts with SIGINT ignored (and so would this child): a terminal's
# Ctrl-C is what the test sends, so SIGINT gets Python's own handler back
signal.signal(signal.SIGINT, signal.default_int_handler)

def init(self, rng):
    print("READY", file=sys.stderr, flush=True)
    time.sleep(120)

engine.Engine.init = init
from jaxspeed.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path):
    config = write(tmp_path, "tiny.json", TINY)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLED_INIT, "train", config, "--cpu-devices", "2",
         "--output", str(tmp_path / "run"), "--no-progress"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        before = []
        for line in proc.stderr:  # whatever start-up prints, up to the stall
            if line.strip() == "READY":
                break
            before.append(line)
        assert proc.poll() is None, "".join(before)[-2000:]
        proc.send_signal(signal.SIGINT)
        after = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert code == 130, after[-2000:]
    assert after.splitlines() == ["jaxspeed train: interrupted (nothing saved)"], after[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing saved: no empty folder


def test_cpu_devices_below_one_is_one_clear_error(tmp_path, capsys):
    config = write(tmp_path, "tiny.json", TINY)
    assert main(["train", config, "--cpu-devices", "0", "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "jaxspeed train: error: --cpu-devices must be a whole number of devices >= 1, got 0"]
    assert not (tmp_path / "run").exists()


def test_a_warning_during_a_command_is_one_line(tmp_path, capsys):
    """A config with a DeepSpeed option jaxspeed ignores warns; `--steps 0` then stops the run
    before anything is compiled."""
    config = write(tmp_path, "ds.json", {**TINY, "wall_clock_breakdown": True})
    assert main(["train", config, "--steps", "0", "--output", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("jaxspeed train: error: steps must be >= 1"), lines
    assert lines[0].startswith("jaxspeed train: warning: ignoring DeepSpeed options")
    assert "wall_clock_breakdown" in lines[0] and ".py" not in lines[0]


def test_library_warnings_name_their_package_in_one_line():
    line = format_warning("plan", UserWarning("first\n  second"), UserWarning,
                          "/x/.venv/lib/python3.12/site-packages/orbax/checkpoint/manager.py")
    assert line == "jaxspeed plan: warning: UserWarning (orbax): first second"
    own = format_warning("train", "model.x differs", UserWarning, str(ROOT / "jaxspeed/checkpoint/params.py"))
    assert own == "jaxspeed train: warning: model.x differs"


def test_one_line_restores_the_warning_display(capsys):
    shown = warnings.showwarning
    with one_line("sample"):
        warnings.warn_explicit("odd tokenizer", UserWarning, "/elsewhere/tool.py", 3)
    assert warnings.showwarning is shown
    assert capsys.readouterr().err == "jaxspeed sample: warning: UserWarning (tool): odd tokenizer\n"


def test_tokenize_without_a_terminal_prints_progress_lines(tmp_path, monkeypatch, capsys):
    from jaxspeed.data.text_tokens import train_bpe

    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    train_bpe([str(text)], vocab_size=280, out_dir=str(tmp_path / "tok"))
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "0.001")
    capsys.readouterr()
    assert main(["tokenize", str(text), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "t.npy")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err and all(line.startswith("tokenize: ") for line in err), err
    assert err[-1].startswith("tokenize: 8.80k [") and "char/s" in err[-1], err


def test_token_file_check_reports_progress(tmp_path, monkeypatch, capsys):
    import numpy as np

    from jaxspeed.config import load_config
    from jaxspeed.data.grain_loader import make_dataset

    np.save(tmp_path / "t.npy", np.arange(5000, dtype=np.uint16) % 250)
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "0.001")
    config = load_config({**TINY, "data": {"source": "tokens", "files": [str(tmp_path / "t.npy")], "seq_len": 16}})
    make_dataset(config, progress=True)
    err = capsys.readouterr().err.splitlines()
    assert err and err[-1].startswith("checking token ids: 5.00k/5.00k (100%)"), err


def test_the_command_imports_jax_only_inside_main():
    """Ctrl-C while JAX is still importing must reach `main`'s one-line handler too."""
    code = "import sys, jaxspeed, jaxspeed.cli; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
