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
from jaxspeed.pipeline.model import layer_slots, pipelined_lm_objective, stage_params
from numerics import assert_close, gpt_rtol

TINY = dict(vocab_size=32, d_model=16, n_layers=4, n_heads=2, d_ff=32, max_seq_len=8)
BATCH = 8


@functools.cache
def _setup(n_layers=4):
    model = GPT(**{**TINY, "n_layers": n_layers})
    tokens = jax.random.randint(jax.random.key(1), (BATCH, 8), 0, TINY["vocab_size"])
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    params = nn.unbox(model.init(jax.random.key(0), tokens))["params"]
    return model, params, batch


def _reference(model, params, batch, m):
    """Mean over microbatches (rows i, i+M, ...) of the plain model's loss."""
    def loss(p):
        micro = jax.tree.map(lambda x: x.reshape(-1, m, *x.shape[1:]).swapaxes(0, 1), batch)
        per = [lm_loss(model.apply({"params": p}, mb["inputs"]), mb)
               for mb in (jax.tree.map(lambda x, i=i: x[i], micro) for i in range(m))]
        return sum(per) / m
    return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize(
    "schedule, n_layers, partition",
    [("1f1b", 4, "uniform"), ("gpipe", 4, "uniform"), ("1f1b", 3, "balanced")],
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
    ref_loss, ref_grads = _reference(model, params, batch, m)
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
