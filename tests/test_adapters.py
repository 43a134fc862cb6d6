"""NNX modules and plain pytrees train through the engine and match a single-device run."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxspeed as js
from jaxspeed.data import TokenDataset
from jaxspeed.ops.losses import lm_loss
from numerics import assert_adam_params_close, program_rtol

CONFIG = [
    "train_batch_size=16", "data.seq_len=16", "data.max_bytes=200000", "model.max_seq_len=16",
    "optimizer.type=AdamW", "optimizer.params.lr=0.003", "optimizer.params.weight_decay=0.0",
    "scheduler.type=constant",
]
STEPS = 4
LR = 0.003
TOKENS = 16 * 16  # a step's tokens: the loss mean and every weight gradient sum over them
#: Engine (8 devices, ZeRO) vs one device (tests/numerics.py). The NNX model chains embed,
#: up, down, head, softmax and loss mean (5 reductions, at most 256 terms: the tokens, the
#: vocab); the backward pass two more products per reduction.
NNX_RHO = program_rtol(width=TOKENS, depth=3 * 5)
#: The plain pytree: head, softmax and loss mean.
PYTREE_RHO = program_rtol(width=TOKENS, depth=3 * 3)


class NnxLM(nnx.Module):
    """Embedding → MLP → head, with logical axes from `nnx.with_partitioning`."""

    def __init__(self, *, rngs: nnx.Rngs, vocab=256, embed=32, hidden=64):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(vocab, embed, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs)
        self.up = nnx.Linear(embed, hidden, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(hidden, embed, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)
        self.head = nnx.Linear(embed, vocab, kernel_init=nnx.with_partitioning(init, ("embed", "vocab")), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.down(jax.nn.gelu(self.up(x)))
        return self.head(x)


@pytest.fixture(scope="module")
def dataset():
    return TokenDataset(np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 400, np.uint8),
                        seq_len=16, seed=0)


def plain_optax_run(apply, params, dataset):
    """The oracle: plain optax on one device. Params are compared with
    `assert_adam_params_close`: Adam's m/sqrt(v) magnifies the reordered sums' rounding where a
    gradient is near zero."""
    tx = optax.adamw(LR, weight_decay=0.0)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(apply(p, batch["inputs"]), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(STEPS):
        params, opt_state, loss = step(params, opt_state, dataset.batch(i, global_batch=16))
        losses.append(float(loss))
    return np.array(losses), params


def engine_run(engine, dataset):
    state = engine.init(jax.random.key(0))
    losses = []
    for i in range(STEPS):
        state, metrics = engine.train_step(state, dataset.batch(i, global_batch=16))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


def test_nnx_model_matches_single_device(dataset):
    with nnx.use_eager_sharding(False):
        model = NnxLM(rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_losses, ref_params = plain_optax_run(
        lambda p, x: nnx.merge(graphdef, p, rest)(x), params, dataset
    )
    cfg = js.load_config(None, overrides=[*CONFIG, "mesh.data=4", "mesh.tensor=2", "zero_optimization.stage=3"])
    engine = js.initialize(config=cfg, model=model)
    leaves = {leaf.path: leaf for leaf in jax.tree.leaves(
        engine.plan.leaves, is_leaf=lambda x: isinstance(x, js.sharding.LeafPlan))}
    assert leaves["up/kernel"].logical == ("embed", "mlp")
    assert "tensor" in str(leaves["up/kernel"].param) and "data" in str(leaves["up/kernel"].param)
    losses, state = engine_run(engine, dataset)
    np.testing.assert_allclose(losses, ref_losses, rtol=NNX_RHO)
    assert_adam_params_close(state.params, ref_params, steps=STEPS, lr=LR, rho=NNX_RHO)
    assert losses[-1] < losses[0]


def test_plain_pytree_with_rules_function(dataset):
    key = jax.random.split(jax.random.key(3), 2)
    params = {"embed": 0.02 * jax.random.normal(key[0], (256, 32)),
              "head": 0.02 * jax.random.normal(key[1], (32, 256))}

    def apply(p, tokens):
        return p["embed"][tokens] @ p["head"]

    def axes(path, leaf):
        return {"embed": ("vocab", "embed"), "head": ("embed", "vocab")}[path[0].key]

    ref_losses, ref_params = plain_optax_run(apply, params, dataset)
    cfg = js.load_config(None, overrides=[*CONFIG, "mesh.data=4", "mesh.tensor=2", "zero_optimization.stage=2"])
    engine = js.initialize(config=cfg, model=apply, params=params, param_axes=axes)
    assert engine.plan.leaves["head"].param == jax.sharding.PartitionSpec(None, "tensor")
    losses, state = engine_run(engine, dataset)
    np.testing.assert_allclose(losses, ref_losses, rtol=PYTREE_RHO)
    assert_adam_params_close(state.params, ref_params, steps=STEPS, lr=LR, rho=PYTREE_RHO)


def test_linen_model_with_extra_collections_is_refused():
    class WithStats(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False)(x.astype(jnp.float32)[..., None])[..., 0]

    cfg = js.load_config(None, overrides=CONFIG)
    with pytest.raises(js.JaxspeedError, match="batch_stats"):
        js.initialize(config=cfg, model=WithStats())


def test_unknown_model_kind():
    with pytest.raises(js.JaxspeedError, match="model must be"):
        js.initialize(config=js.load_config(None, overrides=CONFIG), model=42)
