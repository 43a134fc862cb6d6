"""Blocked (FlashAttention) attention against a plain dense softmax, and `model.attention`."""

from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_lowering import lower_for_cuda
from jaxspeed.attention import blocked_attention
from jaxspeed.attention.block_sparse import causal_attention as kernel_causal
from jaxspeed.config import load_config
from jaxspeed.errors import ConfigError
from jaxspeed.ops.losses import lm_loss
from jaxspeed.models import GPT, build_gpt
from jaxspeed.models.dense_attention import attend, causal_attention
from numerics import assert_close, mixed_rtol, program_rtol
from test_benchmarks import check_result, run_quick


def dense_attention(q, k, v, *, causal):
    """The same attention written plainly: `[batch, heads, q_len, kv_len]` fp32 scores."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) / np.sqrt(q.shape[-1])
    if causal:
        keep = jnp.tril(jnp.ones(scores.shape[-2:], dtype=bool))
        scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def attention_rtol(*, length, head_dim, blocks, dtype, grads):
    """How far two orders of attention may differ (tests/numerics.py's model).

    Forward: three chained reductions (scores over head_dim, the softmax sum, `p @ v` over
    length); the online softmax adds a rounding per key block (the rescale) and one division.
    The backward pass chains two more products per forward reduction. In bf16 the two programs
    round different values to bf16: the probabilities and the output; for gradients also `dP`
    (the reference computes `dO @ V^T` in bf16), `dS` (cast for the score product's transpose)
    and the gradient itself.
    """
    depth = (3 + blocks + 1) * (3 if grads else 1)
    width = max(length, head_dim)
    if dtype == jnp.float32:
        return program_rtol(width=width, depth=depth)
    return mixed_rtol(width=width, depth=depth, casts=5 if grads else 2, dtype="bfloat16")


def qkv_do(seed, shape, dtype):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("block_q, block_kv", [(16, 16), (16, 8), (8, 24)])
def test_blocked_equals_dense_forward_and_gradients(dtype, causal, block_q, block_kv):
    length, head_dim = 50, 8  # 50 is no multiple of any block: padded and masked
    q, k, v, do = qkv_do(0, (2, length, 3, head_dim), dtype)

    def blocked(q, k, v):
        return blocked_attention(q, k, v, causal=causal, block_q=block_q, block_kv=block_kv)

    out, vjp = jax.jit(lambda *a: jax.vjp(blocked, *a))(q, k, v)
    want, vjp_want = jax.jit(lambda *a: jax.vjp(lambda *b: dense_attention(*b, causal=causal), *a))(
        q, k, v
    )
    assert out.dtype == want.dtype and out.shape == want.shape
    blocks = -(-length // block_kv)
    rtol = attention_rtol(length=length, head_dim=head_dim, blocks=blocks, dtype=dtype, grads=False)
    assert_close(out, want, rtol=rtol)
    grads, grads_want = jax.jit(vjp)(do), jax.jit(vjp_want)(do)
    rtol = attention_rtol(length=length, head_dim=head_dim, blocks=blocks, dtype=dtype, grads=True)
    for got, expected in zip(grads, grads_want):
        assert got.dtype == expected.dtype
        assert_close(got, expected, rtol=rtol)


def test_causal_rows_see_no_later_keys():
    q, k, v, _ = qkv_do(1, (1, 40, 2, 8), jnp.float32)
    out = blocked_attention(q, k, v, causal=True, block_q=16, block_kv=16)
    changed = blocked_attention(q, k.at[:, -1].add(1.0), v.at[:, -1].add(1.0), causal=True,
                                block_q=16, block_kv=16)
    np.testing.assert_array_equal(out[:, :-1], changed[:, :-1])
    assert not np.array_equal(out[:, -1], changed[:, -1])


def test_dense_reference_is_the_models_causal_attention():
    q, k, v, _ = qkv_do(2, (1, 12, 2, 4), jnp.float32)
    np.testing.assert_array_equal(causal_attention(q, k, v), dense_attention(q, k, v, causal=True))


def test_bad_arguments_are_clear_errors():
    q = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match="block_kv must be a positive integer, got 0"):
        blocked_attention(q, q, q, block_kv=0)
    with pytest.raises(ValueError, match="expected q"):
        blocked_attention(q, q[:, :, :1], q)


def test_runs_inside_shard_map_with_varying_inputs():
    """The loop carries and cotangents take the inputs' varying axes (shard_map's check_vma)."""
    from jax.sharding import AxisType, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
    q, k, v, _ = qkv_do(3, (2, 20, 2, 8), jnp.float32)

    def loss(q, k, v):
        out = blocked_attention(q, k, v, causal=True, block_q=8, block_kv=8)
        return jax.lax.psum(jnp.sum(out**2), "data")

    sharded = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=mesh,
                            in_specs=(P("data"),) * 3, out_specs=(P("data"),) * 3)
    want = jax.grad(lambda *a: jnp.sum(dense_attention(*a, causal=True) ** 2), argnums=(0, 1, 2))
    rtol = attention_rtol(length=20, head_dim=8, blocks=3, dtype=jnp.float32, grads=True)
    assert_close(jax.jit(sharded)(q, k, v), jax.jit(want)(q, k, v), rtol=rtol)


def _fwd_bwd_temp_bytes(attend, length):
    x = jax.ShapeDtypeStruct((1, length, 1, 64), jnp.float32)

    def step(q, k, v, do):
        return jax.vjp(attend, q, k, v)[1](do)

    return jax.jit(step).lower(x, x, x, x).compile().memory_analysis().temp_size_in_bytes


def test_blocked_backward_does_not_materialise_length_squared():
    """Blocked fwd+bwd scratch grows like L (its [L, head_dim] arrays), not like L²; the
    dense path's holds at least one fp32 [L, L]."""
    def blocked(length):
        return _fwd_bwd_temp_bytes(
            lambda q, k, v: blocked_attention(q, k, v, causal=True, block_q=128, block_kv=128),
            length)

    small, large = blocked(2048), blocked(4096)
    assert large <= 2.5 * small, (small, large)  # doubling L about doubles it
    assert large < 4096 * 4096 * 4 / 8, large
    assert _fwd_bwd_temp_bytes(causal_attention, 2048) >= 2048 * 2048 * 4


@pytest.mark.parametrize("impl", ["blocked", "fused"])
def test_lowers_for_cuda(impl):
    """Both non-reference paths lower for an NVIDIA GPU (compiling needs one).

    With no GPU here `jax.nn.dot_product_attention(implementation=None)` lowers its XLA path;
    on a GPU it picks cuDNN where cuDNN supports the shapes and dtype.
    """
    x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        if impl == "blocked":
            out = blocked_attention(q, k, v, causal=True, block_q=64, block_kv=64)
        else:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=None)
        return out.astype(jnp.float32).sum()

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), x, x, x)
    assert "stablehlo.dot_general" in text
    if impl == "blocked":
        assert text.count("stablehlo.while") >= 4  # forward and backward: two nested loops each


# ---- the GPT's `model.attention` -------------------------------------------------------------

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=40)
LENGTH, BLOCK = 40, 16  # 3 blocks, the last one padded


def test_gpt_blocked_equals_reference_loss_and_grads():
    tokens = jax.random.randint(jax.random.key(0), (2, LENGTH + 1), 0, TINY["vocab_size"])
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    reference = GPT(**TINY, attention_impl="reference")
    blocked = GPT(**TINY, attention_impl="blocked", attention_block_q=BLOCK,
                  attention_block_kv=BLOCK)
    params = nn.unbox(jax.jit(reference.init)(jax.random.key(1), batch["inputs"]))

    def loss_and_grads(model):
        loss = lambda p: lm_loss(model.apply(p, batch["inputs"]), batch)
        return jax.jit(jax.value_and_grad(loss))(params)

    got, want = loss_and_grads(blocked), loss_and_grads(reference)
    # gpt_rtol's model with the online softmax's roundings (a rescale per key block and a
    # division) chained into each layer's attention.
    blocks = -(-LENGTH // BLOCK)
    width = max(2 * LENGTH, TINY["d_model"], TINY["d_ff"], TINY["vocab_size"])
    rtol = program_rtol(width=width, depth=3 * ((8 + blocks + 1) * TINY["n_layers"] + 4))
    assert_close(got, want, rtol=rtol)


def test_build_gpt_reads_model_attention():
    cfg = load_config({"model": {"attention": {"impl": "blocked", "block_q": 64}}})
    model = build_gpt(cfg.model)
    assert (model.attention_impl, model.attention_block_q, model.attention_block_kv) == (
        "blocked", 64, 512)
    assert build_gpt(load_config({}).model).attention_impl == "auto"
    model = build_gpt(SimpleNamespace(**TINY, attention={"impl": "fused"}))
    assert model.attention_impl == "fused"


def test_cudnn_attention_off_a_gpu_is_a_config_error_naming_the_key():
    q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(ConfigError, match=r"model\.attention\.impl: cudnn .*NVIDIA GPUs only"):
        attend(q, q, q, impl="cudnn", block_q=8, block_kv=8)


@pytest.mark.parametrize(
    "attention, match",
    [
        ({"impl": "flash"},
         r"model\.attention\.impl: .*'auto', 'fused', 'blocked', 'reference', 'cudnn' or 'pallas'"),
        ({"block_q": 0}, r"model\.attention\.block_q: .*greater than or equal to 1"),
        ({"block_kv": -4}, r"model\.attention\.block_kv: .*greater than or equal to 1"),
        ({"block_kv": "64"}, r"model\.attention\.block_kv: .*valid integer"),
        ({"block": 64}, r"model\.attention\.block: unknown key"),
    ],
)
def test_bad_model_attention_is_a_config_error(attention, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"model": {"attention": attention}})


@pytest.mark.parametrize(
    "attention, match",
    [
        ({"impl": "flash"},
         r"model\.attention\.impl: .*'auto', 'fused', 'blocked', 'reference', 'cudnn' or 'pallas' "
         r"\(got 'flash'\)"),
        ({"block_q": 0}, r"model\.attention\.block_q: .*greater than or equal to 1 \(got 0\)"),
        ({"blockq": 8}, r"model\.attention\.blockq: unknown key.*did you mean 'block_q'"),
        ("blocked", r"model\.attention: .*valid dictionary.*\(got 'blocked'\)"),
    ],
)
def test_bad_attention_options_to_build_gpt_are_config_errors(attention, match):
    with pytest.raises(ConfigError, match=match):
        build_gpt(SimpleNamespace(**TINY, attention=attention))


@pytest.mark.slow
def test_benchmark_quick_run_prints_a_result_line():
    results = run_quick("blocked_attention")
    for obj in results:
        check_result(obj, "blocked_attention")
    assert results[-1]["memory_ratio"] > 1


@pytest.mark.parametrize("length, want", [(16, "reference"), (40, "blocked")])
def test_auto_is_blocked_beyond_one_block_on_cpu(monkeypatch, length, want):
    from jaxspeed.models import dense_attention as gpt

    called = []
    monkeypatch.setattr(gpt, "blocked_attention", lambda *a, **k: called.append("blocked") or a[0])
    monkeypatch.setattr(gpt, "causal_attention", lambda *a, **k: called.append("reference") or a[0])
    q = jnp.zeros((1, length, 2, 8))
    gpt.attend(q, q, q, impl="auto", block_q=BLOCK, block_kv=BLOCK)
    assert called == [want]


# ---- model.attention.impl: pallas --------------------------------------------------------------

@pytest.mark.parametrize("kernel", [False, True])
def test_pallas_impl_equals_the_reference(kernel):
    """`pallas`: the causal block layout through block-sparse attention; off a GPU its XLA path,
    and (kernel=True) the Pallas kernel itself, interpreted."""
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, 128, 2, 16), jnp.float32) for key in keys)
    impl = "pallas" if kernel else "auto"

    def loss(attention):
        return lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v)))

    got = jax.value_and_grad(loss(lambda q, k, v: kernel_causal(q, k, v, impl=impl)),
                             argnums=(0, 1, 2))(q, k, v)
    want = jax.value_and_grad(loss(causal_attention), argnums=(0, 1, 2))(q, k, v)
    # the online softmax over 2 blocks of 64 against one softmax: sums of width 128, a rescale
    # per block, the backward's chained matmuls
    assert_close(got, want, rtol=program_rtol(width=128, depth=12))


def test_gpt_pallas_attention_equals_reference_loss():
    tiny = {**TINY, "max_seq_len": 128}
    tokens = jax.random.randint(jax.random.key(0), (2, 129), 0, TINY["vocab_size"])
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = nn.unbox(jax.jit(GPT(**tiny).init)(jax.random.key(1), batch["inputs"]))

    def loss_and_grads(impl):
        model = GPT(**tiny, attention_impl=impl)
        loss = lambda p: lm_loss(model.apply(p, batch["inputs"]), batch)
        return jax.jit(jax.value_and_grad(loss))(params)

    width = max(2 * 128, tiny["d_model"], tiny["d_ff"], tiny["vocab_size"])
    rtol = program_rtol(width=width, depth=3 * ((8 + 3) * tiny["n_layers"] + 4))
    assert_close(loss_and_grads("pallas"), loss_and_grads("reference"), rtol=rtol)


@pytest.mark.parametrize("kwargs, match", [
    ({"window": 32}, r"model\.sliding_window cannot run with model\.attention\.impl: pallas"),
    ({"segment_ids": jnp.zeros((1, 128), jnp.int32)},
     r"packed documents .*attention\.impl: pallas"),
])
def test_pallas_impl_refuses_what_the_kernel_does_not_take(kwargs, match):
    q = jnp.zeros((1, 128, 2, 16))
    with pytest.raises(ConfigError, match=match):
        attend(q, q, q, impl="pallas", block_q=64, block_kv=64, **kwargs)


def test_pallas_impl_needs_a_sequence_of_whole_blocks():
    q = jnp.zeros((1, 96, 2, 16))
    with pytest.raises(ConfigError, match=r"impl: pallas needs data\.seq_len a multiple of 64"):
        attend(q, q, q, impl="pallas", block_q=64, block_kv=64)
