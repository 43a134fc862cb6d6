"""The optimizer update's price in the planner (`autoplan.update_cost`): XLA's bytes per
parameter of each optimizer and phase, the phases a run is priced over, and the term in
`estimate`."""

import dataclasses

import pytest

from jaxspeed.autoplan import traffic
from jaxspeed.autoplan.estimate import estimate
from jaxspeed.autoplan.space import from_config
from jaxspeed.autoplan.update_cost import (
    COMPRESSED_PROBE, PLAIN_PROBE, phase_weights, update_probe, update_seconds,
)
from jaxspeed.config import load_config
from jaxspeed.config.cluster import Cluster, UpdateBandwidth

TINY = ["model.n_layers=2", "model.d_model=64", "model.d_ff=256", "data.seq_len=32",
        "model.max_seq_len=32", "train_batch_size=8", "mesh.data=4", "steps=40"]
ONEBIT_ADAM = ["optimizer.type=OneBitAdam", "optimizer.params.freeze_step=10"]
ONEBIT_LAMB = ["optimizer.type=OneBitLamb", "optimizer.params.freeze_step=10"]
ZERO_ONE = ["optimizer.type=ZeroOneAdam", "optimizer.params.var_freeze_step=10",
            "optimizer.params.local_step_scaler=2", "optimizer.params.local_step_clipper=4"]


def _config(*overrides):
    return load_config("configs/gpt_tiny.yaml", overrides=[*TINY, *overrides])


def _cluster(bandwidth=5.0):
    return Cluster(
        name="cpu", hosts=1, devices_per_host=4, device_memory="8GiB",
        peak_tflops={"bf16": 0.05, "fp32": 0.05}, efficiency=0.5,
        memory_bandwidth_gbps=bandwidth, intra_host={"bandwidth_gbps": 1.0},
        inter_host={"bandwidth_gbps": 1.0}, host_link={"bandwidth_gbps": 5.0},
        host_memory="16GiB")


def _per_param(*overrides, phase="auto"):
    """Bytes per parameter of the config's update (1 GB/s, 1e9 params: seconds = bytes)."""
    return update_seconds(_config(*overrides), params=1e9, cluster=_cluster(1.0), phase=phase)


def test_bytes_per_param_follow_what_each_update_touches():
    """AdamW reads params, gradients and both moments and writes three (>= 28 B in fp32);
    LAMB adds two norms a leaf; the compressed 1-bit updates add error feedback and the packed
    signs (measured 90 and 140 ms against 15 ms for AdamW on the tiny GPT), 1-bit LAMB also its
    fresh variance and drift factor."""
    adamw, lamb = _per_param(), _per_param("optimizer.type=Lamb")
    onebit_adam, onebit_lamb = _per_param(*ONEBIT_ADAM), _per_param(*ONEBIT_LAMB)
    assert 28 <= adamw < lamb
    assert onebit_adam > 2 * adamw
    assert onebit_lamb > 1.2 * onebit_adam
    # before the freeze 1-bit Adam is Adam on the averaged gradient: far below its compressed step
    assert _per_param(*ONEBIT_ADAM, phase="warmup") < 0.6 * onebit_adam


def test_phase_weights_price_the_phases_the_run_is_measured_in():
    assert phase_weights(_config().optimizer, 40) == {None: 1.0}
    onebit = _config(*ONEBIT_ADAM).optimizer
    assert phase_weights(onebit, 40) == {"compressed": 1.0}
    assert phase_weights(onebit, 8) == {"warmup": 1.0}  # the run ends before its freeze
    assert phase_weights(onebit, 8, "compressed") == {"compressed": 1.0}
    assert phase_weights(onebit, 40, "warmup") == {"warmup": 1.0}


def test_zero_one_phases_agree_with_the_traffic_model():
    """0/1 Adam's syncs in the priced half of the run, counted by the optimizer's own schedule,
    equal the 1-bit exchanges `traffic` prices from its own count of DeepSpeed's steps."""
    config = _config(*ZERO_ONE)
    weights = phase_weights(config.optimizer, config.steps)
    assert sum(weights.values()) == pytest.approx(1.0)
    assert set(weights) == {"local", "sync"}
    full, onebit = traffic.exchange_fractions(config, "ZeroOneAdam")
    assert full == 0.0 and weights["sync"] == pytest.approx(onebit)
    # and the local steps cost less than the syncs, which compress
    assert _per_param(*ZERO_ONE) < _per_param(*ONEBIT_ADAM)


def test_update_seconds_scale_with_params_and_bandwidth():
    config = _config()
    one = update_seconds(config, params=1e6, cluster=_cluster(1.0))
    assert update_seconds(config, params=3e6, cluster=_cluster(1.0)) == pytest.approx(3 * one)
    assert update_seconds(config, params=1e6, cluster=_cluster(4.0)) == pytest.approx(one / 4)


def test_a_calibrated_cluster_prices_compressing_phases_at_their_own_rate():
    """Plain updates at `plain_gbps`, the phases that compress at `compressed_gbps`; the
    memory bandwidth no longer counts."""
    rated = _cluster(1.0).model_copy(update={"update_bandwidth": UpdateBandwidth(
        plain_gbps=2.0, compressed_gbps=0.5)})
    for overrides, rate in (((), 2.0), (ONEBIT_ADAM, 0.5), (ONEBIT_LAMB, 0.5)):
        config = _config(*overrides)
        assert update_seconds(config, params=1e6, cluster=rated) == pytest.approx(
            update_seconds(config, params=1e6, cluster=_cluster(rate)))
    warm = _config(*ONEBIT_ADAM)
    assert update_seconds(warm, params=1e6, cluster=rated, phase="warmup") == pytest.approx(
        update_seconds(warm, params=1e6, cluster=_cluster(2.0), phase="warmup"))
    # 0/1 Adam's local steps are plain, its syncs compress
    zero_one = _config(*ZERO_ONE)
    local, sync = (update_seconds(zero_one, params=1e6, cluster=_cluster(r)) for r in (2.0, 0.5))
    weights = phase_weights(zero_one.optimizer, zero_one.steps)
    assert weights["sync"] < 1
    assert local < update_seconds(zero_one, params=1e6, cluster=rated) < sync


def test_update_probe_times_the_update_it_prices():
    """`calibrate`'s probes: one update a device, and XLA's bytes for it (at least the params,
    gradients and both moments read, and three of them written)."""
    import jax

    for probe in (PLAIN_PROBE, COMPRESSED_PROBE):
        call, nbytes = update_probe(probe, jax.devices()[:2], 4096)
        updates = call()
        assert len(updates) == 2 and updates[0].shape == (4, 1024)
        assert nbytes >= 7 * 4 * 4096


def test_estimate_prices_each_optimizers_update_in_its_compute():
    """Same plan, same bytes on the wire for the two 1-bit optimizers: the compute differs by
    exactly their updates' prices; ZeRO-1 updates a quarter of the params; offloaded moments
    are updated on the host, which is not timed."""
    cluster = _cluster()
    adam_cfg, lamb_cfg = _config(*ONEBIT_ADAM), _config(*ONEBIT_LAMB)
    plan = from_config(adam_cfg, {"data": 4})
    adam, lamb = estimate(adam_cfg, plan, cluster), estimate(lamb_cfg, plan, cluster)
    assert lamb.comm_s == pytest.approx(adam.comm_s)
    params = adam.state_bytes / 16  # fp32 params, grads, two moments at ZeRO-0
    difference = (update_seconds(lamb_cfg, params=params, cluster=cluster)
                  - update_seconds(adam_cfg, params=params, cluster=cluster))
    assert lamb.compute_s - adam.compute_s == pytest.approx(difference, rel=1e-6)
    assert difference > 0
    # the override prices another optimizer's update on the same config
    as_lamb = estimate(adam_cfg, plan, cluster, optimizer="OneBitLamb", phase="compressed")
    assert as_lamb.compute_s > adam.compute_s

    config = _config()
    zero0 = estimate(config, from_config(config, {"data": 4}), cluster)
    zero1 = estimate(config, dataclasses.replace(from_config(config, {"data": 4}), stage=1),
                     cluster)
    update0 = update_seconds(config, params=zero0.state_bytes / 16, cluster=cluster)
    assert zero0.compute_s - zero1.compute_s == pytest.approx(0.75 * update0, rel=1e-6)
    offload = load_config(config, overrides=["zero_optimization.stage=1",
                                             "zero_optimization.offload_optimizer.device=cpu"])
    hosted = estimate(offload, from_config(offload, {"data": 4}), cluster)
    assert hosted.compute_s == pytest.approx(zero1.compute_s - 0.25 * update0, rel=1e-6)
