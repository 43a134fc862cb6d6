"""`calibrate --config`: a training step of the config's model gives the cluster's efficiency."""

import math

import jax
import pytest

from jaxspeed.autoplan import calibrate as calibrate_module
from jaxspeed.autoplan.calibrate import QUICK, calibrate, main
from jaxspeed.autoplan.estimate import estimate
from jaxspeed.autoplan.space import from_config
from jaxspeed.autoplan.step_probe import probe_config, step_efficiency, step_probe
from jaxspeed.cli import main as cli
from jaxspeed.config import load_config
from jaxspeed.config.cluster import load_cluster

SMALL = ["model.d_model=64", "model.n_layers=2", "model.d_ff=128", "model.n_heads=2",
         "data.seq_len=32", "model.max_seq_len=32"]


def _config(*extra):
    return load_config("configs/gpt_tiny.yaml", overrides=[*SMALL, *extra])


def test_probe_config_keeps_the_per_device_batch_on_one_device():
    config = _config("train_batch_size=16", "gradient_accumulation_steps=2", "mesh.tensor=2",
                     "zero_optimization.stage=3", "optimizer.type=OneBitAdam",
                     "optimizer.params.lr=3e-4")
    probed = probe_config(config, devices=8, local=4)  # 2 hosts x 4; data 4 x tensor 2
    assert (probed.mesh.data, probed.mesh.tensor, probed.mesh.hosts) == (1, 1, 1)
    assert probed.zero_optimization.stage == 0
    # 16 rows over data 4: 2 per device a micro-step, 2 micro-steps
    assert (probed.train_batch_size, probed.train_micro_batch_size_per_device,
            probed.gradient_accumulation_steps) == (4, 2, 2)
    # the 1-bit exchange is priced apart: the step is timed with the uncompressed optimizer
    assert probed.optimizer.type == "Adam" and probed.optimizer.params.lr == 3e-4
    assert probed.model == config.model and probed.data == config.data


def test_step_efficiency_inverts_the_planners_compute_term(cluster_here):
    """A step that takes exactly what the planner prices at efficiency e gives back e."""
    config = probe_config(_config(), devices=cluster_here.devices, local=cluster_here.devices_per_host)
    one = cluster_here.model_copy(update={"devices_per_host": 1})
    for e in (0.05, 0.3, 0.9):
        priced = estimate(config, from_config(config, {"data": 1}),
                          one.model_copy(update={"efficiency": e}))
        seconds = priced.compute_s + priced.comm_s + priced.host_s
        assert step_efficiency(config, seconds, cluster_here) == pytest.approx(e, rel=1e-9)
    assert step_efficiency(config, 1e-12, cluster_here) == 1.0  # faster than the peak: at most 1


@pytest.fixture(scope="module")
def cluster_here():
    return calibrate(jax.devices()[:4], name="here", **QUICK)


def test_step_probe_trains_the_model_on_every_device():
    config = probe_config(_config(), devices=8, local=2)
    step = step_probe(config, jax.devices()[:2])
    losses = [[float(loss) for loss in step()] for _ in range(4)]
    assert all(math.isfinite(loss) for row in losses for loss in row)
    assert losses[0][0] == losses[0][1]  # the same model and batch on each device ...
    assert losses[-1][0] < losses[0][0]  # ... and the state steps on


def test_calibrate_with_a_model_takes_efficiency_from_its_timed_step(monkeypatch):
    seen = []

    def recorded(config, seconds, cluster):
        seen.append((config, seconds, cluster.efficiency))
        return 0.125

    monkeypatch.setattr(calibrate_module, "step_efficiency", recorded)
    cluster = calibrate(jax.devices()[:2], model=_config(), **QUICK)
    assert cluster.efficiency == 0.125
    (config, seconds, mlp), = seen
    assert config.mesh.hosts == 1 and seconds > 0 and 0 < mlp <= 1


def test_cli_calibrate_config_hands_the_model_over_and_says_so(tmp_path, monkeypatch):
    seen = {}

    def measured(**options):  # the measuring itself is tested above, on 2 devices
        seen.update(options)
        return calibrate(jax.devices()[:2], **QUICK)

    monkeypatch.setattr(calibrate_module, "calibrate", measured)
    out = tmp_path / "here.yaml"
    sets = [a for s in SMALL for a in ("--set", s)]
    assert cli(["calibrate", "--out", str(out), "--repeats", "1", "--config",
                "configs/gpt_tiny.yaml", *sets]) == 0
    assert seen["model"] == _config() and seen["repeats"] == 1
    assert ("# efficiency: a training step of the model of configs/gpt_tiny.yaml --set "
            "model.d_model=64") in out.read_text()
    assert 0 < load_cluster(out).efficiency <= 1
    main(tmp_path / "mlp.yaml", **QUICK)
    assert "# efficiency: a 4-layer MLP's training step." in (tmp_path / "mlp.yaml").read_text()


def test_cli_calibrate_refuses_set_without_config(tmp_path, capsys):
    assert cli(["calibrate", "--out", str(tmp_path / "x.yaml"), "--set", "steps=3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxspeed calibrate: error: calibrate: --set needs --config (the config it overrides)")
    assert not (tmp_path / "x.yaml").exists()
