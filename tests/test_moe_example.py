"""MoE end to end: the user-model example and `jaxspeed train configs/gpt_moe.yaml`.

Fast: both plan their experts onto the `expert` mesh axis (expert=4 x data=2, ZeRO stage 3).
Slow: each trains 2 steps and must report a finite loss and the MoE aux loss.
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

import jaxspeed as js
from jaxspeed.cli import main

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^step\s+(\d+)\s+loss\s+(\S+)\s+aux_loss\s+(\S+)", re.MULTILINE)

#: Shrinks configs/gpt_moe.yaml to seconds: 2 layers (one dense, one MoE), short sequences.
SMALL = (
    "model.d_model=32", "model.n_layers=2", "model.d_ff=64", "model.moe.d_ff=32",
    "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000",
    "train_micro_batch_size_per_device=1", "logging.every_n_steps=1",
    "logging.eval_every_n_steps=0",
)


def _example_module():
    spec = importlib.util.spec_from_file_location(
        "moe_in_your_model", ROOT / "examples" / "moe_in_your_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the model and config; main() is not run
    return module


def test_example_model_puts_its_experts_on_the_expert_axis():
    example = _example_module()
    engine = js.initialize(example.CONFIG, model=example.MoEByteLM())  # plans, compiles nothing
    assert dict(engine.mesh.shape) == {
        "host": 1, "pipe": 1, "data": 2, "sequence": 1, "expert": 4, "tensor": 1}
    params = engine.plan.params
    # expert weights: experts over `expert`, ZeRO-3 over `data`
    assert params["moe"]["expert_w_in"].spec == P("expert", None, "data")
    assert params["moe"]["expert_w_out"].spec == P("expert", "data", None)
    # everything else: ZeRO-3 over both data-parallel axes
    assert params["moe"]["gate_kernel"].spec == P(("data", "expert"), None)
    assert params["embedding"].spec == P(("data", "expert"), None)


def test_gpt_moe_config_is_expert_parallel_with_zero3():
    config = js.load_config(ROOT / "configs" / "gpt_moe.yaml")
    assert config.zero_optimization.stage == 3
    assert config.model.moe.num_experts % config.mesh.expert == 0
    engine = js.initialize(config)
    assert dict(engine.mesh.shape) == {
        "host": 1, "pipe": 1, "data": 2, "sequence": 1, "expert": 4, "tensor": 1}
    moe = engine.plan.params["layers"]["moe_block"]["moe"]
    assert moe["expert_w_in"].spec == P(None, "expert", None, "data")  # [units, E, M, H]
    dense_wi = engine.plan.params["layers"]["dense_0"]["mlp"]["wi"]
    assert dense_wi.spec == P(None, None, ("data", "expert"))


@pytest.mark.slow  # a subprocess that imports JAX and compiles: ~15-40 s on 2 busy cores
def test_moe_example_trains_two_steps_and_prints_the_aux_loss():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "examples/moe_in_your_model.py", "--steps", "2", "--no-eval",
         "--set", "data.seq_len=32", "--set", "data.max_bytes=200000"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    rows = {int(s): (float(loss), float(aux)) for s, loss, aux in STEP.findall(result.stdout)}
    assert sorted(rows) == [1, 2], result.stdout
    for loss, aux in rows.values():
        assert math.isfinite(loss) and 0 < loss < 10, rows
        # one MoE layer: aux_loss_coef 0.01 x GShard balance loss (1 when balanced, <= E)
        assert math.isfinite(aux) and 0.005 < aux < 0.1, rows
    assert "mesh: pipe=1, data=2, sequence=1, expert=4, tensor=1   ZeRO stage 3" in result.stdout
    # The experts are split over the `expert` mesh axis (and ZeRO-3 over `data`).
    assert re.search(r"^moe/expert_w_in\s+8×64×128\s+\(expert, None, data\)", result.stdout,
                     re.MULTILINE), result.stdout


@pytest.mark.slow  # compiles init and step of a MoE GPT: ~15-40 s on 2 busy cores
def test_jaxspeed_train_gpt_moe_logs_the_aux_loss(tmp_path, capsys):
    # In process (conftest gives 8 CPU devices): `main` is the `jaxspeed` console script.
    args = ["train", str(ROOT / "configs" / "gpt_moe.yaml"), "--steps", "2",
            "--output", str(tmp_path), "--no-progress"]
    for override in SMALL:
        args += ["--set", override]
    assert main(args) == 0, capsys.readouterr().err
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert final["step"] == 2 and final["aux_loss"] == records[-1]["aux_loss"]
    for record in records:
        assert math.isfinite(record["loss"]) and 0 < record["loss"] < 10, records
        assert math.isfinite(record["aux_loss"]) and 0.005 < record["aux_loss"] < 0.1, records
    assert (tmp_path / "checkpoints").is_dir()
