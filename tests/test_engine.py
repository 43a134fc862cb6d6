"""Engine numerics against a single-device plain-optax reference, ZeRO memory, accumulation."""

import functools
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
from jaxspeed.ops.precision import init_loss_scale
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


def run_engine(cfg, dataset, n=STEPS, global_batch=GLOBAL_BATCH, *, params=None):
    """`n` steps from `engine.init(key 0)`; with `params`, from those and a fresh optimizer
    state (`init(params=...)`)."""
    engine = js.initialize(cfg)
    state = engine.init(jax.random.key(0), params=params)
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


#: The (mesh, stage) cases this file trains (tests/test_muon.py trains all of MESHES x STAGES):
#: every stage beside tensor parallelism, and on data8 the two ends, stage 0 (pure data
#: parallelism, the reference's engine) and stage 3 (every state leaf sharded over 8). data8's
#: other stages would shard over the data axis alone through the same planner rules and step
#: as data4_tensor2's do (their planned bytes: `test_zero_memory_follows_stages`).
GRID = [("data8", 0), ("data8", 3), *(("data4_tensor2", stage) for stage in STAGES)]
#: data8's stage 3 also splits each step's 16 rows into 2 microbatches of 1 row a device
#: (`test_gradient_accumulation_matches_one_big_batch`); data4_tensor2's stage 3 does not.
ACCUMULATE = ("gradient_accumulation_steps=2", "train_micro_batch_size_per_device=1")
EXTRA = {("data8", 3): ACCUMULATE}
#: Cases whose `init` draws the params: data8 replicated, data4_tensor2 fully sharded ("3/layer"
#: loads stage 3's init program from the compilation cache). The others start from data8 stage
#: 0's initial params (`init(params=...)`, a program of optimizer zeros instead of another
#: compile of the model's init); `test_init_draws_the_same_params_on_any_layout`.
DRAWS_PARAMS = {("data8", 0), ("data4_tensor2", 3), ("data4_tensor2", "3/layer")}


@pytest.fixture(scope="module")
def engine_runs(dataset):
    runs = {}
    for case in GRID:
        mesh_name, stage = case
        params = None if case in DRAWS_PARAMS else initial_params(runs["data8", 0][0])
        runs[case] = run_engine(
            tiny_config(*MESHES[mesh_name], *STAGE_OVERRIDES[stage], *EXTRA.get(case, ())),
            dataset, params=params)
    return runs


@pytest.fixture(scope="module")
def params0(engine_runs):
    """The grid's initial params: the other engines here start from them (`init(params=...)`)."""
    return initial_params(engine_runs["data8", 0][0])


def initial_params(engine):
    """The params `engine.init(key 0)` draws, on the host (its init program is compiled)."""
    return jax.device_get(engine.init(jax.random.key(0)).params)


def reference_from(engine, dataset, n=STEPS):
    """Single-device plain-optax run of `n` steps from the engine's own initial params."""
    device = jax.devices()[0]
    params = jax.device_put(initial_params(engine), device)
    model = build_gpt(engine.config.model)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.linear_schedule(0.0, 0.003, 3), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1),
    )
    opt_state = jax.device_put(tx.init(params), device)  # committed as the step's outputs: one compile

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


@pytest.mark.parametrize(("mesh_name", "stage"), GRID, ids=[f"{m}-{s}" for m, s in GRID])
def test_zero_matches_single_device(engine_runs, single_device, mesh_name, stage):
    ref_losses, ref_params = single_device
    engine, state, losses = engine_runs[mesh_name, stage]
    np.testing.assert_allclose(losses, ref_losses, rtol=RHO)
    assert_adam_params_close(state.params, ref_params, steps=STEPS, lr=LR, rho=RHO)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_zero_stages_agree_with_each_other(engine_runs, mesh_name):
    _, base, base_losses = engine_runs[mesh_name, 0]
    for stage in [s for m, s in GRID if m == mesh_name and s != 0]:
        _, state, losses = engine_runs[mesh_name, stage]
        np.testing.assert_allclose(losses, base_losses, rtol=RHO)
        assert_adam_params_close(state.params, base.params, steps=STEPS, lr=LR, rho=RHO)


@pytest.mark.parametrize("stage", STAGES)
def test_state_lives_in_planned_shardings(engine_runs, stage):
    engine, state, _ = engine_runs["data4_tensor2", stage]
    for arr, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(engine.state_shardings)):
        assert arr.sharding.is_equivalent_to(sharding, arr.ndim)


def test_init_draws_the_same_params_on_any_layout(engine_runs):
    """`init(key)` draws the same params replicated and ZeRO-3 sharded beside tensor
    parallelism (the grid's `init(params=...)` cases start from them)."""
    want = initial_params(engine_runs["data8", 0][0])
    chex.assert_trees_all_equal(initial_params(engine_runs["data4_tensor2", 3][0]), want)


def test_init_again_neither_traces_nor_compiles(engine_runs, caplog):
    """`init` keeps its jitted program: another seed reuses it (a real model's init compiles for
    seconds), and each seed still gets its own state. `abstract_state` traces it once."""
    engine, _, _ = engine_runs["data8", 0]  # its engine has run `init` once
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


def test_zero_memory_follows_stages(engine_runs):
    """Adam fp32 on data=8: stage 1 opt state ≤ 1/8 of stage 0 + 1%, stage 3 state ≤ 1/8 + 2%."""
    engines = [  # stages 0 and 3 trained (their steps compiled) in `engine_runs`
        engine_runs["data8", s][0] if ("data8", s) in engine_runs
        else js.initialize(tiny_config("mesh.data=8", f"zero_optimization.stage={s}"))
        for s in range(4)
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


def test_gradient_accumulation_matches_one_big_batch(engine_runs):
    """The grid's data8 stage 3, 2 microbatches of 8 rows a step, against data8 stage 0 on the
    16 rows at once (both also against the single device, `test_zero_matches_single_device`)."""
    (accum, accum_state, accum_losses), (big, big_state, big_losses) = (
        engine_runs["data8", 3], engine_runs["data8", 0])
    assert (accum.batch_sizes.accumulation_steps, big.batch_sizes.accumulation_steps) == (2, 1)
    np.testing.assert_allclose(accum_losses, big_losses, rtol=RHO)
    assert_adam_params_close(accum_state.params, big_state.params, steps=STEPS, lr=LR, rho=RHO)


FP16 = ("mesh.data=8", "fp16.enabled=true", "fp16.initial_scale_power=8")


@functools.cache
def fp16_engine():
    """One engine for both fp16 tests: the initial scale is the state's, not the step's."""
    return js.initialize(tiny_config(*FP16))


def test_fp16_overflow_skips_and_backs_off(params0, dataset):
    # 2**40 times the loss overflows fp16 in the backward pass: every step overflows.
    cfg = tiny_config(*FP16, "fp16.initial_scale_power=40", "fp16.hysteresis=2",
                      "fp16.loss_scale_window=1000")
    engine = fp16_engine()  # the same step: hysteresis and window are the defaults
    assert (cfg.fp16.hysteresis, cfg.fp16.loss_scale_window) == (
        engine.config.fp16.hysteresis, engine.config.fp16.loss_scale_window)
    state = engine.init(jax.random.key(0), params=params0)
    state = state.replace(loss_scale=jax.device_put(
        init_loss_scale(cfg.fp16), jax.tree.map(lambda x: x.sharding, state.loss_scale)))
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


def test_fp16_trains_with_a_sane_scale(params0, dataset):
    engine = fp16_engine()
    state, losses = engine.init(jax.random.key(0), params=params0), []
    for batch in batches(dataset):
        state, metrics = engine.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


def test_bf16_keeps_fp32_master_weights(params0, dataset):
    _, state, losses = run_engine(tiny_config("mesh.data=8", "bf16.enabled=true"), dataset,
                                  params=params0)
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


def test_stage3_within_the_live_budget_gathers_once_per_step(engine_runs):
    """Under `max_live_parameters` the step gathers every param once (bf16 would halve the
    bytes; here fp32); layer by layer it gathers in the forward scan and again in the backward
    scan, once per layer each time. (Beside tensor parallelism; the grid's one "3/layer" case.)"""
    mesh_name = "data4_tensor2"
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
