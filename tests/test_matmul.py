"""jaxspeed.ops.matmul: bf16 einsums widened to fp32 on CPUs without bf16 units give the plain
einsum's result, in its dtype, with the same residuals under every remat policy."""

import contextlib
import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspeed.ops import matmul
from jaxspeed.errors import JaxspeedError
from jaxspeed.ops.losses import lm_loss
from jaxspeed.models import GPT
from jaxspeed.ops.remat import checkpoint_policy
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


def test_a_program_compiled_for_a_gpu_never_widens(monkeypatch):
    """A GPU's step compiled on this CPU host (`plan --target`) keeps its bf16 dots."""
    monkeypatch.setenv(matmul.ENV, "widen")
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                      platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=gpu)):
        assert not matmul.widens_bf16()
    assert matmul.widens_bf16()


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
    # Widened: every dot takes fp32 operands, the forward one and the backward pass's two.
    assert _dot_operand_dtypes(loss(matmul.einsum), a, b) == [("float32", "float32")]
    grad_dots = _dot_operand_dtypes(jax.grad(loss(matmul.einsum), argnums=(0, 1)), a, b)
    assert len(grad_dots) >= 3 and set(grad_dots) == {("float32", "float32")}, grad_dots


def test_widened_einsum_differentiates_one_operand_or_three(monkeypatch):
    """The JVP takes one product per perturbed operand: a constant operand adds none, and a
    three-operand einsum gets all three terms."""
    a, b = _operands()
    c = jax.random.normal(jax.random.key(2), (16, 4), jnp.float32).astype(jnp.bfloat16)
    spec = "blk,kn,nm->blm"
    loss = lambda f: lambda a, b, c: jnp.sum(f(spec, a, b, c).astype(jnp.float32))  # noqa: E731
    want = jax.grad(loss(jnp.einsum), argnums=(0, 1, 2))(a, b, c)
    monkeypatch.setenv(matmul.ENV, "widen")
    got = jax.grad(loss(matmul.einsum), argnums=(0, 1, 2))(a, b, c)
    rtol = mixed_rtol(width=K * 16, depth=3, casts=3, dtype="bfloat16")
    assert_close(got, want, rtol=rtol)
    only_b = jax.grad(loss(matmul.einsum), argnums=1)(a, b, c)
    assert_close(only_b, want[1], rtol=rtol)
    # Only b perturbed: the forward's two dots, and the backward's through b alone.
    assert len(_dot_operand_dtypes(jax.grad(loss(matmul.einsum), argnums=1), a, b, c)) < len(
        _dot_operand_dtypes(jax.grad(loss(matmul.einsum), argnums=(0, 1, 2)), a, b, c))


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


def _saved(monkeypatch, choice, fn, *args):
    """The shapes and dtypes (`bf16[2,8]`) `fn`'s backward pass saves, widening as `choice`."""
    monkeypatch.setenv(matmul.ENV, choice)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return sorted(line.split()[0] for line in printed.getvalue().splitlines())


@pytest.mark.parametrize("policy", ["none", "full", "dots_saveable",
                                    "dots_with_no_batch_dims_saveable"])
def test_widening_keeps_the_residuals_of_every_policy(monkeypatch, policy):
    """No fp32 copy is kept for the backward pass: the same values, shapes and dtypes are saved
    as without widening."""
    fn = _two_layers if policy == "none" else jax.checkpoint(
        _two_layers, policy=checkpoint_policy(policy))
    a, b = _operands()
    assert _saved(monkeypatch, "widen", fn, a, b) == _saved(monkeypatch, "native", fn, a, b)


TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32)


def _gpt(policy, n_layers=TINY["n_layers"]):
    """The tiny GPT (layers scanned, as the engine runs them), its bf16 params and a batch."""
    model = GPT(**{**TINY, "n_layers": n_layers}, remat_policy=policy)
    tokens = jax.random.randint(jax.random.key(0), (4, 32), 0, TINY["vocab_size"])
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    params = nn.unbox(model.init(jax.random.key(1), tokens))
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)  # the engine's bf16 copy
    return (lambda p: lm_loss(model.apply(p, batch["inputs"]), batch)), params


def _gpt_step(policy, n_layers=TINY["n_layers"]):
    loss, params = _gpt(policy, n_layers)
    return jax.jit(jax.value_and_grad(loss)), params


@pytest.mark.parametrize("policy", ["full", "dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_gpt_keeps_the_residuals_of_every_policy_widened(monkeypatch, policy):
    """As `test_widening_keeps_the_residuals_of_every_policy`, inside the scanned layers of the
    model (where a `custom_vjp` around the dot would hide it from the `dots` policies)."""
    loss, params = _gpt(policy)
    assert _saved(monkeypatch, "widen", loss, params) == _saved(monkeypatch, "native", loss, params)


@pytest.mark.parametrize("policy", ["none", "full", "dots_saveable"])
def test_gpt_bf16_step_is_the_same_widened_and_no_larger(monkeypatch, policy):
    layers = TINY["n_layers"]
    results, temp = {}, {}
    for choice in ("native", "widen"):
        monkeypatch.setenv(matmul.ENV, choice)
        for depth in (layers, 2 * layers):
            step, params = _gpt_step(policy, depth)  # traced anew: the choice is read then
            temp[choice, depth] = step.lower(params).compile().memory_analysis().temp_size_in_bytes
            if depth == layers:
                results[choice] = step(params)
    # tests/numerics.py point 4, counted as in test_models' bf16 test: per layer 8 reductions
    # and 16 roundings to bf16, 4 of each outside the layers; the backward pass triples both.
    width = 4 * 32
    rtol = mixed_rtol(width=width, depth=8 * layers + 4, casts=16 * layers + 4, dtype="bfloat16")
    grad_rtol = mixed_rtol(width=width, depth=3 * (8 * layers + 4), casts=3 * (16 * layers + 4),
                           dtype="bfloat16")
    loss, grads = results["widen"]
    assert_close(loss, results["native"][0], rtol=rtol)
    assert_close(grads, results["native"][1], rtol=grad_rtol)
    # The widened copies are rematerialised, not kept. The fp32 backward dots add scratch: an
    # fp32 cotangent and product at a time (here about 2 of the widest fp32 product, [4, 32, 64]
    # scores or MLP hidden), the same at twice the depth, not a copy per layer.
    widest = 4 * 32 * max(TINY["d_ff"], TINY["n_heads"] * 32) * 4
    extra = {depth: temp["widen", depth] - temp["native", depth] for depth in (layers, 2 * layers)}
    assert extra[layers] <= 4 * widest, temp
    assert extra[2 * layers] <= extra[layers] + widest, temp


def test_logits_einsum_takes_a_bf16_cotangent_in_its_backward_dots(monkeypatch):
    """The LM head's dot: float32 logits forward, and the two backward dots take the
    cotangent rounded to bf16 (not float32 operands at the TF32 rate on a GPU)."""
    monkeypatch.setenv(matmul.ENV, "native")
    a, b = _operands()
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))  # noqa: E731
    head = lambda a, b: matmul.logits_einsum("blk,kn->bln", a, b)  # noqa: E731
    plain = lambda a, b: jnp.einsum("blk,kn->bln", a, b,  # noqa: E731
                                    preferred_element_type=jnp.float32)
    got = head(a, b)
    assert got.dtype == jnp.float32
    assert_close(got, plain(a, b), rtol=mixed_rtol(width=K, depth=1, casts=0, dtype="bfloat16"))
    got_grads = jax.grad(loss(head), argnums=(0, 1))(a, b)
    assert [g.dtype for g in got_grads] == [jnp.bfloat16, jnp.bfloat16]
    # The reference: the plain dot's transposes, fed the cotangent rounded to bf16 by hand.
    g = jnp.cos(plain(a, b)).astype(jnp.bfloat16)
    want = (jnp.einsum("bln,kn->blk", g, b, preferred_element_type=jnp.float32),
            jnp.einsum("blk,bln->kn", a, g, preferred_element_type=jnp.float32))
    assert_close(got_grads, tuple(w.astype(jnp.bfloat16) for w in want),
                 rtol=mixed_rtol(width=K * 16, depth=2, casts=2, dtype="bfloat16"))
    grad_dots = _dot_operand_dtypes(jax.grad(loss(head), argnums=(0, 1)), a, b)
    assert grad_dots.count(("bfloat16", "bfloat16")) == 3, grad_dots  # forward + 2 backward
    fp32 = [x.astype(jnp.float32) for x in (a, b)]
    assert _dot_operand_dtypes(jax.grad(loss(head), argnums=(0, 1)), *fp32) == [
        ("float32", "float32")] * 3
