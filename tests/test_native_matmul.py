"""jaxspeed's native CPU batched matmul (jaxspeed/native): equal to `jnp.einsum`, forward and
gradients, and taken only where it may be (fp32, CPU, no mesh axis left for XLA to split).

The kernel sums in another order than XLA's dot, so results agree at fp32 tolerance (observed
relative differences about 1e-7), not bit for bit.
"""

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxspeed.native import batched_matmul, build, use_native

TARGET = build.BATCHED


def normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape).astype(np.float32))


def operands(rng, batch, m, k, n, trans_a, trans_b):
    a = normal(rng, *batch, *((k, m) if trans_a else (m, k)))
    b = normal(rng, *batch, *((n, k) if trans_b else (k, n)))
    return a, b, normal(rng, *batch, m, n)


def reference(a, b, trans_a, trans_b):
    lhs = "...km" if trans_a else "...mk"
    rhs = "...nk" if trans_b else "...kn"
    return jnp.einsum(f"{lhs},{rhs}->...mn", a, b, precision="highest")


def value_and_vjp(fn, a, b, g):
    out, vjp = jax.vjp(fn, a, b)
    return out, vjp(g)


def lowered_text(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


def test_the_native_kernel_builds_here():
    """The CI machine has a compiler and the OpenBLAS wheel: the kernel must be in use."""
    assert build.available(), "the native kernel did not build (see the warning)"


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("batch,m,k,n", [
    ((6,), 40, 24, 16),   # one task per batch element
    ((1,), 200, 8, 24),   # one element: its rows are split over the threads
    ((), 96, 5, 7),       # no batch dims (a plain matmul), rows split
    ((2, 3), 17, 9, 4),   # two batch dims, odd sizes
])
def test_equals_einsum_forward_and_gradients(batch, m, k, n, trans_a, trans_b):
    rng = np.random.default_rng(m + 2 * trans_a + trans_b)
    a, b, g = operands(rng, batch, m, k, n, trans_a, trans_b)
    fn = functools.partial(batched_matmul, trans_a=trans_a, trans_b=trans_b)
    assert TARGET in lowered_text(fn, a, b)

    got = jax.jit(functools.partial(value_and_vjp, fn))(a, b, g)
    want = value_and_vjp(lambda a, b: reference(a, b, trans_a, trans_b), a, b, g)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_gradient_of_a_gradient():
    """Reverse over reverse (a Hessian-vector product); forward mode is not supported, as for
    any `custom_vjp` (JAX raises its own error)."""
    rng = np.random.default_rng(0)
    a, b, v = operands(rng, (3,), 8, 6, 5, False, True)
    v = normal(rng, *a.shape)

    def hvp(fn, a, b):
        grad = jax.grad(lambda a: jnp.sum(jnp.sin(fn(a, b))))
        return jax.grad(lambda a: jnp.vdot(grad(a), v))(a)

    got = jax.jit(functools.partial(hvp, functools.partial(batched_matmul, trans_b=True)))(a, b)
    want = hvp(lambda a, b: reference(a, b, False, True), a, b)
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)


def test_vmap_adds_a_batch_dimension():
    rng = np.random.default_rng(1)
    a, b, _ = operands(rng, (4, 3), 10, 7, 6, True, False)
    got = jax.jit(jax.vmap(functools.partial(batched_matmul, trans_a=True)))(a, b)
    chex.assert_trees_all_close(got, reference(a, b, True, False), rtol=1e-5, atol=1e-5)
    shared_b = jax.jit(jax.vmap(functools.partial(batched_matmul, trans_a=True),
                                in_axes=(0, None)))(a, b[0])
    chex.assert_trees_all_close(shared_b, reference(a, jnp.broadcast_to(b[0], b.shape), True,
                                                    False), rtol=1e-5, atol=1e-5)


def test_empty_and_zero_contraction():
    zero_k = batched_matmul(jnp.ones((2, 3, 0)), jnp.ones((2, 0, 4)))
    chex.assert_trees_all_equal(zero_k, jnp.zeros((2, 3, 4)))
    assert batched_matmul(jnp.ones((0, 3, 2)), jnp.ones((0, 2, 4))).shape == (0, 3, 4)


def test_inside_shard_map_sums_gradients_of_replicated_operands():
    """`a` is split over 8 devices, `b` replicated: b's gradient is the sum over devices."""
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(2)
    a, b, g = operands(rng, (16,), 12, 8, 6, False, False)
    b = b[0]

    def local(a, b):
        assert use_native(a, b)
        return batched_matmul(a, jnp.broadcast_to(b, (a.shape[0], *b.shape)))

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("expert"), P()), out_specs=P("expert"))
    got = jax.jit(functools.partial(value_and_vjp, fn))(a, b, g)
    want = value_and_vjp(lambda a, b: reference(a, jnp.broadcast_to(b, (16, 8, 6)), False,
                                                False), a, b, g)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    assert TARGET in lowered_text(functools.partial(value_and_vjp, fn), a, b, g)


def test_xla_dot_where_the_kernel_does_not_apply(monkeypatch):
    rng = np.random.default_rng(3)
    a, b, _ = operands(rng, (8,), 4, 3, 5, False, False)
    # bf16 operands: XLA's dot, fp32 result as before.
    bf16 = lowered_text(batched_matmul, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    assert TARGET not in bf16
    assert batched_matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)).dtype == jnp.float32
    # A mesh axis XLA still partitions (Auto or Explicit, size > 1): a custom call cannot be
    # split, so XLA's dot.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        assert not use_native(a, b)
        assert TARGET not in lowered_text(batched_matmul, a, b)
    # ... also when the mesh comes only with sharded operands, under a plain `jit`.
    sharded = jax.device_put(a, jax.sharding.NamedSharding(mesh, P("data")))
    assert TARGET not in lowered_text(batched_matmul, sharded, b)
    # Turned off by the environment.
    monkeypatch.setenv("JAXSPEED_NATIVE", "0")
    assert not use_native(a, b)
    assert TARGET not in lowered_text(batched_matmul, a, b)
    chex.assert_trees_all_close(batched_matmul(a, b), reference(a, b, False, False), rtol=1e-6)


def test_lowers_for_gpu_without_the_cpu_kernel():
    a = jax.ShapeDtypeStruct((4, 16, 8), jnp.float32)
    b = jax.ShapeDtypeStruct((4, 8, 32), jnp.float32)
    g = jax.ShapeDtypeStruct((4, 16, 32), jnp.float32)
    text = jax.jit(functools.partial(value_and_vjp, batched_matmul)).trace(a, b, g).lower(
        lowering_platforms=("cuda",)).as_text()
    assert TARGET not in text and "dot_general" in text


def test_flop_count_sees_the_matmuls():
    """`jaxpr_flops` (the engine's MFU) counts the XLA branch of the platform switch."""
    from jaxspeed.profiler import jaxpr_flops

    a, b, g = jnp.ones((4, 16, 8)), jnp.ones((4, 8, 32)), jnp.ones((4, 16, 32))
    step = lambda fn: lambda a, b: jax.vjp(fn, a, b)[1](g)  # noqa: E731
    native = jaxpr_flops(step(batched_matmul), a, b)
    assert native == jaxpr_flops(step(lambda a, b: reference(a, b, False, False)), a, b)
    assert native == 3 * 2 * (4 * 16 * 8 * 32)  # the forward and two gradient matmuls


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="same leading dims"):
        batched_matmul(jnp.ones((2, 3, 4)), jnp.ones((3, 4, 5)))
    with pytest.raises(ValueError, match=r"contracting sizes differ \(4 vs 3\)"):
        batched_matmul(jnp.ones((2, 3, 4)), jnp.ones((2, 3, 5)))
    with pytest.raises(ValueError, match="same leading dims"):
        batched_matmul(jnp.ones((4,)), jnp.ones((4,)))


def test_a_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(build.NativeUnavailable, match="compiling matmul.cc failed"):
        build.build(tmp_path / "lib.so")
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind

    monkeypatch.setattr(build, "load", lambda: (_ for _ in ()).throw(
        build.NativeUnavailable("no compiler here")))
    build._loads.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not build.available()
        assert any("no compiler here" in str(w.message) for w in caught)
        a = jnp.ones((2, 3, 4))
        assert TARGET not in lowered_text(batched_matmul, a, a.swapaxes(1, 2))
    finally:
        build._loads.cache_clear()


def test_an_unwritable_cache_is_a_clear_reason(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(build.NativeUnavailable, match="point JAXSPEED_CACHE_DIR"):
        build.build(not_a_folder / "native" / "lib.so")


def test_cache_key_follows_the_source_and_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSPEED_CACHE_DIR", str(tmp_path))
    first = build.library_path()
    assert first.parent == tmp_path / "native"
    monkeypatch.setenv("CXX", "clang++")
    assert build.library_path() != first
