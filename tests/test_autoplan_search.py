"""`plan --auto`: the proxy compile, the search, `--apply`, and its errors."""

import functools
import json
import os
import subprocess
import sys

import jax
import pytest
import yaml

import jaxspeed as js
from jaxspeed.autoplan.calibrate import QUICK, calibrate
from jaxspeed.autoplan.search import NoPlanFits, compiled_cost, proxy_sizes, search
from jaxspeed.autoplan.space import Candidate
from jaxspeed.cli import main
from jaxspeed.config.cluster import load_cluster, save_cluster
from jaxspeed.runtime.mesh import CONFIG_AXES as AXES
from jaxspeed.train.loop import train
from test_cli import ROOT

MODEL = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
         "max_seq_len": 32, "mlp": "swiglu"}
CONFIG = {"model": MODEL, "data": {"seq_len": 32, "max_bytes": 200_000}, "train_batch_size": 16,
          "bf16": {"enabled": True}, "logging": {"every_n_steps": 1}}


@pytest.fixture(scope="module")
def cluster():
    return calibrate(name="here", **QUICK)


@pytest.fixture(scope="module")
def cost(cluster):
    """`compiled_cost` of a plan of CONFIG on the first `devices` devices, each compiled once
    in this file (the proxy test's ZeRO-3 plan is the offload test's comparison)."""
    config = js.load_config(CONFIG)

    @functools.cache
    def cost_of(p: Candidate, devices: int = 8):
        return compiled_cost(config, p, cluster, jax.devices()[:devices])

    return cost_of


def plan(mesh, stage, remat="none", micro=2, accumulation=1, schedule=None):
    return Candidate(tuple((a, mesh.get(a, 1)) for a in AXES), stage, remat, micro, accumulation, schedule)


def test_proxy_sizes_shrink_data_only():
    sizes = {"pipe": 2, "data": 64, "sequence": 1, "expert": 1, "tensor": 2}
    assert proxy_sizes(sizes, 8) == {**sizes, "data": 2}
    assert proxy_sizes({**sizes, "tensor": 4}, 8) is None  # data cannot go below 2
    assert proxy_sizes({**sizes, "data": 1, "tensor": 4}, 8) == {**sizes, "data": 1, "tensor": 4}


@pytest.mark.parametrize("stage", [0, 3])
def test_proxy_compile_equals_the_full_compile_at_8_devices(cost, stage):
    """data 8 compiled on 8 devices vs the proxy (data 4 on 4 devices): the same FLOPs per
    device; the same memory at stage 0, and an upper bound within 10% under ZeRO-3 (the
    proxy's sharded gradients in its temporaries are not scaled back). ZeRO-3 with full
    remat: the plan `test_offloaded_plans_compile_and_pay_the_host_link` compares with."""
    p = plan({"data": 8}, stage, "full" if stage == 3 else "none")
    full, proxy = cost(p), cost(p, 4)
    assert full.source == "compiled" and proxy.source == "compiled (proxy data=4)"
    assert proxy.flops == full.flops
    if stage == 0:
        assert proxy.device_bytes == full.device_bytes
    else:
        assert full.device_bytes <= proxy.device_bytes <= 1.1 * full.device_bytes


def test_search_ranks_compiled_plans_and_apply_runs(cluster, tmp_path):
    config = js.load_config(CONFIG)
    ranked = search(config, cluster, top=3, verify=2, progress=False)
    assert 1 <= len(ranked) <= 2  # the compiled plans rank alone (all emulate here)
    assert [r.step_s for r in ranked] == sorted(r.step_s for r in ranked)
    assert all(r.source == "compiled" and r.device_bytes <= cluster.device_memory_bytes for r in ranked)
    assert all(r.tokens_per_s > 0 and 0 < r.mfu < 1 and r.bound in ("compute", "memory", "network", "bubble")
               for r in ranked)

    # --apply: a config `train` runs as is, which passes `plan`'s fit check (the one plan
    # verified is the search's first above: its compile is loaded from the compilation cache)
    cluster_file = save_cluster(cluster, tmp_path / "here.yaml")
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(CONFIG))
    out = tmp_path / "best.yaml"
    assert main(["plan", str(base), "--auto", "--cluster", str(cluster_file), "--verify", "1",
                 "--top", "2", "--apply", str(out), "--no-progress"]) == 0
    chosen = js.load_config(out)
    assert chosen.model.model_dump() == config.model.model_dump()
    assert chosen.train_batch_size == 16 and chosen.hardware.device_memory_bytes == cluster.device_memory_bytes
    # `train` checks the fit itself (the config names the cluster's device memory): a plan
    # whose compiled step does not fit would raise `DoesNotFit` here
    record = train(chosen, output_dir=tmp_path / "run", steps=1, progress=False)
    assert record["step"] == 1 and record["loss"] > 0


def test_cli_json_lists_the_plans(tmp_path, capsys):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(CONFIG))
    assert main(["plan", str(base), "--auto", "--cluster", "8xh100-nvlink", "--verify", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cluster"] == "8xh100-nvlink" and out["plans"]
    assert all(p["source"] == "analytic" for p in out["plans"])


@pytest.mark.parametrize("cluster,match", [
    ("no-such-cluster", "available"),
    ("zero-bandwidth", "inter_host.bandwidth_gbps must be > 0, got 0"),
])
def test_bad_cluster_is_one_clear_error(tmp_path, capsys, cluster, match):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(CONFIG))
    if cluster == "zero-bandwidth":
        raw = load_cluster("8xa100-10gbe-x8").model_dump(mode="json")
        raw["inter_host"]["bandwidth_gbps"] = 0
        cluster = str(tmp_path / "zero.yaml")
        (tmp_path / "zero.yaml").write_text(yaml.safe_dump(raw))
    assert main(["plan", str(base), "--auto", "--cluster", cluster]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err


def test_a_model_no_plan_fits_names_the_closest():
    config = js.load_config({**CONFIG, "model": {**MODEL, "d_model": 8192, "n_heads": 64, "n_kv_heads": 64,
                                                 "d_ff": 32768, "n_layers": 256}})
    with pytest.raises(NoPlanFits, match=r"no plan fits 8xh100-nvlink: the closest, .* needs .* GiB per "
                                         r"device of 80.0 GiB \(short by .* GiB\)"):
        search(config, load_cluster("8xh100-nvlink"), verify=0, progress=False)


#: `jaxspeed plan` for each pipeline schedule, in one process (JAX starts once); a line
#: `== SCHEDULE` before each plan's output.
PLAN_EACH_SCHEDULE = """
import sys
from jaxspeed.cli import main
for i, schedule in enumerate(("gpipe", "1f1b")):
    print("==", schedule, flush=True)
    devices = ["--cpu-devices", "8"] if i == 0 else []  # JAX starts in the first
    if main([*sys.argv[1:], *devices, "--set", f"pipeline.schedule={schedule}"]):
        sys.exit(1)
"""


def test_bf16_pipeline_compiles_at_the_default_optimisation_level(tmp_path):
    """XLA:CPU's all-reduce promotion aborted the process (no Python error) on the pipeline's
    bf16 psums at the default level, which the suite's fast-compile level skips; `plan --auto`
    met it as soon as a pipeline plan ranked high. Both schedules (gpipe, 1f1b), planned one
    after the other in one process at XLA's default level."""
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(CONFIG))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # XLA's default optimisation level
    proc = subprocess.run(
        [sys.executable, "-c", PLAN_EACH_SCHEDULE, "plan", str(base), "--json",
         "--set", "mesh.pipe=2", "--set", "mesh.data=4", "--set", "train_micro_batch_size_per_device=2",
         "--set", "pipeline.num_microbatches=2", "--set", "zero_optimization.stage=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,  # 600 a plan
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _, gpipe, one_f_one_b = proc.stdout.split("== ")
    for schedule, out in (("gpipe", gpipe), ("1f1b", one_f_one_b)):
        assert out.startswith(schedule)
        assert json.loads(out.strip().splitlines()[-1])["mesh"]["pipe"] == 2, schedule


def test_cli_calibrate_writes_a_cluster_plan_auto_reads(tmp_path, capsys):
    out = tmp_path / "here.yaml"
    assert main(["calibrate", "--out", str(out), "--name", "this-box", "--repeats", "1",
                 "--matmul-size", "256", "--collective-mib", "1"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cluster = load_cluster(out)
    assert cluster.name == printed["name"] == "this-box" and cluster.devices == jax.device_count()
    assert cluster.memory_bandwidth_gbps > 0 and cluster.peak_flops("fp32") > 0
    # the sizes reach calibrate, and the file says what it was measured with
    assert "'matmul_size': 256" in out.read_text() and "'collective_mib': 1.0" in out.read_text()


def test_cli_calibrate_rejects_a_size_that_is_not_positive(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "here.yaml"), "--matmul-size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jaxspeed calibrate: error: calibrate: matmul_size must be a positive number, got 0"
    assert not (tmp_path / "here.yaml").exists()


def test_cli_calibrate_rejects_zero_repeats(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "here.yaml"), "--repeats", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jaxspeed calibrate: error: calibrate: repeats must be a positive number, got 0"
    assert not (tmp_path / "here.yaml").exists()


def test_offloaded_plans_compile_and_pay_the_host_link(cost):
    """ZeRO-3 with params and optimizer in host memory and `offload_dots` compiles here; its
    step time includes the copies over the host link, and it does not recompute the
    projections that full remat recomputes."""
    offloaded = Candidate(tuple((a, {"data": 8}.get(a, 1)) for a in AXES), 3, "offload_dots", 2, 1,
                          None, "params")
    got = cost(offloaded)
    assert got.source == "compiled" and got.analytic.host_s > 0
    assert got.step_s >= got.analytic.host_s
    assert got.flops < cost(plan({"data": 8}, 3, "full")).flops
