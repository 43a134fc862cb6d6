"""ZeRO-Offload: optimizer state (and stage-3 params) in pinned_host memory, same numbers."""

import functools

import chex
import jax
import jax.extend
import numpy as np
import pytest

import jaxspeed as js
from jaxspeed.data import TokenDataset
from jaxspeed.errors import ConfigError
from jaxspeed.cost.memory import HOST_NOTE, STREAM_NOTE, host_bytes
from jaxspeed.models import build_gpt
from jaxspeed.ops.offload import memory_kinds
from numerics import assert_adam_params_close, gpt_rtol

TINY = [
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
    "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000", "train_batch_size=16",
    "optimizer.params.lr=0.003", "gradient_clipping=0.5", "mesh.data=8",
    # offload runs stage 3 as a sharding (not explicit collectives): the references do too
    "zero_optimization.collectives=compiler",
]
OFFLOAD_OPT = ["zero_optimization.offload_optimizer.device=cpu"]
HOST_UPDATE = [*OFFLOAD_OPT, "zero_optimization.offload_optimizer.update_on=host"]
OFFLOAD_PARAM = [*OFFLOAD_OPT, "zero_optimization.offload_param.device=cpu"]
STEPS = 3
LR = 0.003
#: Two orders of TINY's step on 16 x 16 tokens agree to this (tests/numerics.py). In the bf16
#: and fp16 variants both runs round the same values to the same low precision; what differs
#: is the order of fp32 sums (the gradients' reduce-scatters).
RHO = gpt_rtol(tokens=16 * 16, d_model=32, d_ff=64, n_layers=2, vocab=256)


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
def _engine(stage: int, extra: tuple[str, ...], stream: bool):
    cfg = config(f"zero_optimization.stage={stage}", *extra)
    return js.initialize(cfg, model=None if stream else build_gpt(cfg.model))


def engine_of(stage: int, extra=(), *, stream: bool = True):
    """One engine per config for the whole file (its programs compile once). `stream=False`: a
    GPT built without layer streaming (offloaded params are then fetched for the whole step, as
    for any model that does not stream)."""
    return _engine(stage, tuple(extra), stream)


@functools.cache
def initial_params():
    """Key 0's params, drawn once by a whole `init` (of the offloaded-params engine, which makes
    every state leaf in host memory), on the host. The engines here start from them with
    `init(params=...)`: its program is the optimizer's zeros, not the model's init again."""
    state = engine_of(3, OFFLOAD_PARAM).init(jax.random.key(0))
    assert (memory_kinds(state.params), memory_kinds(state.opt_state)) == ({"pinned_host"},) * 2
    return jax.device_get(state.params)


def initial_state(engine):
    return engine.init(jax.random.key(0), params=initial_params())


@functools.cache
def _trained(stage: int, extra: tuple[str, ...], stream: bool):
    engine = engine_of(stage, extra, stream=stream)
    state = initial_state(engine)
    init_kinds = (memory_kinds(state.params), memory_kinds(state.opt_state))
    state, losses, kinds = run(engine, state, 0, STEPS)
    return engine, state, losses, [init_kinds, *kinds]


def trained(stage: int, extra=(), *, stream: bool = True):
    """`engine_of`'s engine, its state after `STEPS` steps, their losses, and the state's memory
    kinds after `init` and after each step."""
    return _trained(stage, tuple(extra), stream)


def assert_same_run(got, want, *, same_program: bool):
    """Bit for bit where only the state's memory kind differs (`same_program`: the same step,
    reading and writing host memory); else to the model of two orders of the same step."""
    _, state, losses, _ = got
    _, ref_state, ref_losses, _ = want
    if same_program:
        np.testing.assert_array_equal(losses, ref_losses)
        chex.assert_trees_all_equal(jax.device_get(state.params), jax.device_get(ref_state.params))
    else:
        np.testing.assert_allclose(losses, ref_losses, rtol=RHO)
        assert_adam_params_close(state.params, ref_state.params, steps=STEPS, lr=LR, rho=RHO)


# Stages 1 and 3 are left out: the planner puts the optimizer state in host memory whatever
# the stage, and the step moves it to the device and back with no branch on the stage; each
# stage's own params and gradients are tests/test_engine.py's. Stage 3's state on the host
# with its params there too: test_offloaded_params_live_on_host_and_match.
@pytest.mark.parametrize("stage", [2])
def test_offloaded_optimizer_state_lives_on_host_and_matches(stage):
    got = trained(stage, OFFLOAD_OPT)
    assert got[3] == [({"device"}, {"pinned_host"})] * (STEPS + 1)
    assert_same_run(got, trained(stage), same_program=True)


def test_host_update_matches_device_update():
    got = trained(2, HOST_UPDATE)
    assert got[3] == [({"device"}, {"pinned_host"})] * (STEPS + 1)
    # The update is compiled for the host (on a GPU machine, another processor) apart from the
    # step: another program, though on CPU it has so far matched bit for bit.
    assert_same_run(got, trained(2), same_program=False)


REMAT_ACCUMULATE = ("activation_checkpointing.policy=full", "gradient_accumulation_steps=2")


@pytest.mark.parametrize(
    ("variant", "want", "evaluate"),
    [((), (), True),
     (("bf16.enabled=true", *HOST_UPDATE[1:]), ("bf16.enabled=true",), True),
     # against the fp32 run without remat and accumulation: 2 microbatches of the same rows
     # sum the same fp32 terms in another order, as the streamed reduce-scatters do
     ((*REMAT_ACCUMULATE, *HOST_UPDATE[1:]), (), True),
     # its eval casts to fp16 as bf16-host-update's does to bf16 and splits microbatches as
     # remat-accumulate-host-update's does (eval takes no gradient: no remat, no loss scale)
     (("fp16.enabled=true", *REMAT_ACCUMULATE), ("fp16.enabled=true", *REMAT_ACCUMULATE), False)],
    ids=["fp32-device-update", "bf16-host-update", "remat-accumulate-host-update",
         "fp16-remat-accumulate-device-update"],
)
def test_offloaded_params_live_on_host_and_match(variant, want, evaluate):
    got = trained(3, (*OFFLOAD_PARAM, *variant))
    assert got[3] == [({"pinned_host"}, {"pinned_host"})] * (STEPS + 1)
    want = trained(3, want)
    # Streamed layers are reduce-scattered one layer at a time inside the backward scan, not
    # after it: the same fp32 sums in another order.
    assert_same_run(got, want, same_program=False)
    if evaluate:
        batch = dataset().batch(9, global_batch=16)
        got_eval, want_eval = got[0].eval_step(got[1], batch), want[0].eval_step(want[1], batch)
        chex.assert_trees_all_close(got_eval, want_eval, rtol=RHO)


def test_offloaded_params_of_a_model_that_does_not_stream_match():
    got = trained(3, (*OFFLOAD_PARAM, "bf16.enabled=true"), stream=False)
    assert got[0].streamed_params is None
    assert got[3] == [({"pinned_host"}, {"pinned_host"})] * (STEPS + 1)
    # Not streamed: the whole step fetches the params, then runs as without offload.
    assert_same_run(got, trained(3, ("bf16.enabled=true",)), same_program=True)


def test_offload_shows_in_the_plan_and_the_memory_report():
    engine = trained(3, OFFLOAD_PARAM)[0]
    report = engine.memory_report()
    estimate, per_device = report["estimate"], report["per_device_bytes"]
    assert report["host_bytes"] == estimate["host"] == estimate["params"] + estimate["opt_state"]
    # XLA:CPU counts host and device together: the host state comes off; the embedding and
    # norms the step fetches whole, and one of the 2 streamed layers (its fp32 slice and
    # its fp32 cast), go back on; 1 of the 2 layers' gradients goes to the host.
    params = engine.abstract_state().params
    layers = host_bytes(params["layers"])
    fetched = estimate["params"] - layers + layers // 2 * 2
    device_update = max(0, estimate["grads"] + estimate["params"] + estimate["opt_state"]
                        - (per_device["temp"] - layers // 2))
    assert per_device["device"] == (
        per_device["total"] - estimate["host"] + fetched - layers // 2 + device_update
    )
    # ... and says which of those figures are modelled: the compiled total stays as XLA gave it.
    assert [(r["term"], r["bytes"], r["source"]) for r in report["device_model"]] == [
        ("compiled_total", per_device["total"], "compiled"),
        ("host_state", -estimate["host"], "arrays"),
        ("fetched", fetched, "model"),
        ("update", device_update, "model"),
        ("streamed_grads", -(layers // 2), "model"),
    ]
    assert report["sources"]["device"] == "model" and report["sources"]["host"] == "arrays"
    assert report["notes"] == [HOST_NOTE, STREAM_NOTE]


def _device_puts_in_loops(jaxpr, in_loop=False):
    """(source memory spaces, destination) of every `device_put` inside a scan body."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put" and in_loop:
            sources = tuple(v.aval.memory_space for v in eqn.invars)
            found.append((sources, eqn.params["devices"]))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _device_puts_in_loops(sub, in_loop or eqn.primitive.name == "scan")
    return found


def test_params_stream_layer_by_layer():
    """Inside the layer scan, each layer's params move host → device, and its gradient back."""
    engine = trained(3, OFFLOAD_PARAM)[0]
    streamed = engine.streamed_params
    assert all(jax.tree.leaves(streamed["layers"]))
    assert not any(jax.tree.leaves({k: v for k, v in streamed.items() if k != "layers"}))
    with jax.set_mesh(engine.mesh):
        jaxpr = jax.make_jaxpr(engine._train[None])(engine.abstract_state(), engine.abstract_batch())
    moves = _device_puts_in_loops(jaxpr.jaxpr)
    host, device = jax.memory.Space.Host, jax.memory.Space.Device
    n_leaves = len(jax.tree.leaves(engine.abstract_state().params["layers"]))
    assert ((host,) * n_leaves, (device,) * n_leaves) in moves  # the fetch
    assert ((device,) * n_leaves, (host,) * n_leaves) in moves  # its transpose


def test_streaming_needs_less_device_memory_than_fetching_the_whole_model():
    # 4 layers: at 2 (bf16) the streamed step needed more, 320456 against 318360 bytes (seen)
    cfg = config("zero_optimization.stage=3", *OFFLOAD_PARAM, "model.n_layers=4",
                 "zero_optimization.offload_optimizer.update_on=host")
    streamed = js.initialize(cfg).memory_report()["per_device_bytes"]
    whole = js.initialize(cfg, model=build_gpt(cfg.model)).memory_report()["per_device_bytes"]
    assert streamed["host"] == whole["host"]
    assert streamed["device"] < whole["device"]


@pytest.mark.parametrize(
    ("saved_with", "restored_with"), [(OFFLOAD_PARAM, []), ([], OFFLOAD_PARAM)], ids=["off-on", "on-off"]
)
def test_checkpoints_cross_offload(tmp_path, saved_with, restored_with):
    first = engine_of(3, saved_with)  # the engines trained above, their steps compiled
    state, _, _ = run(first, initial_state(first), 0, 2)
    first.save(state, directory=tmp_path)
    first.checkpointer(tmp_path).wait()
    _, want, _ = run(first, state, 2, 1)

    second = engine_of(3, restored_with)
    restored = second.restore(directory=tmp_path)
    expected = "pinned_host" if restored_with else "device"
    assert memory_kinds(restored.opt_state) == {expected}
    _, got, _ = run(second, restored, 2, 1)
    # The same state, stepped with and without streamed layers: two orders of the same step.
    np.testing.assert_allclose(got, want, rtol=RHO)


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
