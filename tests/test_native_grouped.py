"""jaxspeed's native CPU grouped matmul (jaxspeed/native/grouped.py): equal to
`jax.lax.ragged_dot`, forward and gradients, for any group sizes (empty groups, rows past the
last group), inside `shard_map`, under `vmap`, and lowering for GPU without the CPU kernel.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxspeed.native import build, grouped_matmul

GROUPED, OUTER = build.GROUPED, build.GROUPED_OUTER


def normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape).astype(np.float32))


def reference(lhs, rhs, sizes, trans_b):
    rhs = jnp.swapaxes(rhs, 1, 2) if trans_b else rhs
    return jax.lax.ragged_dot(lhs, rhs, sizes, precision="highest",
                              preferred_element_type=jnp.float32)


def value_and_vjp(fn, lhs, rhs, g):
    out, vjp = jax.vjp(fn, lhs, rhs)
    return out, vjp(g)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("sizes", [
    (5, 0, 9, 3),        # an empty group, all rows used
    (0, 2, 0, 6),        # rows past the last group (come out zero)
    (17, 0, 0, 0),       # every row to one group
    (70,),               # one group, enough rows to be split over the threads
])
def test_equals_ragged_dot_forward_and_gradients(sizes, trans_b):
    rows, k, p = max(17, sum(sizes)), 6, 5
    rng = np.random.default_rng(sum(sizes) + trans_b)
    lhs, g = normal(rng, rows, k), normal(rng, rows, p)
    rhs = normal(rng, len(sizes), *((p, k) if trans_b else (k, p)))
    sizes = jnp.asarray(sizes, jnp.int32)
    fn = lambda x, w: grouped_matmul(x, w, sizes, trans_b=trans_b)  # noqa: E731
    text = jax.jit(functools.partial(value_and_vjp, fn)).lower(lhs, rhs, g).as_text()
    assert GROUPED in text and OUTER in text

    got = jax.jit(functools.partial(value_and_vjp, fn))(lhs, rhs, g)
    want = value_and_vjp(lambda x, w: reference(x, w, sizes, trans_b), lhs, rhs, g)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[0])[int(sizes.sum()):])  # rows past the groups: zero


def dense_reference(lhs, rhs, sizes):
    """`ragged_dot` written with a per-row gather (differentiable to any order, unlike
    `jax.lax.ragged_dot`'s own second derivative)."""
    row = jnp.arange(lhs.shape[0])
    group = jnp.searchsorted(jnp.cumsum(sizes), row, side="right")
    inside = row < jnp.sum(sizes)
    per_row = rhs[jnp.minimum(group, rhs.shape[0] - 1)]
    return jnp.where(inside[:, None], jnp.einsum("nk,nkp->np", lhs, per_row), 0.0)


def test_gradient_of_a_gradient():
    """Reverse over reverse runs the outer-product kernel's own gradient (XLA's `ragged_dot`
    has no second derivative in its right operand)."""
    rng = np.random.default_rng(0)
    sizes = jnp.asarray([3, 0, 5], jnp.int32)
    lhs, rhs, v = normal(rng, 9, 4), normal(rng, 3, 4, 6), normal(rng, 3, 4, 6)

    def hvp(fn):
        grad = jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1))
        return jax.grad(lambda x, w: jnp.vdot(grad(x, w)[1], v), argnums=(0, 1))(lhs, rhs)

    got = jax.jit(lambda: hvp(lambda x, w: grouped_matmul(x, w, sizes)))()
    want = hvp(lambda x, w: dense_reference(x, w, sizes))
    chex.assert_trees_all_close(got, want, rtol=1e-4, atol=1e-5)
    lhs_long = normal(rng, 11, 4)  # rows past the last group
    chex.assert_trees_all_close(dense_reference(lhs_long, rhs, sizes),
                                reference(lhs_long, rhs, sizes, False), rtol=1e-5, atol=1e-6)


def test_inside_shard_map_with_replicated_weights():
    """Each device groups its own rows; the weights' gradient is summed over devices."""
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(1)
    lhs, rhs, g = normal(rng, 8 * 10, 4), normal(rng, 3, 4, 5), normal(rng, 8 * 10, 5)
    sizes = jnp.asarray(rng.multinomial(9, [0.3, 0.3, 0.4], size=8).astype(np.int32))

    def local(x, w, s):
        return grouped_matmul(x, w, s[0])

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("expert"), P(), P("expert")),
                       out_specs=P("expert"))
    got = jax.jit(lambda x, w, g: value_and_vjp(lambda x, w: fn(x, w, sizes), x, w, g))(
        lhs, rhs, g)

    def per_device(x, w):
        return jnp.concatenate([reference(x[10 * d:10 * d + 10], w, sizes[d], False)
                                for d in range(8)])

    chex.assert_trees_all_close(got, value_and_vjp(per_device, lhs, rhs, g), rtol=1e-5,
                                atol=1e-5)


def test_vmap_runs_each_problem():
    rng = np.random.default_rng(2)
    lhs, rhs = normal(rng, 3, 8, 4), normal(rng, 3, 2, 4, 5)
    sizes = jnp.asarray([[3, 5], [0, 8], [6, 1]], jnp.int32)
    got = jax.jit(jax.vmap(grouped_matmul))(lhs, rhs, sizes)
    want = jnp.stack([reference(lhs[i], rhs[i], sizes[i], False) for i in range(3)])
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_lowers_for_gpu_as_ragged_dot():
    lhs = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    rhs = jax.ShapeDtypeStruct((4, 8, 32), jnp.float32)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    g = jax.ShapeDtypeStruct((16, 32), jnp.float32)

    def step(x, w, s, g):
        return value_and_vjp(lambda x, w: grouped_matmul(x, w, s), x, w, g)

    text = jax.jit(step).trace(lhs, rhs, sizes, g).lower(lowering_platforms=("cuda",)).as_text()
    assert GROUPED not in text and OUTER not in text and "ragged_dot" in text


def test_bad_input():
    x, w = jnp.ones((6, 4)), jnp.ones((2, 4, 3))
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, w, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="contracting sizes differ"):
        grouped_matmul(x, w, jnp.ones((2,), jnp.int32), trans_b=True)
    # Group sizes are run-time values: too many rows is the kernel's error, not a wrong answer.
    with pytest.raises(Exception, match="add up to more rows than lhs has"):
        jax.block_until_ready(jax.jit(grouped_matmul)(x, w, jnp.asarray([4, 3], jnp.int32)))
    with pytest.raises(Exception, match="negative group size"):
        jax.block_until_ready(jax.jit(grouped_matmul)(x, w, jnp.asarray([-1, 3], jnp.int32)))
