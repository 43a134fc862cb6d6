"""The reference GPT with block-sparse attention, and its pieces (embed / layer stacks / logits)."""

from types import SimpleNamespace

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspeed.attention import DenseSparsityConfig, FixedSparsityConfig
from jaxspeed.errors import ConfigError
from jaxspeed.models import GPT, build_gpt
from jaxspeed.models.attention import sparse_layout
from numerics import assert_close, gpt_rtol

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)
LENGTH = 32
#: Two orders of TINY's forward pass on two sequences agree to this (tests/numerics.py).
RTOL = gpt_rtol(tokens=2 * LENGTH, d_model=32, d_ff=64, n_layers=2, vocab=64)


def _tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (2, LENGTH), 0, TINY["vocab_size"])


def _params(model):
    return nn.unbox(jax.jit(model.init)(jax.random.key(0), _tokens()))


def test_dense_layout_equals_the_dense_model():
    dense = GPT(**TINY)
    params = _params(dense)
    sparse = GPT(**TINY, sparse_attention=DenseSparsityConfig(2, block=8), sparse_impl="xla")
    chex.assert_trees_all_equal_shapes(params, _params(sparse))  # same parameters
    tokens = _tokens(1)
    # The gather path sums the same scores and context in another order.
    got, want = jax.jit(sparse.apply)(params, tokens), jax.jit(dense.apply)(params, tokens)
    assert_close(got, want, rtol=RTOL)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_fixed_layout_is_causal_and_differs_from_dense(impl):
    config = FixedSparsityConfig(2, block=8, num_local_blocks=2, attention="unidirectional")
    model = GPT(**TINY, sparse_attention=config, sparse_impl=impl)
    params = _params(model)
    tokens = _tokens(2)
    logits = jax.jit(model.apply)(params, tokens)
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % TINY["vocab_size"])
    later = jax.jit(model.apply)(params, changed)
    # The same program on the same earlier tokens: their logits are bit for bit the same.
    np.testing.assert_array_equal(logits[:, :-1], later[:, :-1])
    dense = jax.jit(GPT(**TINY).apply)(params, tokens)
    # The layout drops blocks: the logits differ by more than rounding would explain.
    with pytest.raises(AssertionError):
        assert_close(logits, dense, rtol=RTOL)


def test_build_gpt_reads_the_sparse_attention_block():
    cfg = SimpleNamespace(
        **TINY, sparse_attention={"mode": "fixed", "block": 8, "num_local_blocks": 2,
                                  "attention": "unidirectional", "impl": "xla"},
    )
    model = build_gpt(cfg)
    assert isinstance(model.sparse_attention, FixedSparsityConfig)
    assert model.sparse_impl == "xla"
    assert model.sparse_attention.num_local_blocks == 2


@pytest.mark.parametrize(
    "block, match",
    [
        ({"mode": "diagonal"}, "model.sparse_attention.mode"),
        ({"mode": "fixed", "num_local_block": 2},
         r"model\.sparse_attention\.num_local_block: unknown key.*did you mean 'num_local_blocks'"),
        ({"mode": "fixed", "impl": "cuda"}, r"model\.sparse_attention\.impl: .*\(got 'cuda'\)"),
        ({"mode": "fixed", "num_heads": 3}, "num_heads"),
        ("fixed", r"model\.sparse_attention: .*valid dictionary.*\(got 'fixed'\)"),
    ],
)
def test_bad_sparse_attention_blocks_are_clear_errors(block, match):
    with pytest.raises(ConfigError, match=match):
        build_gpt(SimpleNamespace(**TINY, sparse_attention=block))


def test_sequence_not_divisible_by_block_is_a_clear_error():
    model = GPT(**TINY, sparse_attention=FixedSparsityConfig(2, block=16), sparse_impl="xla")
    tokens = jnp.zeros((1, 24), jnp.int32)
    with pytest.raises(ValueError, match="divisible by block=16"):
        model.init(jax.random.key(0), tokens)


def test_layout_is_built_once_per_config_and_length():
    config = FixedSparsityConfig(2, block=8, num_local_blocks=2)
    sparse_layout.cache_clear()
    first = sparse_layout(config, 32)
    assert sparse_layout(FixedSparsityConfig(2, block=8, num_local_blocks=2), 32) is first
    assert sparse_layout.cache_info().misses == 1
    np.testing.assert_array_equal(first, config.make_layout(32))


def test_pieces_compose_to_the_model():
    """embed → two one-layer stacks → logits equals the model (the pipeline's stage split)."""
    model = GPT(**TINY)
    params = _params(model)["params"]
    tokens = _tokens(3)
    x = model.apply({"params": params}, tokens, method=GPT.embed)
    stack = model.layer_stack(1)
    for i in range(TINY["n_layers"]):
        layer = jax.tree.map(lambda a, i=i: a[i : i + 1], params["layers"])
        x, _ = stack.apply({"params": layer}, x, None)
    logits = model.apply({"params": params}, x, method=GPT.logits)
    # Separately compiled pieces: the same sums, fused (so ordered) differently.
    assert_close(logits, model.apply({"params": params}, tokens), rtol=RTOL)
