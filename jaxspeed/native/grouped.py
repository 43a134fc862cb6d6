"""`grouped_matmul`: `jax.lax.ragged_dot` (rows sorted by group), fp32, native on CPU.

XLA:CPU lowers `ragged_dot` to a loop that runs at about 0.4 GFLOP/s, some 75x slower than a
batched matmul, which makes the dropless MoE path (`jaxspeed.moe.dropless_ffn`) unusable on
CPU. The native kernels (`matmul.cc`) run one OpenBLAS GEMM per group (rows of one expert),
spread over XLA's thread pool, and the weight gradient as one `lhs_g^T @ g_g` per group. Where
they do not apply (see `policy.py`) this is `jax.lax.ragged_dot` itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspeed.native import build
from jaxspeed.native.policy import ffi_call, use_native, vary_alike


def grouped_matmul(lhs, rhs, group_sizes, *, trans_b: bool = False):
    """`out[rows of group g] = lhs[rows of group g] @ op(rhs[g])`, in fp32.

    Args:
      lhs: `[N, K]`, rows sorted by group: group 0's first, then group 1's, ...
      rhs: `[G, K, P]`, or `[G, P, K]` with `trans_b`.
      group_sizes: int32 `[G]`, rows per group, summing to at most `N` (the rows after the
        last group come out zero).
      trans_b: use the transpose of each `rhs[g]`.

    Returns:
      fp32 `[N, P]`.
    """
    trans_b = bool(trans_b)
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul needs lhs [N, K], rhs [G, ., .] and group_sizes [G], "
                         f"got {lhs.shape}, {rhs.shape} and {group_sizes.shape}")
    if (rhs.shape[2] if trans_b else rhs.shape[1]) != lhs.shape[1]:
        raise ValueError(f"grouped_matmul: contracting sizes differ for lhs {lhs.shape} and "
                         f"rhs {rhs.shape} (trans_b={trans_b})")
    group_sizes = group_sizes.astype(jnp.int32)
    if use_native(lhs, rhs, group_sizes):
        return _native_matmul(*vary_alike(lhs, rhs, group_sizes), trans_b)
    return _xla_matmul(lhs, rhs, group_sizes, trans_b=trans_b)


def _xla_matmul(lhs, rhs, group_sizes, *, trans_b: bool):
    rhs = jnp.swapaxes(rhs, 1, 2) if trans_b else rhs
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


def _xla_outer(lhs, rhs, group_sizes):
    """`out[g] = lhs_g^T @ rhs_g`: the transpose of `ragged_dot` in its right operand."""
    zeros = jnp.zeros((group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), jnp.float32)
    zeros, _ = vary_alike(zeros, lhs)  # per device inside shard_map, not summed over devices
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(
        lhs.astype(jnp.float32), w, group_sizes, preferred_element_type=jnp.float32), zeros)
    return vjp(rhs.astype(jnp.float32))[0]


def _ffi_matmul(lhs, rhs, group_sizes, *, trans_b: bool):
    out = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[1] if trans_b else rhs.shape[2]),
                               jnp.float32)
    return ffi_call(build.GROUPED, out, lhs, rhs, group_sizes, trans_b=trans_b)


def _ffi_outer(lhs, rhs, group_sizes):
    out = jax.ShapeDtypeStruct((group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), jnp.float32)
    return ffi_call(build.GROUPED_OUTER, out, lhs, rhs, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _native_matmul(lhs, rhs, group_sizes, trans_b: bool):
    flags = dict(trans_b=trans_b)
    return jax.lax.platform_dependent(lhs, rhs, group_sizes,
                                      cpu=functools.partial(_ffi_matmul, **flags),
                                      default=functools.partial(_xla_matmul, **flags))


def _native_matmul_fwd(lhs, rhs, group_sizes, trans_b):
    return _native_matmul(lhs, rhs, group_sizes, trans_b), (lhs, rhs, group_sizes)


def _native_matmul_bwd(trans_b, residuals, g):
    lhs, rhs, group_sizes = residuals
    d_lhs = _native_matmul(g, rhs, group_sizes, not trans_b)
    # d rhs[g] = lhs_g^T G_g, or its transpose G_g^T lhs_g when rhs holds op(rhs)^T.
    d_rhs = (_native_outer(g, lhs, group_sizes) if trans_b
             else _native_outer(lhs, g, group_sizes))
    return d_lhs, d_rhs, None


_native_matmul.defvjp(_native_matmul_fwd, _native_matmul_bwd)


@jax.custom_vjp
def _native_outer(lhs, rhs, group_sizes):
    """`[G, K, P]`: `lhs_g^T @ rhs_g` for `lhs [N, K]`, `rhs [N, P]` (zero for empty groups)."""
    return jax.lax.platform_dependent(lhs, rhs, group_sizes, cpu=_ffi_outer, default=_xla_outer)


def _native_outer_fwd(lhs, rhs, group_sizes):
    return _native_outer(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _native_outer_bwd(residuals, g):
    lhs, rhs, group_sizes = residuals  # out_g = lhs_g^T rhs_g
    return (_native_matmul(rhs, g, group_sizes, True),   # d lhs_g = rhs_g out_g^T
            _native_matmul(lhs, g, group_sizes, False),  # d rhs_g = lhs_g out_g
            None)


_native_outer.defvjp(_native_outer_fwd, _native_outer_bwd)
