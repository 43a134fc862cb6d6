"""The GPT split into pipeline stages equals the un-pipelined GPT (loss and gradients)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspeed.errors import ConfigError
from jaxspeed.ops.losses import lm_loss
from jaxspeed.runtime.mesh import make_mesh
from jaxspeed.config import MeshConfig
from jaxspeed.models import GPT
from jaxspeed.pipeline.gpt_stages import layer_slots, pipelined_lm_objective, stage_params
from numerics import assert_close, gpt_rtol

TINY = dict(vocab_size=32, d_model=16, n_layers=4, n_heads=2, d_ff=32, max_seq_len=8)
BATCH = 8


@functools.cache
def _four_layers():
    """Params of the 4-layer GPT (init jitted: eagerly each of its ops compiles) and a batch."""
    model = GPT(**TINY)
    tokens = np.random.default_rng(1).integers(0, TINY["vocab_size"], (BATCH, 8), np.int32)
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1)}
    params = jax.jit(lambda key: nn.unbox(model.init(key, tokens))["params"])(jax.random.key(0))
    return jax.device_get(params), batch  # numpy: slicing it compiles nothing


def _setup(n_layers=4):
    """The plain GPT of `n_layers` <= 4, its params (the first layers of the 4-layer GPT's:
    the scanned layers are stacked on a leading axis) and the batch."""
    params, batch = _four_layers()
    params = {**params, "layers": jax.tree.map(lambda a: a[:n_layers], params["layers"])}
    return GPT(**{**TINY, "n_layers": n_layers}), params, batch


@jax.jit
def _plain_loss_and_grads(params, batch):
    """The plain 4-layer GPT's loss on the whole batch, and its gradient. The mean over
    microbatches of equal size of their mean token losses is the mean over all tokens."""
    return jax.value_and_grad(
        lambda p: lm_loss(GPT(**TINY).apply({"params": p}, batch["inputs"]), batch))(params)


@functools.cache
def _reference(n_layers):
    """`_plain_loss_and_grads` of the GPT of `_setup(n_layers)`. Fewer layers are the 4-layer
    GPT whose last layers add nothing: their attention and MLP output projections are zero,
    and a pre-norm residual layer is then `x -> x + 0` (one program for both models)."""
    params, batch = _four_layers()
    layers = jax.tree.map(np.copy, params["layers"])
    for branch, out in (("attn", "out"), ("mlp", "wo")):
        layers[branch][out][n_layers:] = 0.0
    loss, grads = _plain_loss_and_grads({**params, "layers": layers}, batch)
    return loss, {**grads, "layers": jax.tree.map(lambda a: a[:n_layers], grads["layers"])}


@pytest.mark.parametrize(
    "schedule, n_layers, partition",
    # Each schedule's gradient path (GPipe: autodiff through the forward loop; 1F1B: the F/B
    # custom_vjp) and each partition (balanced: gated padding layers). The partition changes
    # only the stage function, the same under both schedules, and 1F1B on the uniform split is
    # the engine's default, checked against one device by test_pipeline_engine.py.
    [("gpipe", 4, "uniform"), ("1f1b", 3, "balanced")],
)
def test_pipelined_gpt_equals_the_plain_gpt(schedule, n_layers, partition):
    mesh = make_mesh(MeshConfig(pipe=2, data=2, tensor=2))
    model, params, batch = _setup(n_layers)
    m = 4
    objective = pipelined_lm_objective(
        model, lm_loss, mesh=mesh, num_microbatches=m, schedule=schedule, partition=partition
    )
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(jax.value_and_grad(objective))(params, batch)
    ref_loss, ref_grads = _reference(n_layers)
    rtol = gpt_rtol(tokens=BATCH * 8, d_model=16, d_ff=32, n_layers=n_layers, vocab=32)
    assert_close((loss, grads), (ref_loss, ref_grads), rtol=rtol)


def test_layer_slots_uniform_and_balanced():
    np.testing.assert_array_equal(layer_slots(4, 2, "uniform"), [[0, 1], [2, 3]])
    np.testing.assert_array_equal(layer_slots(5, 3, "balanced"), [[0, 1], [2, 3], [4, -1]])
    np.testing.assert_array_equal(layer_slots(7, 4, "balanced"), [[0, 1], [2, 3], [4, 5], [6, -1]])


def test_balanced_padding_gates_and_zero_params():
    layers = {"w": jnp.arange(3.0)[:, None] + 1}
    staged, gates = stage_params(layers, layer_slots(3, 2, "balanced"))
    np.testing.assert_array_equal(staged["w"][..., 0], [[1, 2], [3, 0]])
    np.testing.assert_array_equal(gates, [[1, 1], [1, 0]])
    _, none = stage_params(layers, layer_slots(3, 3, "uniform"))
    assert none is None


def test_uneven_uniform_partition_is_a_clear_error():
    with pytest.raises(ConfigError, match="n_layers=3 divisible by the 2 pipeline stages"):
        layer_slots(3, 2, "uniform")
    with pytest.raises(ConfigError, match="pipeline.partition"):
        layer_slots(4, 2, "even")


def test_a_model_without_pieces_is_a_clear_error():
    mesh = make_mesh(MeshConfig(pipe=2, data=4))
    with pytest.raises(ConfigError, match="embed / layer_stack / logits"):
        pipelined_lm_objective(nn.Dense(3), lm_loss, mesh=mesh, num_microbatches=2, schedule="gpipe")
