"""Checkpoints: exact resume, restore onto another mesh/ZeRO stage, preemption, bad input, export."""

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from flax import serialization

import jaxspeed as js
from jaxspeed.checkpoint import Checkpointer, CheckpointError
from jaxspeed.data import TokenDataset
from jaxspeed.errors import REQUEUE_EXIT_CODE
from jaxspeed.train.loop import NonFiniteLoss, train
from jaxspeed.train.trained import load_trained
from numerics import gpt_rtol

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000", "train_batch_size=8",
    "optimizer.params.lr=0.003", "gradient_clipping=1.0", "logging.every_n_steps=1",
]


def config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


@functools.cache
def _engine(overrides: tuple[str, ...]):
    return js.initialize(config(*overrides))


def engine_of(*overrides):
    """One engine per config for the whole file: its programs compile once."""
    return _engine(overrides)


@pytest.fixture(scope="module")
def dataset():
    return TokenDataset.from_config(config().data, seed=0)


def run(engine, state, dataset, steps):
    losses = []
    for step in range(int(state.step), int(state.step) + steps):
        state, metrics = engine.train_step(state, dataset.batch(step, global_batch=8))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize(
    "overrides",
    [["zero_optimization.stage=0"], ["zero_optimization.stage=3"],
     ["zero_optimization.stage=3", "fp16.enabled=true", "fp16.initial_scale_power=30"]],
    ids=["zero0", "zero3", "zero3-fp16"],
)
def test_resume_is_bit_exact(tmp_path, dataset, overrides):
    cfg = config("mesh.data=8", *overrides)
    first = js.initialize(cfg)
    half, losses_a = run(first, first.init(jax.random.key(0)), dataset, 10)
    first.save(half, directory=tmp_path)
    first.checkpointer(tmp_path).wait()
    # another engine, which never saw that run: nothing carried over but the checkpoint
    second = engine_of("mesh.data=8", *overrides)
    resumed, losses_b = run(second, second.restore(directory=tmp_path), dataset, 10)
    straight, straight_losses = run(second, second.init(jax.random.key(0)), dataset, 20)

    assert losses_a + losses_b == straight_losses
    chex.assert_trees_all_equal(jax.device_get(resumed.params), jax.device_get(straight.params))
    chex.assert_trees_all_equal(jax.device_get(resumed.opt_state), jax.device_get(straight.opt_state))
    chex.assert_trees_all_equal(jax.random.key_data(resumed.rng), jax.random.key_data(straight.rng))
    if cfg.fp16.enabled:
        chex.assert_trees_all_equal(jax.device_get(resumed.loss_scale), jax.device_get(straight.loss_scale))
        assert int(resumed.loss_scale.hysteresis) >= 0


@pytest.mark.parametrize(
    "saved, restored",
    [(["mesh.data=8", "zero_optimization.stage=3"], ["mesh.data=4", "mesh.tensor=2", "zero_optimization.stage=1"]),
     (["mesh.data=4", "mesh.tensor=2", "zero_optimization.stage=1"], ["mesh.data=8", "zero_optimization.stage=3"])],
    ids=["z3-data8-to-z1-tp2", "z1-tp2-to-z3-data8"],
)
def test_restore_onto_another_mesh_and_stage(tmp_path, dataset, saved, restored):
    engine = engine_of(*saved)  # z3-data8: test_resume_is_bit_exact[zero3]'s engine
    state, _ = run(engine, engine.init(jax.random.key(0)), dataset, 3)
    engine.save(state, directory=tmp_path)
    engine.checkpointer(tmp_path).wait()
    _, never_moved = run(engine, state, dataset, 3)

    moved_engine = engine_of(*restored)
    moved = moved_engine.restore(directory=tmp_path)
    for arr, sharding in zip(jax.tree.leaves(moved), jax.tree.leaves(moved_engine.state_shardings)):
        assert arr.sharding.is_equivalent_to(sharding, arr.ndim)
    _, moved_losses = run(moved_engine, moved, dataset, 3)
    # Another mesh and stage sum in another order (tests/numerics.py): 8 x 16 tokens a step.
    rho = gpt_rtol(tokens=8 * 16, d_model=32, d_ff=64, n_layers=2, vocab=256)
    np.testing.assert_allclose(moved_losses, never_moved, rtol=rho)


def test_load_trained_rebuilds_a_run_on_one_device(tmp_path, dataset):
    """A ZeRO-3 run on 8 devices, rebuilt from its checkpoint alone on one: its saved config
    describes the engine (the mesh made for one device), Orbax gathers each array exactly."""
    engine = engine_of("mesh.data=8", "zero_optimization.stage=3")
    state, _ = run(engine, engine.init(jax.random.key(0)), dataset, 2)
    engine.save(state, directory=tmp_path / "run")
    engine.checkpointer(tmp_path / "run").wait()

    rebuilt, restored = load_trained(tmp_path / "run", devices=jax.devices()[:1])
    assert rebuilt.mesh.size == 1 and rebuilt.config.model == engine.config.model
    assert int(restored.step) == 2
    chex.assert_trees_all_equal(jax.device_get(restored.params), jax.device_get(state.params))
    chex.assert_trees_all_equal(jax.device_get(restored.opt_state),
                                jax.device_get(state.opt_state))

    bare = Checkpointer(tmp_path / "bare", async_save=False)  # a record without its config
    bare.save(state, meta={"step": 2})
    with pytest.raises(CheckpointError, match="no saved config"):
        load_trained(tmp_path / "bare")

def test_incompatible_checkpoint_names_the_leaf(tmp_path):
    engine = engine_of("mesh.data=8", "zero_optimization.stage=0")  # its init compiled above
    engine.save(engine.init(jax.random.key(0)), directory=tmp_path)
    engine.checkpointer(tmp_path).wait()
    before = sorted(p.name for p in tmp_path.iterdir())
    other = js.initialize(config("model.d_model=64"))
    with pytest.raises(CheckpointError, match=r"params\.embedding: saved \(256, 32\), model needs \(256, 64\)"):
        other.restore(directory=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    engine = engine_of("mesh.data=8", "zero_optimization.stage=0")
    engine.save(engine.init(jax.random.key(0)), directory=tmp_path)
    engine.checkpointer(tmp_path).wait()
    for f in (tmp_path / "0" / "state").rglob("d/*"):  # the array data files
        f.unlink()
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        js.initialize(config()).restore(directory=tmp_path)


def test_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        Checkpointer(tmp_path).restore(None)


def test_train_resumes_and_exports(tmp_path):
    cfg = config("checkpoint.every_n_steps=2", "checkpoint.keep=2")
    straight = tmp_path / "straight"
    train(cfg, output_dir=straight, steps=6, progress=False)
    resumed = tmp_path / "resumed"
    train(cfg, output_dir=resumed, steps=4, progress=False)
    record = train(cfg, output_dir=resumed, steps=6, progress=False)  # continues from step 4
    read = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["step"] for r in read(resumed)] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in read(resumed)] == [r["loss"] for r in read(straight)]
    assert record["step"] == 6
    assert Checkpointer(resumed / "checkpoints").all_steps() == [4, 6]  # keep=2

    out = js.export_params(resumed / "checkpoints", tmp_path / "params.msgpack")
    params = serialization.msgpack_restore(out.read_bytes())
    engine = js.initialize(cfg)
    expected = jax.device_get(engine.restore(directory=resumed / "checkpoints").params)
    chex.assert_trees_all_equal(params, expected)

    from jaxspeed.cli import main

    assert main(["export", str(resumed / "checkpoints"), "--out", str(tmp_path / "p2.msgpack")]) == 0
    assert (tmp_path / "p2.msgpack").read_bytes() == out.read_bytes()
    assert main(["export", str(resumed / "checkpoints"), "--out", str(tmp_path / "p.bin")]) == 2
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "p3.msgpack")]) == 2


def test_non_finite_loss_stops_without_saving(tmp_path):
    cfg = config("optimizer.params.lr=1.0e+30", "gradient_clipping=0.0", "checkpoint.every_n_steps=1")
    with pytest.raises(NonFiniteLoss, match=r"at step \d+"):
        train(cfg, output_dir=tmp_path, steps=10, progress=False)
    ckpt = Checkpointer(tmp_path / "checkpoints")
    for step in ckpt.all_steps():  # whatever was saved is finite
        state, _ = ckpt.restore(js.initialize(cfg).abstract_state(), step=step)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


def _steps_of_a_live_run(ckpt_dir) -> list[int]:
    """The complete steps in `ckpt_dir` while a run writes there (none before it exists).

    The run deletes old steps (`checkpoint.keep`) as it saves new ones, so a step can vanish
    between Orbax listing the folder and reading the step's metadata: then list again.
    """
    while True:
        if not ckpt_dir.exists():
            return []
        try:
            return Checkpointer(ckpt_dir).all_steps()
        except FileNotFoundError:
            time.sleep(0.1)


def _logged_steps(metrics: Path) -> list[int]:
    """The steps `metrics.jsonl` holds (a line a live run is writing is left out)."""
    steps = []
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            break
    return steps


def _wait_for(done, what: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not done():
        assert time.time() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.5)


@pytest.mark.slow
def test_kill_and_sigterm_lose_no_complete_step_and_resume(tmp_path):
    """One CLI run stopped twice and then finished (three starts, each compiling its step):

    1. kill -9 while async saves run every step: the restart resumes from the last complete one.
    2. SIGTERM, with the periodic saves off: it saves the step it reached (no completed step is
       lost) and exits 75, so a scheduler may requeue it; one line, no traceback.
    3. The requeued run continues from that checkpoint.

    The children inherit the suite's XLA flags (tests/conftest.py); `--cpu-devices` replaces
    their device count.
    """
    cfg = tmp_path / "cfg.json"
    saving = [*TINY, "checkpoint.every_n_steps=1", "checkpoint.keep=2"]
    cfg.write_text(json.dumps(js.load_config(None, overrides=saving).to_dict()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run_dir = tmp_path / "run"
    ckpt_dir, metrics = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    cmd = [sys.executable, "-m", "jaxspeed.cli", "train", str(cfg), "--cpu-devices", "8",
           "--output", str(run_dir), "--no-progress"]
    procs = []
    try:
        killed = subprocess.Popen([*cmd, "--steps", "100000"], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(killed)
        _wait_for(lambda: len(_steps_of_a_live_run(ckpt_dir)) >= 2, "2 complete checkpoints")
        time.sleep(1.3)  # land somewhere inside the next saves
        killed.kill()
        killed.wait(timeout=60)
        complete = Checkpointer(ckpt_dir).latest_step()
        assert complete is not None and complete >= 2
        reached = max(_logged_steps(metrics))  # >= complete: the kill may lose a save, not a log

        # `checkpoint.` keys may change on a resume; without periodic saves only SIGTERM saves
        stopped = subprocess.Popen(
            [*cmd, "--steps", "100000", "--set", "checkpoint.every_n_steps=0"], cwd=ROOT,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(stopped)
        _wait_for(lambda: max(_logged_steps(metrics), default=0) >= reached + 2,
                  "2 steps of the restarted run")
        stopped.send_signal(signal.SIGTERM)
        _, err = stopped.communicate(timeout=120)
    finally:
        for proc in procs:
            proc.kill()
    assert stopped.returncode == REQUEUE_EXIT_CODE, err  # saved: a scheduler may requeue it
    assert "SIGTERM" in err and "exit code 75: requeue" in err and "Traceback" not in err
    saved = Checkpointer(ckpt_dir).latest_step()
    logged = _logged_steps(metrics)
    # it resumed right after the last complete step (the killed run's later records dropped)
    assert logged == list(range(1, len(logged) + 1)) and logged[-1] > reached
    assert saved is not None and saved > complete and saved >= logged[-1]  # none lost

    resume = subprocess.run([*cmd, "--steps", str(saved + 2)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert Checkpointer(ckpt_dir).latest_step() == saved + 2
    assert _logged_steps(metrics)[-2:] == [saved + 1, saved + 2]
