"""The CLI: bad input exits non-zero with one readable line; train and plan work end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspeed.cli import main
from children import child_env

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "mesh": {"data": -1},
    "train_micro_batch_size_per_device": 1,
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 32},
    "data": {"seq_len": 32, "max_bytes": 300000},
    "logging": {"every_n_steps": 1, "eval_every_n_steps": 2, "eval_batches": 1},
    "steps": 3,
}


def write(tmp_path, name, obj):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


@pytest.mark.parametrize(
    "config, match",
    [
        ({**TINY, "zero_optimisation": {"stage": 1}}, "did you mean 'zero_optimization'"),
        ({**TINY, "zero_optimization": {"stage": "three"}}, "zero_optimization.stage"),
        ({**TINY, "train_batch_size": 12, "train_micro_batch_size_per_device": 1,
          "gradient_accumulation_steps": 1}, "train_batch_size=12"),
        ({**TINY, "mesh": {"data": 3}}, "mesh"),
        ({**TINY, "amp": {"enabled": True}}, "amp"),
    ],
    ids=["unknown-key", "wrong-type", "batch-triple", "mesh-product", "unsupported-deepspeed"],
)
@pytest.mark.parametrize("command", ["train", "plan"])
def test_bad_config_is_one_clear_error(tmp_path, capsys, config, match, command):
    path = write(tmp_path, "bad.json", config)
    code = main([command, path, *(["--output", str(tmp_path)] if command == "train" else [])])
    err = capsys.readouterr().err
    assert code == 2
    assert match in err and "Traceback" not in err
    assert err.startswith(f"jaxspeed {command}: error:")


def test_missing_config_file(capsys):
    assert main(["plan", "no/such/config.yaml"]) == 2
    assert "no/such/config.yaml" in capsys.readouterr().err


def test_bad_override(capsys, tmp_path):
    path = write(tmp_path, "ok.json", TINY)
    assert main(["plan", path, "--set", "zero_optimization.stage"]) == 2
    assert "=" in capsys.readouterr().err


def test_unknown_benchmark(capsys):
    assert main(["bench", "no_such_benchmark"]) == 2
    assert "available" in capsys.readouterr().err


def run_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "jaxspeed.cli", *args],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout,
    )


def test_train_writes_metrics_and_tensorboard(tmp_path):
    config = write(tmp_path, "tiny.json", {**TINY, "logging": {**TINY["logging"], "tensorboard": True}})
    out = tmp_path / "run"
    proc = run_cli("train", config, "--cpu-devices", "4", "--output", str(out),
                   "--set", "zero_optimization.stage=3", "--set", "hardware.peak_tflops=0.5")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert {"loss", "lr", "grad_norm", "tokens_per_second", "tflops_per_device", "mfu"} <= set(r)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5)
    assert "eval_loss" in records[1] and "eval_loss" in records[2]
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert json.loads(proc.stdout.splitlines()[-1])["step"] == 3


def test_plan_json_reports_per_device_bytes(tmp_path):
    config = write(tmp_path, "tiny.json", TINY)
    stage = {}
    for s in (0, 3):
        proc = run_cli("plan", config, "--json", "--cpu-devices", "8", "--set", f"zero_optimization.stage={s}")
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout.splitlines()[-1])
        per_device = report["per_device_bytes"]
        assert {"params", "grads", "opt_state", "temp", "total", "device", "host"} == set(per_device)
        assert report["host_bytes"] == 0 and per_device["device"] == per_device["total"]
        # Nothing offloaded: every step figure is XLA's, only the state estimates are summed.
        assert report["sources"] == {
            "params": "arrays", "grads": "arrays", "opt_state": "arrays",
            "temp": "compiled", "total": "compiled", "device": "compiled", "host": "compiled",
        }
        assert report["source"] == "compiled-cpu"
        assert report["device_model"] == []
        assert report["profile"]["flops"] > 0 and report["fit"] is None
        stage[s] = report["per_device_bytes"]
    assert stage[3]["params"] < stage[0]["params"] / 4
    assert stage[3]["opt_state"] < stage[0]["opt_state"] / 4


def test_plan_table(tmp_path):
    proc = run_cli("plan", write(tmp_path, "tiny.json", TINY), "--cpu-devices", "8",
                   "--set", "mesh.data=4", "--set", "mesh.tensor=2", "--set", "zero_optimization.stage=3")
    assert proc.returncode == 0, proc.stderr
    assert "layers/mlp/wi" in proc.stdout and "tensor" in proc.stdout
    assert "estimate" in proc.stdout and "compiled" in proc.stdout
    assert "collective bytes per device per step" in proc.stdout and "all-gather" in proc.stdout


def test_plan_table_labels_modelled_rows_with_offload(tmp_path):
    proc = run_cli("plan", write(tmp_path, "tiny.json", TINY), "--cpu-devices", "8",
                   "--device-memory", "1GiB", "--set", "zero_optimization.stage=3",
                   "--set", "zero_optimization.offload_optimizer.device=cpu",
                   "--set", "zero_optimization.offload_param.device=cpu")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    source = {line[:36].rstrip(): line.split()[-1] for line in lines if line.strip()}
    assert any(line.startswith("per device  ") and line.endswith("  source") for line in lines)
    assert source["total"] == "compiled-cpu"
    assert source["  of which in host memory"] == "arrays"
    assert source["  device memory needed"] == "model"
    assert source["    - streamed grads in host memory"] == "model"
    assert "(the verdict compares device memory needed, source: model)" in lines


def test_the_librarys_info_lines_reach_stderr_once(capsys):
    """`jaxspeed.*` INFO records (MoE `parallelism: auto`'s choice) print as one `jaxspeed:`
    line each on stderr, and not a second time through a root handler."""
    import logging

    from jaxspeed.cli import _info_lines

    logger = logging.getLogger("jaxspeed")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    logger.handlers.clear()
    root = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(root)
    try:
        _info_lines()
        _info_lines()  # idempotent
        logging.getLogger("jaxspeed.moe.strategies").info("MoE parallelism auto: %s", "expert")
        assert capsys.readouterr().err == "jaxspeed: MoE parallelism auto: expert\n"
    finally:
        logging.getLogger().removeHandler(root)
        logger.handlers[:], logger.level, logger.propagate = saved
