"""Engine numerics against a single-device plain-optax reference, ZeRO memory, accumulation."""

import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxspeed as js
from jaxspeed.data import TokenDataset
from jaxspeed.ops.losses import lm_loss
from jaxspeed.models import build_gpt
from numerics import assert_adam_params_close, gpt_rtol

TINY = [
    "model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
    "model.d_ff=128", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
    "optimizer.params.lr=0.003", "optimizer.params.weight_decay=0.1", "gradient_clipping=1.0",
    "scheduler.type=WarmupLR", "scheduler.params.warmup_num_steps=3",
    "scheduler.params.warmup_type=linear",
]
STEPS = 5
GLOBAL_BATCH = 16
LR = 0.003
#: Two orders of the tiny GPT's step agree to this (tests/numerics.py).
RHO = gpt_rtol(tokens=GLOBAL_BATCH * 32, d_model=64, d_ff=128, n_layers=2, vocab=256)


def tiny_config(*overrides):
    return js.load_config(None, overrides=[*TINY, f"train_batch_size={GLOBAL_BATCH}", *overrides])


@pytest.fixture(scope="module")
def dataset():
    return TokenDataset.from_config(tiny_config().data, seed=0)


def batches(dataset, n=STEPS, global_batch=GLOBAL_BATCH):
    return [dataset.batch(i, global_batch=global_batch) for i in range(n)]


def run_engine(cfg, dataset, n=STEPS, global_batch=GLOBAL_BATCH):
    engine = js.initialize(cfg)
    state = engine.init(jax.random.key(0))
    losses = []
    for batch in batches(dataset, n, global_batch):
        state, metrics = engine.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return engine, state, np.array(losses)


MESHES = {"data8": ["mesh.data=8"], "data4_tensor2": ["mesh.data=4", "mesh.tensor=2"]}
#: Stage 3 gathers the tiny model once per step (it is under `max_live_parameters`); "3/layer"
#: is stage 3 gathering each layer at each use, as a model over the budget does.
STAGES = (0, 1, 2, 3, "3/layer")
STAGE_OVERRIDES = {s: [f"zero_optimization.stage={s}"] for s in range(4)} | {
    "3/layer": ["zero_optimization.stage=3", "zero_optimization.max_live_parameters=0"]}


@pytest.fixture(scope="module")
def engine_runs(dataset):
    runs = {}
    for mesh_name, mesh in MESHES.items():
        for stage in STAGES:
            runs[mesh_name, stage] = run_engine(
                tiny_config(*mesh, *STAGE_OVERRIDES[stage]), dataset
            )
    return runs


def reference_from(engine, dataset, n=STEPS):
    """Single-device plain-optax run of `n` steps from the engine's own initial params."""
    state0 = engine.init(jax.random.key(0))
    params = jax.device_put(jax.device_get(state0.params), jax.devices()[0])
    model = build_gpt(engine.config.model)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.linear_schedule(0.0, 0.003, 3), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1),
    )
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss_of = lambda p: lm_loss(model.apply({"params": p}, batch["inputs"]), batch)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches(dataset, n):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return np.array(losses), jax.device_get(params)


@pytest.fixture(scope="module")
def single_device(engine_runs, dataset):
    engine, _, _ = engine_runs["data8", 0]
    return reference_from(engine, dataset)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_zero_matches_single_device(engine_runs, single_device, mesh_name, stage):
    ref_losses, ref_params = single_device
    engine, state, losses = engine_runs[mesh_name, stage]
    np.testing.assert_allclose(losses, ref_losses, rtol=RHO)
    assert_adam_params_close(state.params, ref_params, steps=STEPS, lr=LR, rho=RHO)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_zero_stages_agree_with_each_other(engine_runs, mesh_name):
    _, base, base_losses = engine_runs[mesh_name, 0]
    for stage in STAGES[1:]:
        _, state, losses = engine_runs[mesh_name, stage]
        np.testing.assert_allclose(losses, base_losses, rtol=RHO)
        assert_adam_params_close(state.params, base.params, steps=STEPS, lr=LR, rho=RHO)


@pytest.mark.parametrize("stage", STAGES)
def test_state_lives_in_planned_shardings(engine_runs, stage):
    engine, state, _ = engine_runs["data4_tensor2", stage]
    for arr, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(engine.state_shardings)):
        assert arr.sharding.is_equivalent_to(sharding, arr.ndim)


def test_init_again_neither_traces_nor_compiles(engine_runs, caplog):
    """`init` keeps its jitted program: another seed reuses it (a real model's init compiles for
    seconds), and each seed still gets its own state. `abstract_state` traces it once."""
    engine, _, _ = engine_runs["data8", 3]  # its engine has run `init` once
    engine.abstract_state()
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        again, other = engine.init(jax.random.key(0)), engine.init(jax.random.key(1))
        engine.abstract_state()
    assert not [r.getMessage() for r in caplog.records if "_init_fn" in r.getMessage()]
    chex.assert_trees_all_equal(again, js.initialize(engine.config).init(jax.random.key(0)))
    assert not np.array_equal(again.params["embedding"], other.params["embedding"])


def state_bytes(engine):
    abstract = engine.abstract_state()
    from jaxspeed.cost.memory import sharded_bytes

    return sharded_bytes(abstract.params), sharded_bytes(abstract.opt_state)


def test_zero_memory_follows_stages():
    """Adam fp32 on data=8: stage 1 opt state ≤ 1/8 of stage 0 + 1%, stage 3 state ≤ 1/8 + 2%."""
    engines = [
        js.initialize(tiny_config("mesh.data=8", f"zero_optimization.stage={s}")) for s in range(4)
    ]
    params, opt = zip(*(state_bytes(e) for e in engines))
    assert opt[1] <= opt[0] / 8 * 1.01
    assert params[1] == params[0]
    assert params[3] + opt[3] <= (params[0] + opt[0]) / 8 * 1.02
    grads = [e.plan.bytes_per_device("grad") for e in engines]
    assert grads[1] == grads[0] and grads[2] <= grads[0] / 8 * 1.02

    # The compiled step agrees: its arguments (state + batch) shrink the same way.
    args = [e.compile_train_step().memory_analysis().argument_size_in_bytes for e in (engines[0], engines[3])]
    batch_bytes = 2 * GLOBAL_BATCH * 32 * 4 // 8
    assert args[1] - batch_bytes <= (args[0] - batch_bytes) / 8 * 1.02


def test_gradient_accumulation_matches_one_big_batch(dataset):
    big = run_engine(tiny_config("mesh.data=8", "gradient_accumulation_steps=1",
                                 "train_batch_size=64"), dataset, n=3, global_batch=64)
    accum = run_engine(tiny_config("mesh.data=8", "gradient_accumulation_steps=4",
                                   "train_micro_batch_size_per_device=2", "train_batch_size=64"),
                       dataset, n=3, global_batch=64)
    assert accum[0].batch_sizes.accumulation_steps == 4
    rho = gpt_rtol(tokens=64 * 32, d_model=64, d_ff=128, n_layers=2, vocab=256)
    np.testing.assert_allclose(accum[2], big[2], rtol=rho)
    assert_adam_params_close(accum[1].params, big[1].params, steps=3, lr=LR, rho=rho)


def test_fp16_overflow_skips_and_backs_off(dataset):
    # 2**40 times the loss overflows fp16 in the backward pass: every step overflows.
    cfg = tiny_config("mesh.data=8", "fp16.enabled=true", "fp16.initial_scale_power=40",
                      "fp16.hysteresis=2", "fp16.loss_scale_window=1000")
    engine = js.initialize(cfg)
    state = engine.init(jax.random.key(0))
    params0 = jax.device_get(state.params)
    opt0 = jax.device_get(state.opt_state)
    scales, skipped = [], []
    for batch in batches(dataset, n=3):
        state, metrics = engine.train_step(state, batch)
        scales.append(float(metrics["loss_scale"]))
        skipped.append(int(metrics["skipped"]))
    assert skipped == [1, 1, 1]
    # hysteresis 2: the first overflow only spends hysteresis, the next ones halve the scale
    assert scales == [2.0**40, 2.0**39, 2.0**38]
    chex.assert_trees_all_equal(jax.device_get(state.params), params0)
    chex.assert_trees_all_equal(jax.device_get(state.opt_state), opt0)
    assert int(state.step) == 3


def test_fp16_trains_with_a_sane_scale(dataset):
    cfg = tiny_config("mesh.data=8", "fp16.enabled=true", "fp16.initial_scale_power=8")
    _, state, losses = run_engine(cfg, dataset)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


def test_bf16_keeps_fp32_master_weights(dataset):
    _, state, losses = run_engine(tiny_config("mesh.data=8", "bf16.enabled=true"), dataset)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert losses[-1] < losses[0]


def test_eval_step_does_not_change_state(engine_runs, dataset):
    engine, state, _ = engine_runs["data8", 3]
    batch = dataset.batch(0, global_batch=GLOBAL_BATCH, split="eval")
    before = jax.device_get(state.params)
    loss = float(engine.eval_step(state, batch)["loss"])
    assert np.isfinite(loss)
    chex.assert_trees_all_equal(jax.device_get(state.params), before)


def test_memory_report_fields(engine_runs):
    engine, _, _ = engine_runs["data4_tensor2", 3]
    report = engine.memory_report()
    per = report["per_device_bytes"]
    assert set(per) == {"params", "grads", "opt_state", "temp", "total", "device", "host"}
    assert per["total"] >= per["temp"] > 0 and report["host_bytes"] == 0
    assert per["device"] == per["total"] and report["notes"] == []


def test_sharded_bytes_counts_the_whole_state(engine_runs):
    from jaxspeed.cost.memory import sharded_bytes

    engine, _, _ = engine_runs["data8", 3]
    abstract = engine.abstract_state()
    assert sharded_bytes(abstract) == sum(
        sharded_bytes(part) for part in (abstract.step, abstract.params, abstract.opt_state, abstract.rng)
    )


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_stage3_within_the_live_budget_gathers_once_per_step(engine_runs, mesh_name):
    """Under `max_live_parameters` the step gathers every param once (bf16 would halve the
    bytes; here fp32); layer by layer it gathers in the forward scan and again in the backward
    scan, once per layer each time."""
    from jaxspeed.cost.hlo import collectives

    def gathers(stage):
        engine = engine_runs[mesh_name, stage][0]
        ops = collectives(engine.compile_train_step().as_text(), num_devices=8)
        gathered = [op for op in ops if op.kind == "all-gather"]
        return sum(op.executions for op in gathered), sum(op.bytes * op.executions
                                                          for op in gathered)

    (once, once_bytes), (per_layer, per_layer_bytes) = gathers(3), gathers("3/layer")
    engine = engine_runs[mesh_name, 3][0]
    assert engine.config.zero_optimization.max_live_parameters >= engine.param_count
    assert per_layer > once and per_layer_bytes > once_bytes
    param_bytes = 4 * engine.param_count  # fp32 compute: the whole model, once
    assert once_bytes <= param_bytes
