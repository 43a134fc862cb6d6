"""ZeRO-Offload: optimizer state (and stage-3 params) in pinned_host memory, same numbers."""

import functools

import chex
import jax
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.data import TokenDataset
from jaxspeed.errors import ConfigError
from jaxspeed.memory import HOST_NOTE
from jaxspeed.offload import memory_kinds

TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000", "train_batch_size=16",
    "optimizer.params.lr=0.003", "gradient_clipping=0.5", "mesh.data=8",
]
OFFLOAD_OPT = ["zero_optimization.offload_optimizer.device=cpu"]
HOST_UPDATE = [*OFFLOAD_OPT, "zero_optimization.offload_optimizer.update_on=host"]
OFFLOAD_PARAM = [*OFFLOAD_OPT, "zero_optimization.offload_param.device=cpu"]
STEPS = 3


def config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


@functools.cache
def dataset():
    return TokenDataset.from_config(config().data, seed=0)


def run(engine, state, start, steps):
    """Steps `state`; records losses and the memory kinds of the state after each step."""
    losses, kinds = [], []
    for step in range(start, start + steps):
        state, metrics = engine.train_step(state, dataset().batch(step, global_batch=16))
        losses.append(float(metrics["loss"]))
        kinds.append((memory_kinds(state.params), memory_kinds(state.opt_state)))
    return state, losses, kinds


@functools.cache
def trained(stage: int, extra: tuple[str, ...] = ()):
    engine = js.initialize(config(f"zero_optimization.stage={stage}", *extra))
    state = engine.init(jax.random.key(0))
    init_kinds = (memory_kinds(state.params), memory_kinds(state.opt_state))
    state, losses, kinds = run(engine, state, 0, STEPS)
    return engine, state, losses, [init_kinds, *kinds]


def assert_same_run(got, want):
    _, state, losses, _ = got
    _, ref_state, ref_losses, _ = want
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    chex.assert_trees_all_close(state.params, ref_state.params, rtol=1e-6, atol=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_optimizer_state_lives_on_host_and_matches(stage):
    got = trained(stage, tuple(OFFLOAD_OPT))
    assert got[3] == [({"device"}, {"pinned_host"})] * (STEPS + 1)
    assert_same_run(got, trained(stage))


def test_host_update_matches_device_update():
    got = trained(2, tuple(HOST_UPDATE))
    assert got[3] == [({"device"}, {"pinned_host"})] * (STEPS + 1)
    assert_same_run(got, trained(2))


@pytest.mark.parametrize(
    "precision", [(), ("bf16.enabled=true", *HOST_UPDATE[1:])], ids=["fp32-device-update", "bf16-host-update"]
)
def test_offloaded_params_live_on_host_and_match(precision):
    got = trained(3, (*OFFLOAD_PARAM, *precision))
    assert got[3] == [({"pinned_host"}, {"pinned_host"})] * (STEPS + 1)
    want = trained(3, tuple(p for p in precision if p.startswith("bf16")))
    assert_same_run(got, want)
    batch = dataset().batch(9, global_batch=16)
    chex.assert_trees_all_close(got[0].eval_step(got[1], batch), want[0].eval_step(want[1], batch))


def test_offload_shows_in_the_plan_and_the_memory_report():
    engine = trained(3, tuple(OFFLOAD_PARAM))[0]
    report = engine.memory_report()
    estimate, per_device = report["estimate"], report["per_device_bytes"]
    assert report["host_bytes"] == estimate["host"] == estimate["params"] + estimate["opt_state"]
    # XLA:CPU counts host and device together: the host state comes off, the params the
    # step fetches go back on.
    assert per_device["device"] == per_device["total"] - estimate["opt_state"]
    assert report["notes"] == [HOST_NOTE]


@pytest.mark.parametrize(
    ("saved_with", "restored_with"), [(OFFLOAD_PARAM, []), ([], OFFLOAD_PARAM)], ids=["off-on", "on-off"]
)
def test_checkpoints_cross_offload(tmp_path, saved_with, restored_with):
    first = js.initialize(config("zero_optimization.stage=3", *saved_with))
    state, _, _ = run(first, first.init(jax.random.key(0)), 0, 2)
    first.save(state, directory=tmp_path)
    first.checkpointer(tmp_path).wait()
    _, want, _ = run(first, state, 2, 1)

    second = js.initialize(config("zero_optimization.stage=3", *restored_with))
    restored = second.restore(directory=tmp_path)
    expected = "pinned_host" if restored_with else "device"
    assert memory_kinds(restored.opt_state) == {expected}
    _, got, _ = run(second, restored, 2, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["zero_optimization.stage=2", "zero_optimization.offload_param.device=cpu"], "needs stage 3"),
        (["zero_optimization.offload_optimizer.update_on=host"], "needs device 'cpu'"),
        (["zero_optimization.offload_optimizer.device=nvme"], "offload_optimizer.device"),
    ],
)
def test_bad_offload_configs_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(*overrides)
