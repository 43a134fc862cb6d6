"""`batched_matmul`: `op(a) @ op(b)` over leading batch dimensions, fp32 accumulation.

On CPU, for fp32 operands, it runs jaxspeed's native kernel (`matmul.cc`: one single-threaded
OpenBLAS GEMM per batch element, spread over XLA's intra-op thread pool); where that does not
apply (`policy.py`: other dtypes, GPUs, meshes XLA still partitions) it is the same
`jnp.einsum` XLA would run.
Gradients are batched matmuls again (with the transposes swapped), so they take the same path
(reverse mode to any order). Forward mode (`jax.jvp`, `jax.jacfwd`) is not available on the
native path, as for any `custom_vjp`; `JAXSPEED_NATIVE=0` gives XLA's dot everywhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspeed.native import build
from jaxspeed.native.policy import ffi_call, use_native, vary_alike


def batched_matmul(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """`op(a) @ op(b)` for every leading index, accumulated and returned in fp32.

    Args:
      a: `[..., m, k]`, or `[..., k, m]` with `trans_a`.
      b: `[..., k, n]`, or `[..., n, k]` with `trans_b`; the same leading dims as `a`.
      trans_a, trans_b: use the transpose of the last two dims of `a` / `b`.

    Returns:
      fp32 `[..., m, n]`.
    """
    trans_a, trans_b = bool(trans_a), bool(trans_b)
    _check_shapes(a, b, trans_a, trans_b)
    if use_native(a, b):
        return _native(*vary_alike(a, b), trans_a, trans_b)
    return _xla(a, b, trans_a=trans_a, trans_b=trans_b)


def _check_shapes(a, b, trans_a: bool, trans_b: bool) -> None:
    if a.ndim < 2 or a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"batched_matmul needs a [..., m, k] and b [..., k, n] with the same "
                         f"leading dims, got {a.shape} and {b.shape}")
    k_a = a.shape[-2] if trans_a else a.shape[-1]
    k_b = b.shape[-1] if trans_b else b.shape[-2]
    if k_a != k_b:
        raise ValueError(f"batched_matmul: contracting sizes differ ({k_a} vs {k_b}) for "
                         f"shapes {a.shape} (trans_a={trans_a}), {b.shape} (trans_b={trans_b})")


def _xla(a, b, *, trans_a: bool, trans_b: bool):
    lhs = "...km" if trans_a else "...mk"
    rhs = "...nk" if trans_b else "...kn"
    return jnp.einsum(f"{lhs},{rhs}->...mn", a, b, preferred_element_type=jnp.float32)


def _ffi(a, b, *, trans_a: bool, trans_b: bool):
    m = a.shape[-1] if trans_a else a.shape[-2]
    n = b.shape[-2] if trans_b else b.shape[-1]
    out = jax.ShapeDtypeStruct((*a.shape[:-2], m, n), jnp.float32)
    # Under vmap the new dim is one more leading (batch) dim of both operands.
    return ffi_call(build.BATCHED, out, a, b, vmap_method="broadcast_all", trans_a=trans_a,
                    trans_b=trans_b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _native(a, b, trans_a: bool, trans_b: bool):
    flags = dict(trans_a=trans_a, trans_b=trans_b)
    return jax.lax.platform_dependent(a, b, cpu=functools.partial(_ffi, **flags),
                                      default=functools.partial(_xla, **flags))


def _native_fwd(a, b, trans_a, trans_b):
    return _native(a, b, trans_a, trans_b), (a, b)


def _native_bwd(trans_a, trans_b, residuals, g):
    """C = op(A) op(B): dA and dB are products of G with A or B, in the layouts they come in."""
    a, b = residuals
    if trans_a:  # A is [k, m]: dA = op(B) G^T
        da = batched_matmul(b, g, trans_a=trans_b, trans_b=True)
    else:  # dA = G op(B)^T
        da = batched_matmul(g, b, trans_b=not trans_b)
    if trans_b:  # B is [n, k]: dB = G^T op(A)
        db = batched_matmul(g, a, trans_a=True, trans_b=trans_a)
    else:  # dB = op(A)^T G
        db = batched_matmul(a, g, trans_a=not trans_a)
    return da, db


_native.defvjp(_native_fwd, _native_bwd)
