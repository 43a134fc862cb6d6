"""The MoE GPT in the engine: ZeRO-3 equals ZeRO-0, aux loss reaches the loss, checkpoints
cross expert-parallel sizes, bad setups are clear errors."""

import functools
import logging

import chex
import jax
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.data import TokenDataset
from numerics import assert_adam_params_close, program_rtol, sum_rtol

TINY = [
    "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
    "model.d_ff=64", "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=300000",
    "optimizer.params.lr=0.003", "gradient_clipping=1.0", "train_batch_size=16",
    "model.moe={num_experts: 4, k: 2, every_n_layers: 2, capacity_factor: 1.0}",
]
EP4 = ["mesh.expert=4", "mesh.data=2"]
EP2 = ["mesh.expert=2", "mesh.data=4"]
LR = 0.003
TOKENS = 16 * 16  # per step
#: Forward reductions of the tiny MoE GPT: `gpt_rtol`'s 8 per layer and 4 around them, plus
#: the MoE layer's own 4 (gate matmul, softmax, top-k renormalisation, combine over k; its
#: two expert matmuls stand where the dense MLP's do).
FORWARD_DEPTH = 8 * 2 + 4 + 4
#: Two orders of one step (another ZeRO stage or mesh) agree to this (tests/numerics.py):
#: widest sums over the 256 tokens (and the 256-way softmax), 3x the forward chain with the
#: backward. A misrouted or mis-sharded expert moves the loss far more.
RHO = program_rtol(width=TOKENS, depth=3 * FORWARD_DEPTH)


def config(*overrides):
    return js.load_config(None, overrides=[*TINY, *overrides])


@functools.cache
def dataset():
    return TokenDataset.from_config(config().data, seed=0)


def train(engine, state, steps, start=0):
    history = []
    for i in range(start, start + steps):
        state, metrics = engine.train_step(state, dataset().batch(i, global_batch=16))
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


@functools.cache
def run(stage, mesh=tuple(EP4), steps=3):
    engine = js.initialize(config(*mesh, f"zero_optimization.stage={stage}"))
    return engine, *train(engine, engine.init(jax.random.key(0)), steps)


@functools.cache
def run_plain(*overrides):
    """`(engine, state, history)` after 3 steps, routing without random token selection: the
    explicit ZeRO step draws each worker's own keys (as for dropout), the sharding path one per
    group. Shared by the tests that train the same engine (don't train on from its state: the
    step donates it)."""
    engine = js.initialize(config(*overrides, "model.moe.use_rts=false"))
    return engine, *train(engine, engine.init(jax.random.key(0)), 3)


def explicit_zero3(*mesh):
    return run_plain(*mesh, "zero_optimization.stage=3")


RATE = 0.01  # of the balancing bias


def biases(state):
    return np.asarray(jax.device_get(
        state.params["layers"]["moe_block"]["moe"]["selection_bias"]))


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@functools.cache
def bias_auto_run():
    """ZeRO-3, expert-parallel, the balancing bias (`model.moe.balance=bias`) and `parallelism:
    auto` over dynamic capacity (buckets of 8 and 16 slots: the cap is `run(0)`'s fixed
    capacity, so no bucket drops a choice it would keep): `(engine, the initial biases, state,
    history, the strategies' log lines)` after 3 steps. One engine for the bias's tests and
    auto's (each feature's own assertions; neither changes what the other computes)."""
    logger = logging.getLogger("jaxspeed.moe.strategies")
    messages, level = _Messages(), logger.level
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)
    try:
        engine = js.initialize(config(
            *EP4, "zero_optimization.stage=3",
            "model.moe={num_experts: 4, k: 2, every_n_layers: 2, capacity_factor: 1.0, "
            "dynamic_capacity: true, a2a_hosts: 2, parallelism: auto}",
            "model.moe.balance=bias", f"model.moe.bias_update_rate={RATE}"))
        state = engine.init(jax.random.key(0))
        initial = biases(state)
        return engine, initial, *train(engine, state, 3), messages.lines
    finally:
        logger.removeHandler(messages)
        logger.setLevel(level)


def test_moe_gpt_zero3_equals_zero0():
    _, state0, hist0 = run(0)
    engine3, state3, hist3 = run(3)
    expert_spec = engine3.plan.params["layers"]["moe_block"]["moe"]["expert_w_in"].spec
    assert expert_spec[1] == "expert" and "data" in expert_spec  # EP + ZeRO over data
    n_params = sum(a.size for a in jax.tree.leaves(state0.params))
    # The gradient norm sums the squares of all params' gradients: one more sum, positive.
    rtol = {"loss": RHO, "aux_loss": RHO, "grad_norm": sum_rtol(3 * FORWARD_DEPTH * TOKENS
                                                               + n_params)}
    for key in ("loss", "aux_loss", "grad_norm"):
        np.testing.assert_allclose(
            [h[key] for h in hist3], [h[key] for h in hist0], rtol=rtol[key], err_msg=key
        )
    assert_adam_params_close(state3.params, state0.params, steps=3, lr=LR, rho=RHO)


@pytest.mark.parametrize("mesh", [
    (*EP4, "zero_optimization.collectives=explicit"),
    ("mesh.expert=4", "mesh.data=2", "mesh.hosts=2"),  # across hosts: explicit by default
])
def test_moe_gpt_explicit_zero3_equals_zero0(mesh):
    """ZeRO-3's explicit step with the expert axis manual: the dense weights gathered and
    reduce-scattered over (host, data, expert), each worker's experts its own, the tokens
    exchanged inside the step's map. Routing without random token selection (`run_plain`)."""
    zero0, state0, hist0 = run_plain(*EP4, "zero_optimization.stage=0")
    engine, state3, hist3 = explicit_zero3(*mesh)
    assert engine.explicit_zero is not None and "expert" in engine.explicit_zero.split
    for key in ("loss", "aux_loss"):
        np.testing.assert_allclose([h[key] for h in hist3], [h[key] for h in hist0], rtol=RHO,
                                   err_msg=key)
    assert_adam_params_close(state3.params, state0.params, steps=3, lr=LR, rho=RHO)
    batch = dataset().batch(9, global_batch=16)
    np.testing.assert_allclose(float(engine.eval_step(state3, batch)["loss"]),
                               float(zero0.eval_step(state0, batch)["loss"]), rtol=RHO)


def test_moe_gpt_zeropp_with_the_expert_axis_trains_like_zero3():
    """qwZ + qgZ (int8) over (data, expert): each weight / gradient within 1/254 of its
    block's largest magnitude, so the loss within that fraction of explicit ZeRO-3's
    (`tests/test_zero_step.py`'s bound). Both without random token selection, so explicit
    ZeRO-3 is `test_moe_gpt_explicit_zero3_equals_zero0`'s engine (the explicit step with it
    on: `tests/test_zero_step.py`'s MoE case)."""
    from jaxspeed.ops import quantize as qz

    z = "zero_optimization."
    _, _, explicit = explicit_zero3(*EP4, z + "collectives=explicit")
    _, _, quantized = explicit_zero3(*EP4, z + "zero_quantized_weights=true",
                                     z + "zero_quantized_gradients=true",
                                     z + "quantized_gradient_bits=8")
    losses = [[h["loss"] for h in history] for history in (explicit, quantized)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1 / (2 * qz.QMAX[8]))
    assert losses[1] != losses[0]  # it did quantize


def test_aux_loss_is_in_the_loss_and_trains_the_router():
    engine, state, history = run(0)
    assert all(h["aux_loss"] > 0 for h in history)
    state0 = engine.init(jax.random.key(0))
    moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
        state.params["layers"]["moe_block"]["moe"]["gate_kernel"],
        state0.params["layers"]["moe_block"]["moe"]["gate_kernel"],
    )
    assert moved > 0
    # Without the aux loss the objective differs by exactly the logged aux_loss: the balancing
    # bias leaves it out, and at step 0 its zero bias routes as `run(0)` (the same params and
    # keys, the bias the layer's last parameter; the same capacity, whichever strategy runs).
    _, _, _, plain_history, _ = bias_auto_run()
    assert plain_history[0]["aux_loss"] == 0
    # Another program (no aux term, ZeRO-3, another exchange), the same forward loss: its
    # chain, no backward.
    np.testing.assert_allclose(
        history[0]["loss"] - history[0]["aux_loss"], plain_history[0]["loss"],
        rtol=program_rtol(width=TOKENS, depth=FORWARD_DEPTH),
    )


@pytest.mark.slow
def test_checkpoint_crosses_expert_parallel_sizes(tmp_path):
    """A checkpoint saved with the experts over 4 devices restores over 2, and one saved over 2
    restores over 4: every array in the restoring engine's sharding and equal to the saved one
    (the expert=4 engine is `run(0)`'s; an engine with 2 experts a device trains in
    `tests/test_muon.py`'s moe_expert2 case, and onto another mesh a restored state trains on
    in `tests/test_checkpoint.py`)."""
    def values(state):
        return jax.device_get((state.step, state.params, state.opt_state,
                               jax.random.key_data(state.rng)))

    ep4, state, _ = run(0)  # 3 steps
    ep2 = js.initialize(config(*EP2))
    saved = values(state)
    for name, (first, second) in (("ep4", (ep4, ep2)), ("ep2", (ep2, ep4))):
        first.save(state, directory=tmp_path / name)
        first.checkpointer(tmp_path / name).wait()
        state = second.restore(directory=tmp_path / name)
        for arr, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(second.state_shardings)):
            assert arr.sharding.is_equivalent_to(sharding, arr.ndim), name
        chex.assert_trees_all_equal(values(state), saved)


def test_experts_not_divisible_by_the_expert_axis_is_a_clear_error():
    engine = js.initialize(config("mesh.expert=8", "mesh.data=1",
                                  "model.moe={num_experts: 4, k: 1}"))
    with pytest.raises(ValueError, match="num_experts"):
        engine.init(jax.random.key(0))


def test_balance_bias_trains_in_the_engine_and_checkpoints(tmp_path):
    """ZeRO-3, expert-parallel: each step moves every selection bias by exactly +-rate (or 0)
    and leaves the aux loss out of the loss; the bias is saved and restored with the params
    (the engine runs `parallelism: auto` too: `bias_auto_run`)."""
    engine, initial, state, history, _ = bias_auto_run()
    assert initial.shape == (1, 4) and not initial.any()  # one MoE layer, 4 experts
    steps = np.round(biases(state) / RATE)
    np.testing.assert_allclose(biases(state), steps * RATE, atol=1e-7)  # whole steps of rate
    assert np.abs(steps).max() >= 1 and np.abs(steps).max() <= 3
    assert all(h["aux_loss"] == 0 for h in history) and all(np.isfinite(h["loss"]) for h in history)
    engine.save(state, directory=tmp_path)
    engine.checkpointer(tmp_path).wait()
    np.testing.assert_array_equal(biases(engine.restore(directory=tmp_path)), biases(state))


def test_balance_bias_refuses_a_one_bit_optimizer():
    with pytest.raises(js.ConfigError, match="model.moe.balance=bias does not go with"):
        js.initialize(config(*EP4, "model.moe.balance=bias", "optimizer.type=OneBitAdam"))


def test_auto_reports_the_strategy_each_step_ran():
    """`parallelism: auto` with dynamic capacity: each step's metrics say which strategy the
    MoE layer ran (`moe_auto_<strategy>`, 1 for the one that ran: one MoE layer here), one of
    those priced at compile time (one log line per capacity bucket: 2 here, each a branch of
    the step); a fixed strategy (`run(0)`'s `expert`) reports none. At ZeRO-3, whose step
    carries the metrics out of the sharded layers (ZeRO-0's plain step is the simpler path,
    and compiling every bucket twice took 40 s); the engine is the balancing bias's."""
    from jaxspeed.moe.strategies import STRATEGIES

    *_, history, messages = bias_auto_run()
    lines = [line for line in messages if line.startswith("MoE parallelism auto: ")]
    priced = {line.split()[3] for line in lines}
    assert len(lines) >= 2 and priced <= set(STRATEGIES), lines
    for h in history:
        ran = {s: h[f"moe_auto_{s}"] for s in STRATEGIES}
        assert sorted(ran.values()) == [0.0] * (len(STRATEGIES) - 1) + [1.0], ran
        assert max(ran, key=ran.get) in priced
    _, _, fixed = run(0)
    assert not any(key.startswith("moe_auto_") for h in fixed for key in h)
