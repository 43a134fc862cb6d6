"""FP8 training through the engine: every recipe on a ZeRO-3 tensor mesh (the default one with
FP8 all-gathers), and the layouts FP8 composes with, equal a plain single-device loop; the
experts under expert parallelism equal data parallelism; the delayed recipe's meta is train
state (checkpointed and restored bit for bit onto another mesh); unsupported combinations are
config errors.

The engines and the references are built once per file (`trained`, `reference`): compiling is
most of these tests' time on CPU."""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
import optax
import pytest

import jaxspeed as js
from jaxspeed.data import TokenDataset
from jaxspeed.errors import ConfigError
from jaxspeed.models import build_gpt
from jaxspeed.ops.fp8 import META
from jaxspeed.ops.losses import lm_loss
from jaxspeed.train.assembly import fp8_recipe
from numerics import assert_adam_params_close, assert_close, gpt_rtol

TINY = [
    "model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
    "model.d_ff=128", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
    "train_batch_size=16", "optimizer.params.lr=0.003", "optimizer.params.weight_decay=0.1",
    "fp8.enabled=true", "fp8.amax_history_length=4",
]
STEPS, LR = 2, 0.003
#: Two orders of the tiny GPT's step agree to this (tests/numerics.py). FP8 rounding adds no
#: term: both programs quantize the same values, up to that rounding, with the same scales (an
#: amax is a max, exact in any order), so an element lands on another FP8 value only where it
#: lies within that rounding of a midpoint between two, a chance of about rho / 2**-3 per
#: element, and then moves the loss by one element's share.
RHO = gpt_rtol(tokens=16 * 32, d_model=64, d_ff=128, n_layers=2, vocab=256)
#: Every recipe runs on the tensor mesh at ZeRO-3, which splits the weights both ways the
#: sharding meets FP8's scales: over `tensor` (a projection's amax and its rows reduced across
#: the weight's shards) and over `data` by ZeRO-3. ZeRO-3 gathers this tiny model's weights once
#: a step, before any FP8 cast and whatever the recipe (the other recipes' case); with
#: `fp8_all_gather` (tensorwise only: the default recipe's case) XLA gathers them at each use
#: after the cast, the shards quantized with the amax of the whole weight. ZeRO-2 (which splits
#: only gradients and optimizer state, outside the FP8 matmuls) and a data-only ZeRO-3 mesh take
#: no FP8 path these do not; weights not split at all (stage 0) run in LAYOUTS' sequence-
#: parallel engine, and ZeRO-3 streaming them from the host in its offload one.
MESHES = {
    "data4_tensor2/stage3": ["mesh.data=4", "mesh.tensor=2", "zero_optimization.stage=3"],
    "data4_tensor2/stage3/fp8_all_gather": ["mesh.data=4", "mesh.tensor=2",
                                            "zero_optimization.stage=3",
                                            "zero_optimization.fp8_all_gather=true"],
}
#: The mesh each recipe runs on.
CASES = {"tensorwise": "data4_tensor2/stage3/fp8_all_gather",
         "rowwise": "data4_tensor2/stage3", "delayed": "data4_tensor2/stage3"}
SHARDED = tuple(MESHES["data4_tensor2/stage3"])
#: The other layouts FP8 composes with, checked with the default recipe (sequence parallelism
#: and full remat in one engine: both change the step around the FP8 matmuls, not them). Not a
#: pipeline: its microbatches each take their own current scales (as gradient accumulation's
#: do, and torchtitan's), a finer quantization than the whole batch's, so it is not this
#: reference.
LAYOUTS = {
    "data4_sequence2/remat_full": ["mesh.data=4", "mesh.sequence=2",
                                   "activation_checkpointing.policy=full"],
    "stage3/offload": ["mesh.data=8", "zero_optimization.stage=3",
                       "zero_optimization.offload_param.device=cpu",
                       "zero_optimization.offload_optimizer.device=cpu"],
}


def config(recipe, *overrides):
    return js.load_config(None, overrides=[*TINY, f"fp8.recipe={recipe}", *overrides])


@functools.cache
def batches():
    data = TokenDataset.from_config(config("tensorwise").data, seed=0)
    return tuple(data.batch(i, global_batch=16) for i in range(STEPS))


@pytest.fixture(scope="module", autouse=True)
def _forget_engines():
    """The engines and references live as long as this file's tests."""
    yield
    for cached in (trained, reference, batches):
        cached.cache_clear()


def run(engine, state):
    """`state` after a train step on each of `batches()`, and the steps' losses."""
    losses = []
    for batch in batches():
        state, metrics = engine.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


@functools.cache
def trained(recipe, overrides):
    """The engine of `recipe` and `overrides` (a tuple), its initial params and FP8 meta on the
    host, its state after `STEPS` steps and their losses."""
    engine = js.initialize(config(recipe, *overrides))
    state = engine.init(jax.random.key(0))
    start = jax.device_get((state.params, state.fp8_meta))
    return engine, start, *run(engine, state)


@functools.cache
def reference(recipe):
    """A plain single-device loop from the initial params and meta of `recipe`'s engines (every
    mesh's `init` draws the same; `check_equals_single_device` checks it): Flax apply,
    `jax.value_and_grad`, optax AdamW; the delayed recipe's meta replaced by its gradient, as
    Flax's `TrainState.apply_gradients` does. Returns the start, the losses, params and meta."""
    start = trained(recipe, tuple(MESHES[CASES[recipe]]))[1]
    cfg = config(recipe)
    model = build_gpt(cfg.model, fp8=fp8_recipe(cfg))
    tx = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    params, meta = start
    opt_state = tx.init(params)

    @jax.jit
    def step(params, meta, opt_state, batch):
        def loss_of(p, m):
            variables = {"params": p} if m is None else {"params": p, META: m}
            return lm_loss(model.apply(variables, batch["inputs"]), batch)

        loss, (grads, new_meta) = jax.value_and_grad(loss_of, argnums=(0, 1))(params, meta)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_meta, opt_state, loss

    losses = []
    for batch in batches():
        params, meta, opt_state, loss = step(params, meta, opt_state, batch)
        losses.append(float(loss))
    return start, np.array(losses), params, meta


@pytest.mark.parametrize("recipe,mesh_name", CASES.items())
def test_fp8_engine_equals_single_device(recipe, mesh_name):
    check_equals_single_device(recipe, MESHES[mesh_name])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_composes_with_pipeline_sequence_offload_and_remat(layout):
    check_equals_single_device("tensorwise", LAYOUTS[layout])


def check_equals_single_device(recipe, overrides):
    engine, start, state, losses = trained(recipe, tuple(overrides))
    assert (state.fp8_meta is not None) == (recipe == "delayed")
    want_start, want_losses, want_params, want_meta = reference(recipe)
    chex.assert_trees_all_equal(start, want_start)
    assert_close(losses, want_losses, rtol=RHO)
    assert_adam_params_close(jax.device_get(state.params), want_params, steps=STEPS, lr=LR,
                             rho=RHO)
    if recipe == "delayed":  # the amaxes of both steps, rolled into the histories
        got = jax.device_get(state.fp8_meta)
        assert_close(got, want_meta, rtol=RHO)
        history = got["layers"]["mlp"]["wi_input_amax_history"]
        assert history.shape == (2, 4) and np.all(np.sum(history > 0, axis=1) == STEPS)


def test_fp8_experts_equal_single_device():
    """The experts' FP8 matmuls under expert parallelism (each expert's own scales)."""
    moe = ("model.moe.num_experts=4", "model.moe.k=2", "model.moe.capacity_factor=2.0",
           "model.moe.use_rts=false")
    _, start, _, losses = trained("tensorwise", (*moe, "mesh.data=2", "mesh.expert=4"))
    _, ref_start, _, ref_losses = trained("tensorwise",
                                          (*moe, "mesh.data=8", "model.moe.num_groups=8"))
    chex.assert_trees_all_equal(ref_start, start)
    assert_close(losses, ref_losses, rtol=RHO)


def test_delayed_meta_is_checkpointed_and_restored_onto_another_mesh(tmp_path):
    """The delayed recipe's state after `STEPS` steps on the tensor mesh at ZeRO-3 (the one
    `test_fp8_engine_equals_single_device` checks), restored onto plain data parallelism."""
    engine, _, state, _ = trained("delayed", SHARDED)
    engine.save(state, directory=tmp_path)
    engine.checkpointer(tmp_path).wait()
    restored = js.initialize(config("delayed", "mesh.data=8")).restore(directory=tmp_path)
    chex.assert_trees_all_equal(jax.device_get(restored.fp8_meta), jax.device_get(state.fp8_meta))
    assert int(restored.step) == STEPS


@pytest.mark.parametrize(("overrides", "names"), [
    (["fp8.recipe=delayed", "mesh.pipe=2"], ("fp8.recipe=delayed", "mesh.pipe")),
    (["fp8.recipe=delayed", "optimizer.type=OneBitAdam"], ("fp8.recipe=delayed", "OneBitAdam")),
    (["fp8.recipe=delayed", "model.moe.num_experts=4"], ("fp8.recipe=delayed", "model.moe")),
    (["model.moe.num_experts=4", "model.moe.drop_tokens=false"], ("fp8.enabled", "drop_tokens")),
    (["fp8.recipe=rowwise", "zero_optimization.stage=3", "zero_optimization.fp8_all_gather=true"],
     ("fp8_all_gather", "fp8.recipe")),
    (["fp8.enabled=false", "zero_optimization.stage=3", "zero_optimization.fp8_all_gather=true"],
     ("fp8_all_gather", "fp8.enabled")),
    (["fp8.recipe=blockwise"], ("fp8.recipe", "tensorwise")),
    (["fp8.skip=[mlp]"], ("fp8.skip", "wo")),
])
def test_unsupported_combinations_name_both_keys(overrides, names):
    with pytest.raises(ConfigError) as err:
        js.load_config(None, overrides=[*TINY, *overrides])
    assert all(name in str(err.value) for name in names), str(err.value)


@pytest.mark.parametrize("overrides", [["fp8.recipe=delayed"],
                                       ["zero_optimization.fp8_all_gather=true"]])
def test_explicit_zero3_collectives_refuse_what_they_do_not_carry(overrides):
    with pytest.raises(ConfigError, match=overrides[0].split("=")[0]):
        js.initialize(config("tensorwise", "mesh.data=8", "zero_optimization.stage=3",
                             "zero_optimization.collectives=explicit", *overrides))


def test_skipped_projections_stay_in_the_compute_dtype():
    """`fp8.skip` leaves those projections out: the step's HLO has fewer f8 dots than without
    it (the engine `test_fp8_engine_equals_single_device` trains; its step loads from XLA's
    compilation cache)."""
    def f8_dots(engine):
        return engine.compile_train_step().as_text().count("f8e4m3fn")

    mesh = MESHES[CASES["tensorwise"]]
    skipping = js.initialize(config("tensorwise", *mesh, "fp8.skip=[wi,wo]"))
    assert 0 < f8_dots(skipping) < f8_dots(trained("tensorwise", tuple(mesh))[0])
