"""`batched_matmul`: `op(a) @ op(b)` over leading batch dimensions, fp32 accumulation.

On CPU, for fp32 operands, it runs jaxspeed's native kernel (`batched_matmul.cc`: one
single-threaded OpenBLAS GEMM per batch element, spread over XLA's intra-op thread pool).
Everywhere else it is the same `jnp.einsum` XLA would run. The choice is made per call:
  - at trace time: fp32 operands, CPU as JAX's default backend, the native library available
    (see `build.py`), and no mesh axis that XLA would still have to partition (every axis of
    the current mesh, and of the operands' shardings, is manual, as inside `shard_map`, or of
    size 1). XLA's partitioner cannot split a custom call: it would gather the operands and
    compute on every device.
  - at lowering time: the CPU platform (`jax.lax.platform_dependent`), so the same program
    lowers for a GPU with XLA's dot.
Gradients are batched matmuls again (with the transposes swapped), so they take the same path
(reverse mode to any order). Forward mode (`jax.jvp`, `jax.jacfwd`) is not available on the
native path, as for any `custom_vjp`; `JAXSPEED_NATIVE=0` gives XLA's dot everywhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from jaxspeed.native import build


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
        return _native(*_vary_alike(a, b), trans_a, trans_b)
    return _xla(a, b, trans_a=trans_a, trans_b=trans_b)


def use_native(a, b) -> bool:
    """Whether `batched_matmul(a, b)` takes the native kernel (when lowered for CPU)."""
    f32 = jnp.dtype(jnp.float32)
    meshes = (jax.sharding.get_abstract_mesh(), _mesh_of(a), _mesh_of(b))
    return (jnp.result_type(a) == f32 and jnp.result_type(b) == f32
            and jax.default_backend() == "cpu" and all(map(_all_manual, meshes))
            and build.available())


def _mesh_of(x):
    """The mesh in `x`'s type (under `jit`, inputs sharded over a mesh carry it)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    return getattr(sharding, "mesh", None)


def _all_manual(mesh) -> bool:
    """No axis of `mesh` left for XLA's partitioner: each is manual or of size 1."""
    return mesh is None or mesh.empty or all(
        kind == AxisType.Manual or size == 1
        for kind, size in zip(mesh.axis_types, mesh.axis_sizes))


def _varying(x) -> frozenset:
    """The manual mesh axes `x` varies over (empty outside `shard_map`)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10: the manual-axis type; earlier: `vma`
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _vary_alike(*xs):
    """Marks every operand varying over the union of their manual axes (inside `shard_map`).

    The custom call's result and gradients vary over all of them, and `custom_vjp` wants each
    cotangent typed like its primal; the `pcast` (whose transpose is a `psum`) makes them so.
    """
    axes = frozenset().union(*map(_varying, xs))
    return [x if _varying(x) == axes else
            jax.lax.pcast(x, tuple(sorted(axes - _varying(x))), to="varying") for x in xs]


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
    call = jax.ffi.ffi_call(build.TARGET, out, vmap_method="broadcast_all")
    result = call(a, b, trans_a=trans_a, trans_b=trans_b)
    axes = _varying(a)  # == _varying(b) (see `_vary_alike`); the call's type drops it
    return jax.lax.pcast(result, tuple(sorted(axes)), to="varying") if axes else result


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
