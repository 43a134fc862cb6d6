"""What `plan --auto` says: why no plan is legal, and its progress in a log (no terminal)."""

import re

import pytest
import yaml

import jaxspeed as js
from jaxspeed.autoplan.search import search
from jaxspeed.autoplan.space import meshes, why_no_plan
from jaxspeed.cli import main
from jaxspeed.config.cluster import load_cluster
from jaxspeed.errors import ConfigError

MODEL = {"vocab_size": 256, "d_model": 48, "n_layers": 6, "n_heads": 6, "d_ff": 192, "max_seq_len": 32}
#: 6 heads and 6 layers leave tensor <= 2 and pipe <= 2 (sequence <= 2), so 64 devices keep
#: data x expert >= 16, which a global batch of 8 rows cannot split into
NO_PLAN = {"model": MODEL, "data": {"seq_len": 32}, "train_batch_size": 8}


def test_no_legal_plan_names_the_rule_and_the_model_sizes_in_its_way():
    config = js.load_config(NO_PLAN)
    with pytest.raises(ConfigError) as err:
        search(config, load_cluster("8xa100-10gbe-x8"), verify=0, progress=False)
    message = str(err.value)
    assert message.startswith("no legal plan for this model on 64 devices (8 per host): data x expert "
                              "must divide train_batch_size=8, but every mesh the other rules allow "
                              "has data x expert in [16, 32, 64]"), message
    assert "tensor must divide n_heads=6, n_kv_heads=6 and d_ff=192" in message
    assert "pipe must divide n_layers=6" in message
    # a larger batch, or 8 heads (tensor 8), would leave a legal plan
    assert list(meshes(js.load_config({**NO_PLAN, "train_batch_size": 16}), 64, 8))
    assert list(meshes(js.load_config(
        {**NO_PLAN, "model": {**MODEL, "n_heads": 8, "d_ff": 256}}), 64, 8))


def test_only_pipelines_with_too_few_microbatches_is_said_so():
    config = js.load_config({**NO_PLAN, "model": {**MODEL, "n_layers": 2}, "train_batch_size": 16})
    assert why_no_plan(config, 64, 8) == (
        "every legal mesh is a pipeline (pipe in [2]), and a pipeline needs at least as many "
        "microbatches as stages: train_batch_size=16 / (data x expert) must be >= pipe")


def test_cli_no_legal_plan_is_one_line(tmp_path, capsys):
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(NO_PLAN))
    assert main(["plan", str(path), "--auto", "--cluster", "8xa100-10gbe-x8", "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("jaxspeed plan: error: no legal plan") and "n_heads=6" in err[0]


def test_search_progress_is_plain_lines_while_it_runs(monkeypatch, capsys):
    """Without a terminal, lines come while the plans are costed and compiled, not at the end."""
    monkeypatch.setenv("JAXSPEED_PROGRESS_SECONDS", "0.02")
    config = js.load_config({"model": {**MODEL, "n_layers": 2, "n_heads": 4, "d_ff": 64, "d_model": 32},
                             "data": {"seq_len": 32, "max_bytes": 200_000}, "train_batch_size": 8})
    ranked = search(config, load_cluster("8xh100-nvlink"), top=1, verify=1, progress=True)
    assert ranked and ranked[0].source.startswith("compiled")
    err = capsys.readouterr().err.splitlines()
    costing = [line for line in err if line.startswith("plan --auto: costing plans: ")]
    total = int(re.match(r"plan --auto: costing plans: \d+/(\d+)", costing[-1]).group(1))
    assert costing[-1].startswith(f"plan --auto: costing plans: {total}/{total} (100%)")
    assert "plan --auto: compiling the 1 best plans ..." in err
    compiled = [line for line in err if line.startswith("plan --auto: compiled: ")]
    assert compiled and compiled[-1].startswith("plan --auto: compiled: 1/1 (100%)")
    assert f"last={ranked[0].plan.describe()}" in compiled[-1]
    assert any(line.startswith("plan --auto: compiling the 1 best plans: done in") for line in err)
