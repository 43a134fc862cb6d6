"""When jaxspeed's native CPU kernels apply, and how their custom calls are typed.

A native kernel is taken at trace time when:
  - every float operand is fp32;
  - CPU is JAX's default backend, and the native library is available (see `build.py`);
  - no mesh axis is left for XLA to partition: every axis of the current mesh, and of the
    operands' shardings, is manual (as inside `shard_map`) or of size 1. XLA's partitioner
    cannot split a custom call: it would gather the operands and compute on every device.
The call itself sits in `jax.lax.platform_dependent`, so the same program still lowers for a
GPU with XLA's own ops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from jaxspeed.native import build


def use_native(*operands) -> bool:
    """Whether a native kernel may run on these operands (see the module docstring)."""
    floats = [x for x in operands if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    meshes = (jax.sharding.get_abstract_mesh(), *map(_mesh_of, operands))
    return (all(jnp.result_type(x) == jnp.float32 for x in floats)
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


def vary_alike(*xs):
    """Marks every operand varying over the union of their manual axes (inside `shard_map`).

    The custom call's result and gradients vary over all of them, and `custom_vjp` wants each
    cotangent typed like its primal; the `pcast` (whose transpose is a `psum`) makes them so.
    """
    axes = frozenset().union(*map(_varying, xs))
    return [x if _varying(x) == axes else
            jax.lax.pcast(x, tuple(sorted(axes - _varying(x))), to="varying") for x in xs]


def ffi_call(target: str, out: jax.ShapeDtypeStruct, *operands,
             vmap_method: str = "sequential", **attrs):
    """Calls the native kernel `target` (see `jax.ffi.ffi_call` for `vmap_method`).

    The result varies over the operands' manual axes (`vary_alike` made them equal); the
    custom call's own type would drop them.
    """
    call = jax.ffi.ffi_call(target, out, vmap_method=vmap_method)
    result = call(*operands, **attrs)
    axes = _varying(operands[0])
    return jax.lax.pcast(result, tuple(sorted(axes)), to="varying") if axes else result
