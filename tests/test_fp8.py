"""FP8 matmuls (`jaxspeed.ops.fp8`) against a plain jnp fake-quantized reference, forward and
gradients, for each recipe; and the Flax delayed recipe's meta update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops

from jaxspeed.ops import fp8
from numerics import assert_close, sum_rtol

F32 = jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

# (einsum, x shape, w shape, x's contracting axes, w's contracting axes, the gradients' einsums
# with the axes each operand is scaled along there: (spec, (g axes, other operand axes)))
CASES = {
    "dense": ("me,ef->mf", (16, 32), (32, 24), (1,), (0,),
              ("mf,ef->me", (1,), (1,)), ("me,mf->ef", (0,), (0,))),
    "heads": ("ble,ehd->blhd", (2, 8, 32), (32, 4, 8), (2,), (0,),
              ("blhd,ehd->ble", (2, 3), (1, 2)), ("ble,blhd->ehd", (0, 1), (0, 1))),
    "experts": ("ecm,emh->ech", (4, 8, 16), (4, 16, 24), (2,), (1,),
                ("ech,emh->ecm", (2,), (2,)), ("ecm,ech->emh", (1,), (1,))),
}


def fake_quant(x, dtype, axes):
    """`x` rounded to FP8 `dtype` with scales `amax / max` over `axes`, back in fp32."""
    x = x.astype(F32)
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / fmax, 1.0)
    return jnp.clip(x / scale, -fmax, fmax).astype(dtype).astype(F32) * scale


def reference(case, recipe, x, w, g):
    """Forward and gradients of the FP8 matmul, each GEMM on fake-quantized operands."""
    spec, _, _, x_axes, w_axes, (dx_spec, dx_g, dx_w), (dw_spec, dw_x, dw_g) = case
    batch = 1 if spec.startswith("ecm") else 0  # the experts' matmul is batched over e
    every = lambda a: tuple(range(batch, a.ndim))  # noqa: E731
    pick = lambda a, axes: axes if recipe == "rowwise" else every(a)  # noqa: E731
    y = jnp.einsum(spec, fake_quant(x, E4M3, pick(x, x_axes)), fake_quant(w, E4M3, pick(w, w_axes)))
    dx = jnp.einsum(dx_spec, fake_quant(g, E5M2, pick(g, dx_g)), fake_quant(w, E4M3, pick(w, dx_w)))
    dw = jnp.einsum(dw_spec, fake_quant(x, E4M3, pick(x, dw_x)), fake_quant(g, E5M2, pick(g, dw_g)))
    return y, dx, dw


def operands(case, seed=0):
    _, xs, ws = case[:3]
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, xs, F32)
    w = jax.random.normal(kw, ws, F32) * 0.05
    y_shape = jax.eval_shape(lambda a, b: jnp.einsum(case[0], a, b), x, w).shape
    # Rows of very different sizes: rowwise and tensorwise scales then differ.
    g = jax.random.normal(kg, y_shape, F32) * jnp.logspace(-3, 0, y_shape[-1])
    return x, w, g


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_current_scaling_equals_fake_quantized_reference(name, recipe):
    case = CASES[name]
    x, w, g = operands(case)
    y, vjp = jax.vjp(lambda a, b: fp8.einsum(case[0], a, b, recipe=recipe), x, w)
    dx, dw = vjp(g)
    want = reference(case, recipe, x, w, g)
    # The FP8 products are exact in fp32; only the order of the fp32 sums and the place of the
    # scale multiplication differ: one reordered sum of the widest contraction, plus 2 roundings.
    width = max(x.size, w.size)
    for got, ref in zip((y, dx, dw), want):
        assert got.dtype == F32
        assert_close(got, ref, rtol=sum_rtol(width + 2))


def test_rowwise_differs_from_tensorwise():
    """The two recipes are different computations (so the test above can tell them apart)."""
    case = CASES["dense"]
    x, w, g = operands(case)
    grads = {r: jax.vjp(lambda a, b: fp8.einsum(case[0], a, b, recipe=r), x, w)[1](g)
             for r in ("tensorwise", "rowwise")}
    assert not np.allclose(grads["tensorwise"][0], grads["rowwise"][0], rtol=1e-3)


def test_bf16_operands_keep_their_dtypes():
    case = CASES["dense"]
    x, w, g = (a.astype(jnp.bfloat16) for a in operands(case))
    y, vjp = jax.vjp(lambda a, b: fp8.einsum(case[0], a, b, recipe="tensorwise"), x, w)
    dx, dw = vjp(g)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    want = reference(case, "tensorwise", x, w, g)
    for got, ref in zip((y, dx, dw), want):  # one bf16 rounding of the result
        assert_close(got.astype(F32), ref, rtol=sum_rtol(1, "bfloat16"))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_dots_read_fp8_operands(recipe):
    """Every GEMM of forward and backward multiplies f8 operands (no silent bf16 fallback)."""
    case = CASES["heads"]
    x, w, g = operands(case)

    def loss(a, b):
        return jnp.sum(fp8.einsum(case[0], a, b, recipe=recipe) * g)

    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    f8 = [line for line in dots if "f8E4M3FN" in line]
    # 3 GEMMs (forward, d x, d w) plus their 3 scale products (size-1 contractions, fp32).
    assert len(f8) == 3, dots
    assert sum("f8E5M2" in line for line in f8) == 2


def test_zero_operand_keeps_scale_one():
    case = CASES["dense"]
    x, w, g = operands(case)
    y, vjp = jax.vjp(lambda a, b: fp8.einsum(case[0], a, b, recipe="rowwise"),
                     jnp.zeros_like(x), w)
    assert np.all(np.isfinite(y)) and not np.any(y)
    assert all(np.all(np.isfinite(d)) for d in vjp(g))


def test_delayed_uses_history_and_returns_new_meta():
    """`delayed` is Flax's `fp8_scaled_dot_general`: scales from the amax history of earlier
    steps; the meta's gradient is its next value (the current amax rolled in)."""
    case = CASES["dense"]
    x, w, g = operands(case)
    history = 4
    prior = {"x": 2.0, "w": 0.5, "g": 1.0}
    meta = {}
    for side, key in (("lhs", "x"), ("rhs", "w"), ("grad", "g")):
        meta[f"{side}_scale"] = jnp.ones((1,), F32)
        meta[f"{side}_amax_history"] = jnp.zeros((history,), F32).at[1].set(prior[key])

    def f(a, b, m):
        return jnp.sum(fp8.einsum(case[0], a, b, recipe="delayed", meta=m) * g)

    grads = jax.grad(f, argnums=(0, 1, 2))(x, w, meta)
    new = grads[2]
    assert float(new["lhs_amax_history"][0]) == pytest.approx(float(jnp.max(jnp.abs(x))))
    assert float(new["rhs_amax_history"][0]) == pytest.approx(float(jnp.max(jnp.abs(w))))
    assert float(new["grad_amax_history"][0]) == pytest.approx(float(jnp.max(jnp.abs(g))))
    fmax = float(jnp.finfo(E4M3).max)
    assert float(new["lhs_scale"][0]) == pytest.approx(prior["x"] / fmax)
    # Forward: operands quantized with the history's scales (not their own amax).
    y = fp8.einsum(case[0], x, w, recipe="delayed", meta=meta)
    sx, sw = prior["x"] / fmax, prior["w"] / fmax
    qx = jnp.clip(x / sx, -fmax, fmax).astype(E4M3).astype(F32) * sx
    qw = jnp.clip(w / sw, -fmax, fmax).astype(E4M3).astype(F32) * sw
    assert_close(y, qx @ qw, rtol=sum_rtol(x.shape[1] + 2))


def test_recipe_checks_its_names():
    with pytest.raises(ValueError, match="recipe"):
        fp8.Fp8Recipe(recipe="blockwise")
    with pytest.raises(ValueError, match="projections"):
        fp8.Fp8Recipe(skip=("mlp",))
    assert not fp8.Fp8Recipe(skip=("wo",)).applies("wo")
    assert fp8_ops.OVERWRITE_WITH_GRADIENT == fp8.META
