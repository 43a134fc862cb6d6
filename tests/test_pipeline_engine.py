"""`mesh.pipe > 1` in the engine: 3D parallelism equals one device; checkpoints cross pipe sizes."""

import functools

import jax
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.data import TokenDataset
from jaxspeed.errors import ConfigError
from jaxspeed.runtime.mesh import AXES
from numerics import assert_adam_params_close, gpt_rtol

TINY = [
    "model.vocab_size=256", "model.d_model=32", "model.n_layers=4", "model.n_heads=2",
    "model.d_ff=64", "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=300000",
    "optimizer.params.lr=0.003", "optimizer.params.weight_decay=0.1", "gradient_clipping=1.0",
    "train_batch_size=16",
]
MICRO = 4
#: Two orders of the tiny GPT's step agree to this (tests/numerics.py).
RHO = gpt_rtol(tokens=16 * 16, d_model=32, d_ff=64, n_layers=4, vocab=256)
THREE_D = ["mesh.pipe=2", "mesh.data=2", "mesh.tensor=2", f"pipeline.num_microbatches={MICRO}"]


def config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


@functools.cache
def dataset():
    return TokenDataset.from_config(config().data, seed=0)


def single_device_mesh():
    return jax.make_mesh(
        (1,) * len(AXES), AXES, devices=jax.devices()[:1],
        axis_types=(jax.sharding.AxisType.Auto,) * len(AXES),
    )


def train(engine, state, steps, start=0):
    losses = []
    for i in range(start, start + steps):
        state, metrics = engine.train_step(state, dataset().batch(i, global_batch=16))
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


@functools.cache
def one_device():
    """The single-device engine (gradient accumulation over the microbatches) and the params
    its state starts from, on the host."""
    cfg = config("mesh.data=1", f"gradient_accumulation_steps={MICRO}")
    engine = js.initialize(cfg, mesh=single_device_mesh())
    return engine, jax.device_get(engine.init(jax.random.key(0)).params)


@functools.cache
def single_device_run(steps=5):
    engine, params = one_device()
    return train(engine, engine.init(jax.random.key(0), params=params), steps)


@functools.cache
def three_d(stage, schedule):
    """The pipe=2 x data=2 x tensor=2 engine (its steps compile once for all the tests)."""
    return js.initialize(
        config(*THREE_D, f"zero_optimization.stage={stage}", f"pipeline.schedule={schedule}")
    )


@pytest.mark.parametrize(
    "stage, schedule",
    [(1, "1f1b"), (3, "1f1b"), pytest.param(2, "interleaved", marks=pytest.mark.slow)],
)
def test_3d_training_equals_one_device(stage, schedule):
    engine = three_d(stage, schedule)
    assert engine.batch_sizes.accumulation_steps == MICRO
    layer_spec = engine.plan.params["layers"]["attn"]["query"].spec
    assert layer_spec[0] == "pipe" and "tensor" in layer_spec
    # ZeRO-1 creates its state on the 3D mesh, which must equal one device's init; the others
    # start from one device's initial params (an init program less each).
    params = None if stage == 1 else one_device()[1]
    state, losses = train(engine, engine.init(jax.random.key(0), params=params), 5)
    ref_state, ref_losses = single_device_run()
    np.testing.assert_allclose(losses, ref_losses, rtol=RHO)
    assert_adam_params_close(state.params, ref_state.params, steps=5, lr=0.003, rho=RHO)


@pytest.mark.slow
def test_checkpoint_crosses_pipeline_sizes(tmp_path):
    """A checkpoint of the 3D engine (pipe=2) restores onto one device (pipe=1), and one of
    one device onto the 3D engine: each continues like the engine that saved it (bit-exact on
    its own mesh). The engines are test_3d_training_equals_one_device's, with their steps
    compiled there."""
    pipe2, pipe1 = three_d(1, "1f1b"), one_device()[0]

    def crosses(first, second, state, directory, start):
        """Saves `first`'s `state` at step `start`; returns `second`'s state 2 steps on."""
        first.save(state, directory=directory)
        first.checkpointer(directory).wait()
        _, continued = train(first, state, 2, start=start)
        _, same_losses = train(first, first.restore(directory=directory), 2, start=start)
        np.testing.assert_array_equal(same_losses, continued)  # same mesh: bit-exact
        other, other_losses = train(second, second.restore(directory=directory), 2, start=start)
        np.testing.assert_allclose(other_losses, continued, rtol=RHO)  # reordered sums
        return other

    state, _ = train(pipe2, pipe2.init(jax.random.key(0)), 2)
    state = crosses(pipe2, pipe1, state, tmp_path / "pipe2", start=2)
    crosses(pipe1, pipe2, state, tmp_path / "pipe1", start=4)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.n_layers=3"], "n_layers=3 divisible by the 2 pipeline stages"),
        (["pipeline.num_microbatches=1", "train_batch_size=8"], "microbatches >= stages"),
        (["train_batch_size=12"], "not divisible"),
        (["gradient_accumulation_steps=2"], "differs from pipeline.num_microbatches"),
        (["model.moe={num_experts: 4}"], "model.moe with pipeline parallelism"),
    ],
)
def test_bad_pipeline_setups_are_clear_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        js.initialize(config(*THREE_D, *overrides))


def test_a_mesh_that_disagrees_with_mesh_pipe_is_a_clear_error():
    mesh = js.make_mesh(js.config.MeshConfig(pipe=2, data=4))
    with pytest.raises(ConfigError, match="pipe=2 but the config has mesh.pipe=1"):
        js.initialize(config("mesh.data=8"), mesh=mesh)


def test_balanced_partition_trains_uneven_layers():
    engine = js.initialize(config(*THREE_D, "model.n_layers=3", "pipeline.partition=balanced"))
    _, losses = train(engine, engine.init(jax.random.key(0)), 2)
    assert np.isfinite(losses).all()


def test_gpt_3d_config_builds_a_3d_engine():
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "configs" / "gpt_3d.yaml"
    engine = js.initialize(js.load_config(path))
    assert dict(engine.mesh.shape) == {
        "host": 1, "pipe": 2, "data": 2, "sequence": 1, "expert": 1, "tensor": 2}
    assert engine.config.zero_optimization.stage == 3
    assert engine.batch_sizes.accumulation_steps == engine.config.pipeline.num_microbatches
