"""jaxspeed.matmul: bf16 einsums widened to fp32 on CPUs without bf16 units give the plain
einsum's result, in its dtype, with the same residuals under every remat policy."""

import contextlib
import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspeed import matmul
from jaxspeed.errors import JaxspeedError
from jaxspeed.losses import lm_loss
from jaxspeed.models import GPT
from jaxspeed.remat import checkpoint_policy
from numerics import assert_close, mixed_rtol

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: avx avx2\n"
ZEN5 = "flags\t\t: avx2 avx512f avx512_bf16 avx512_vp2intersect\n"
SAPPHIRE = "flags\t\t: avx512f amx_bf16 amx_tile\n"
NEOVERSE = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
#: Contraction width K of the operands below.
K = 64


@pytest.mark.parametrize("text, native", [(AVX2, False), (ZEN5, True), (SAPPHIRE, True),
                                          (NEOVERSE, True), ("", False)])
def test_cpu_flags_find_bf16_matmul_units(text, native):
    assert bool(matmul.cpu_flags(text) & matmul.BF16_MATMUL_FLAGS) is native


@pytest.mark.parametrize("choice, widens", [("native", False), ("widen", True)])
def test_the_environment_overrides_the_cpu(monkeypatch, choice, widens):
    monkeypatch.setenv(matmul.ENV, choice)
    assert matmul.widens_bf16() is widens


def test_auto_widens_exactly_where_the_cpu_lacks_bf16_units(monkeypatch):
    monkeypatch.delenv(matmul.ENV, raising=False)
    assert matmul.widens_bf16() is not matmul.cpu_multiplies_bf16()


def test_a_bad_choice_is_refused(monkeypatch):
    monkeypatch.setenv(matmul.ENV, "fp32")
    with pytest.raises(JaxspeedError, match="JAXSPEED_CPU_BF16_MATMUL must be one of"):
        matmul.widens_bf16()


def _operands(dtype=jnp.bfloat16):
    a = jax.random.normal(jax.random.key(0), (2, 8, K), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (K, 16), jnp.float32)
    return a.astype(dtype), b.astype(dtype)


def _dot_operand_dtypes(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("preferred", [None, jnp.float32])
def test_widened_einsum_equals_the_plain_one(monkeypatch, preferred):
    a, b = _operands()
    loss = lambda f: lambda a, b: jnp.sum(  # noqa: E731
        jnp.sin(f("blk,kn->bln", a, b, preferred_element_type=preferred).astype(jnp.float32)))
    want = jnp.einsum("blk,kn->bln", a, b, preferred_element_type=preferred)
    want_grads = jax.grad(loss(jnp.einsum), argnums=(0, 1))(a, b)
    monkeypatch.setenv(matmul.ENV, "widen")
    got = matmul.einsum("blk,kn->bln", a, b, preferred_element_type=preferred)
    got_grads = jax.grad(loss(matmul.einsum), argnums=(0, 1))(a, b)
    assert got.dtype == want.dtype
    assert [g.dtype for g in got_grads] == [jnp.bfloat16, jnp.bfloat16]
    # Both sum exact bf16 products in fp32, in another order, then round to bf16 (one cast);
    # a gradient chains the forward sum, sin' and a second matmul (width K or 2 x 8 rows).
    assert_close(got, want, rtol=mixed_rtol(width=K, depth=1, casts=1, dtype="bfloat16"))
    assert_close(got_grads, want_grads,
                 rtol=mixed_rtol(width=K, depth=2, casts=3, dtype="bfloat16"))
    # Widened: the forward dot takes fp32 operands (the backward's take the bf16 cotangent).
    assert _dot_operand_dtypes(loss(matmul.einsum), a, b) == [("float32", "float32")]


def test_native_and_fp32_einsums_are_jnp_einsum(monkeypatch):
    a, b = _operands()
    monkeypatch.setenv(matmul.ENV, "native")
    assert _dot_operand_dtypes(lambda a, b: matmul.einsum("blk,kn->bln", a, b), a, b) == [
        ("bfloat16", "bfloat16")]
    monkeypatch.setenv(matmul.ENV, "widen")
    a32, b32 = _operands(jnp.float32)
    np.testing.assert_array_equal(matmul.einsum("blk,kn->bln", a32, b32),
                                  jnp.einsum("blk,kn->bln", a32, b32))


def _two_layers(a, b):
    h = matmul.einsum("blk,kn->bln", a, b)
    h = jax.nn.gelu(h.astype(jnp.float32)).astype(jnp.bfloat16)
    s = matmul.einsum("bln,bmn->blm", h, h)  # batch dims: attention-like
    return jnp.sum(matmul.einsum("blm,bmn->bln", s, h).astype(jnp.float32))


@pytest.mark.parametrize("policy", ["none", "full", "dots_saveable",
                                    "dots_with_no_batch_dims_saveable"])
def test_widening_keeps_the_residuals_of_every_policy(monkeypatch, policy):
    """No fp32 copy is kept for the backward pass: the same values, shapes and dtypes are saved
    as without widening."""
    fn = _two_layers if policy == "none" else jax.checkpoint(
        _two_layers, policy=checkpoint_policy(policy))
    a, b = _operands()

    def saved(choice):
        monkeypatch.setenv(matmul.ENV, choice)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            jax.ad_checkpoint.print_saved_residuals(fn, a, b)
        return sorted(line.split()[0] for line in printed.getvalue().splitlines())  # bf16[2,8]

    assert saved("widen") == saved("native")


TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)


def _gpt_step(policy):
    model = GPT(**TINY, remat_policy=policy)
    tokens = jax.random.randint(jax.random.key(0), (4, 32), 0, TINY["vocab_size"])
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    params = nn.unbox(model.init(jax.random.key(1), tokens))
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)  # the engine's bf16 copy

    def loss_and_grads(params):
        return jax.value_and_grad(lambda p: lm_loss(model.apply(p, batch["inputs"]), batch))(
            params)

    return jax.jit(loss_and_grads), params


@pytest.mark.parametrize("policy", ["none", "full", "dots_saveable"])
def test_gpt_bf16_step_is_the_same_widened_and_no_larger(monkeypatch, policy):
    results, temp = {}, {}
    for choice in ("native", "widen"):
        monkeypatch.setenv(matmul.ENV, choice)
        step, params = _gpt_step(policy)  # traced anew: the choice is read while tracing
        results[choice] = step(params)
        temp[choice] = step.lower(params).compile().memory_analysis().temp_size_in_bytes
    # tests/numerics.py point 4, counted as in test_models' bf16 test: per layer 8 reductions
    # and 16 roundings to bf16, 4 of each outside the layers; the backward pass triples both.
    layers, width = TINY["n_layers"], 4 * 32
    rtol = mixed_rtol(width=width, depth=8 * layers + 4, casts=16 * layers + 4, dtype="bfloat16")
    grad_rtol = mixed_rtol(width=width, depth=3 * (8 * layers + 4), casts=3 * (16 * layers + 4),
                           dtype="bfloat16")
    loss, grads = results["widen"]
    assert_close(loss, results["native"][0], rtol=rtol)
    assert_close(grads, results["native"][1], rtol=grad_rtol)
    # The widened copies are rematerialised, not kept: the step's scratch does not grow.
    assert temp["widen"] <= 1.05 * temp["native"], temp
