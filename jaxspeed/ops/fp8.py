"""FP8 matmuls: e4m3 operands forward, e5m2 gradients, with three scaling recipes.

Every recipe multiplies FP8 operands in a `dot_general` whose inputs are `float8_e4m3fn` (the
forward, and the saved operand in the backward pass) or `float8_e5m2` (the incoming gradient),
accumulating in fp32, and rescales the product. XLA:GPU turns such dots into FP8 tensor-core
GEMMs on Hopper (cuBLASLt's FP8 matmul or its own GEMM fusions with f8 operands); XLA:CPU
widens them, which computes the same products exactly.

- `tensorwise` (current scaling): one fp32 scale per operand, `amax(|x|) / fp8_max` of the
  tensor as it is now (per matrix of a batched matmul: each expert's weight and buffer has its
  own). The backward pass reuses the forward's FP8 operands.
- `rowwise` (current scaling, torchtitan's "rowwise"): each operand of each of the three GEMMs
  (forward, input gradient, weight gradient) is scaled along its contracting dimensions, one
  scale per row of the non-contracting ones, so the scales factor out of the sums exactly:
  `sum_k (qa[i,k] sa[i]) (qb[k,j] sb[j]) = sa[i] sb[j] sum_k qa[i,k] qb[k,j]`. The backward
  pass requantizes the saved high-precision operands along their other axes.
- `delayed` (Transformer Engine's default): per-tensor scales from a history of amaxes of the
  earlier steps. This is Flax's `fp8_ops.fp8_scaled_dot_general` as it is; its histories and
  scales are Flax variables in the `_overwrite_with_gradient` collection, whose "gradient" is
  their next value (`fp8_meta`).

Flax ships only the delayed recipe; the current-scaling recipes are written here, on Flax's
own `quantize`, `compute_scale` and `dot_general_transpose_*` helpers. Qwix would cover
current scaling too, but it quantizes by intercepting a model's `dot_general`s, while ours
choose per projection (`Fp8Config.skip`) and run inside `shard_map` (the MoE experts).

The scale products come from the same `dot_general` applied to the scales: their contracting
dimensions have size 1, so it multiplies the row scales into the output's layout.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from jaxspeed.options.fp8 import HISTORY, PROJECTIONS, RECIPES  # noqa: F401 (re-exported)

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
#: Flax's collection of variables whose gradient is their new value.
META = fp8_ops.OVERWRITE_WITH_GRADIENT

Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """What FP8 does in a model (hashable: a Flax module attribute).

    Attributes:
      recipe: one of `RECIPES`.
      amax_history_length: `delayed`'s history of amaxes per tensor.
      skip: names in `PROJECTIONS` that stay in the compute dtype.
    """

    recipe: str = "tensorwise"
    amax_history_length: int = HISTORY
    skip: tuple[str, ...] = ()

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"fp8 recipe must be one of {RECIPES}, got {self.recipe!r}")
        unknown = sorted(set(self.skip) - set(PROJECTIONS))
        if unknown:
            raise ValueError(f"fp8 skip names {unknown} are not projections; known: {PROJECTIONS}")

    def applies(self, name: str) -> bool:
        """Whether the projection `name` runs in FP8."""
        return name not in self.skip


def _scale(x: jax.Array, dtype, axes: tuple[int, ...]) -> jax.Array:
    """fp32 scales `s` (`x`'s rank, size 1 on `axes`) with `x / s` filling `dtype`'s range;
    an all-zero slice keeps scale 1 (Flax's `compute_scale`)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True)
    fp8_max = fp8_ops.get_fp8_max(dtype, jnp.float32)
    return fp8_ops.compute_scale(amax, jnp.ones_like(amax), fp8_max)


def quantize(x: jax.Array, dtype, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """`(q, s)`: `x` in FP8 `dtype` and its fp32 scales reduced over `axes`; `x ≈ q * s`."""
    scale = _scale(x, dtype, axes)
    return fp8_ops.quantize(x.astype(jnp.float32), dtype, scale, jnp.float32), scale


def _kept(ndim: int, contract, batch) -> tuple[int, ...]:
    return tuple(i for i in range(ndim) if i not in contract and i not in batch)


def _axes(ndim: int, along, batch, rowwise: bool) -> tuple[int, ...]:
    """The axes a scale reduces over: `along` (rowwise) or all but the `batch` ones
    (tensorwise: each matrix of a batched matmul, such as each expert's, is its own tensor)."""
    return tuple(along) if rowwise else tuple(i for i in range(ndim) if i not in batch)


def _scaled_dot(qa, sa, qb, sb, dims: Dims) -> jax.Array:
    """fp32 `dot_general(qa * sa, qb * sb)`, the FP8 product computed first, then rescaled."""
    out = jax.lax.dot_general(qa, qb, dims, preferred_element_type=jnp.float32)
    return out * jax.lax.dot_general(sa, sb, dims)


def _transposed(fn, values, scales, dims: Dims) -> jax.Array:
    """fp32 `fn(*values)` rescaled by `fn(*scales)`, for Flax's `dot_general_transpose_lhs` /
    `_rhs` (`(g, x, y)`; the operand being differentiated is read for its rank only)."""
    kw = dict(dimension_numbers=dims, precision=None, preferred_element_type=jnp.float32)
    return fn(*values, **kw) * fn(*scales, **kw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def current_scaled_dot(lhs, rhs, dims: Dims, rowwise: bool, out_dtype) -> jax.Array:
    """`lax.dot_general(lhs, rhs, dims)` with FP8 operands scaled from their current amaxes.

    Args:
      lhs, rhs: the operands (any float dtype); their gradients come back in their dtypes.
      dims: `dot_general` dimension numbers.
      rowwise: scales per row of the non-contracting dimensions (else per tensor).
      out_dtype: the result's dtype.
    """
    return _current_fwd(lhs, rhs, dims, rowwise, out_dtype)[0]


def _current_fwd(lhs, rhs, dims, rowwise, out_dtype):
    (lc, rc), (lb, rb) = dims
    ql, sl = quantize(lhs, E4M3, _axes(lhs.ndim, lc, lb, rowwise))
    qr, sr = quantize(rhs, E4M3, _axes(rhs.ndim, rc, rb, rowwise))
    out = _scaled_dot(ql, sl, qr, sr, dims).astype(out_dtype)
    # Tensorwise scales hold for every GEMM: keep the FP8 operands (half bf16's bytes); an
    # empty array of each operand's dtype says which dtype its gradient takes.
    if rowwise:
        return out, (lhs, rhs)
    kinds = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    return out, (ql, sl, qr, sr, kinds)


def _current_bwd(dims, rowwise, out_dtype, res, g):
    (lc, rc), (lb, rb) = dims
    if rowwise:
        lhs, rhs = res
        kinds = (lhs, rhs)
        nb, nl = len(lb), len(_kept(lhs.ndim, lc, lb))
        lhs_out = tuple(range(nb, nb + nl))  # the output's dims that come from lhs
        rhs_out = tuple(range(nb + nl, g.ndim))
        # d lhs contracts g's rhs dims with rhs's kept dims; d rhs, g's lhs dims with lhs's.
        qg, sg = quantize(g, E5M2, rhs_out)
        qr, sr = quantize(rhs, E4M3, _kept(rhs.ndim, rc, rb))
        d_lhs = _transposed(fp8_ops.dot_general_transpose_lhs, (qg, lhs, qr), (sg, lhs, sr), dims)
        qg, sg = quantize(g, E5M2, lhs_out)
        ql, sl = quantize(lhs, E4M3, _kept(lhs.ndim, lc, lb))
        d_rhs = _transposed(fp8_ops.dot_general_transpose_rhs, (qg, ql, rhs), (sg, sl, rhs), dims)
    else:
        ql, sl, qr, sr, kinds = res
        qg, sg = quantize(g, E5M2, tuple(range(len(lb), g.ndim)))
        d_lhs = _transposed(fp8_ops.dot_general_transpose_lhs, (qg, ql, qr), (sg, ql, sr), dims)
        d_rhs = _transposed(fp8_ops.dot_general_transpose_rhs, (qg, ql, qr), (sg, sl, qr), dims)
    return d_lhs.astype(kinds[0].dtype), d_rhs.astype(kinds[1].dtype)


current_scaled_dot.defvjp(_current_fwd, _current_bwd)


def _dot_general(recipe: str, meta: dict[str, jax.Array] | None):
    """A `dot_general` for `jnp.einsum(..., _dot_general=...)` under `recipe`."""

    def dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
        out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
        (lc, rc), (lb, rb) = dimension_numbers  # hashable: a nondiff argument
        dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
        if recipe == "delayed":  # Flax computes in one dtype, the weight's (as its Fp8Einsum)
            compute = rhs.dtype
            out = fp8_ops.fp8_scaled_dot_general(
                lhs.astype(compute), rhs, dims, preferred_element_type=compute,
                quantize_compute_type=compute, **meta)
            return out.astype(out_dtype)
        return current_scaled_dot(lhs, rhs, dims, recipe == "rowwise", jnp.dtype(out_dtype))

    return dot


def einsum(spec: str, x: jax.Array, w: jax.Array, *, recipe: str,
           meta: dict[str, jax.Array] | None = None, preferred_element_type=None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` as an FP8 matmul under `recipe` (`RECIPES`).

    Args:
      spec: a two-operand einsum whose contraction is one `dot_general`.
      x, w: the activation and the weight.
      recipe: `tensorwise`, `rowwise` or `delayed`.
      meta: `delayed` only: the `fp8_meta` variables' values.
      preferred_element_type: the result's dtype (default: the operands').
    """
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe must be one of {RECIPES}, got {recipe!r}")
    if (recipe == "delayed") != (meta is not None):
        raise ValueError("fp8: meta is given exactly with the delayed recipe")
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type,
                      _dot_general=_dot_general(recipe, meta))


#: Flax's names of the delayed recipe's operands, and `fp8_scaled_dot_general`'s.
_META_OPERANDS = (("input", "lhs"), ("kernel", "rhs"), ("output_grad", "grad"))


def fp8_meta(module: nn.Module, name: str, history: int) -> dict[str, jax.Array]:
    """The delayed recipe's scales and amax histories of projection `name`, as Flax's
    `Fp8DotGeneralBase` declares them (collection `META`), keyed as
    `fp8_scaled_dot_general` takes them."""
    meta = {}
    for operand, side in _META_OPERANDS:
        scale = module.variable(META, f"{name}_{operand}_scale", jnp.ones, (1,), jnp.float32)
        amax = module.variable(META, f"{name}_{operand}_amax_history", jnp.zeros, (history,),
                               jnp.float32)
        meta[f"{side}_scale"] = scale.value
        meta[f"{side}_amax_history"] = amax.value
    return meta


def project(module: nn.Module, name: str, spec: str, x: jax.Array, w: jax.Array,
            fp8: Fp8Recipe | None, fallback) -> jax.Array:
    """`spec`'s product of activation `x` and weight `w` for projection `name` of `module`:
    in FP8 where `fp8` applies to `name`, else `fallback(spec, x, w)`."""
    if fp8 is None or not fp8.applies(name):
        return fallback(spec, x, w)
    meta = None
    if fp8.recipe == "delayed":
        meta = fp8_meta(module, name, fp8.amax_history_length)
    return einsum(spec, x, w, recipe=fp8.recipe, meta=meta)
