"""The grouped matmul of the dropless FFN (jaxspeed/moe/grouped.py): equal to
`jax.lax.ragged_dot`, forward and gradients, for any group sizes (empty groups, rows past the
last group, a group larger than every block size), to second order, inside `shard_map` and
under `vmap`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxspeed.moe.grouped import block_capacities, grouped_matmul
from numerics import assert_close, program_rtol, sum_rtol


def normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape).astype(np.float32))


def reference(lhs, rhs, sizes, trans_b):
    rhs = jnp.swapaxes(rhs, 1, 2) if trans_b else rhs
    return jax.lax.ragged_dot(lhs, rhs, sizes, precision="highest",
                              preferred_element_type=jnp.float32)


def value_and_vjp(fn, lhs, rhs, g):
    out, vjp = jax.vjp(fn, lhs, rhs)
    return out, vjp(g)


def test_block_capacities():
    # 1, 1.25, 1.5 and 2 times the mean group size, rounded up to a multiple of 8.
    assert block_capacities(8192, 64) == (128, 160, 192, 256)
    assert block_capacities(20, 4) == (8, 16)
    assert block_capacities(6, 1) == (6,)  # never more than the rows


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("sizes", [
    (5, 0, 9, 3),        # an empty group; the largest fits a block
    (0, 2, 0, 6),        # rows past the last group (come out zero)
    (4, 4, 4, 4),        # balanced: the smallest block size
    (17, 0, 0, 0),       # one group larger than every block size: split over blocks
    (20, 1, 9, 0),       # the same with several groups, one of them split
    (70,),               # one group
])
def test_equals_ragged_dot_forward_and_gradients(sizes, trans_b):
    rows, k, p = max(17, sum(sizes)), 6, 5
    rng = np.random.default_rng(sum(sizes) + trans_b)
    lhs, g = normal(rng, rows, k), normal(rng, rows, p)
    rhs = normal(rng, len(sizes), *((p, k) if trans_b else (k, p)))
    sizes = jnp.asarray(sizes, jnp.int32)
    fn = lambda x, w: grouped_matmul(x, w, sizes, trans_b=trans_b)  # noqa: E731

    got = jax.jit(functools.partial(value_and_vjp, fn))(lhs, rhs, g)
    want = value_and_vjp(lambda x, w: reference(x, w, sizes, trans_b), lhs, rhs, g)
    # One matmul each (tests/numerics.py): over k for the output, p for d lhs, and a group's
    # rows (at most all of them) for d rhs; a split group's blocks are one sum in another order.
    assert_close(got, want, rtol=sum_rtol(max(rows, k, p)))
    assert not np.any(np.asarray(got[0])[int(sizes.sum()):])  # rows past the groups: zero


def test_bf16_operands_accumulate_in_fp32():
    rng = np.random.default_rng(3)
    lhs, rhs = normal(rng, 12, 8).astype(jnp.bfloat16), normal(rng, 3, 8, 4).astype(jnp.bfloat16)
    sizes = jnp.asarray([5, 0, 7], jnp.int32)
    out, (d_lhs, d_rhs) = jax.jit(functools.partial(
        value_and_vjp, lambda x, w: grouped_matmul(x, w, sizes)))(lhs, rhs, jnp.ones((12, 4)))
    assert out.dtype == jnp.float32 and d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
    # Products of bf16 values are exact in fp32: only the fp32 sums over 8 round (a bf16
    # accumulation would be ~1e-2 off; tests/numerics.py, point 4).
    assert_close(out, reference(lhs, rhs, sizes, False), rtol=sum_rtol(8))


def dense_reference(lhs, rhs, sizes):
    """`ragged_dot` written with a per-row gather (differentiable to any order, unlike
    `jax.lax.ragged_dot`'s own second derivative)."""
    row = jnp.arange(lhs.shape[0])
    group = jnp.searchsorted(jnp.cumsum(sizes), row, side="right")
    inside = row < jnp.sum(sizes)
    per_row = rhs[jnp.minimum(group, rhs.shape[0] - 1)]
    return jnp.where(inside[:, None], jnp.einsum("nk,nkp->np", lhs, per_row), 0.0)


@pytest.mark.parametrize("sizes", [(3, 0, 5), (9, 0, 0)])
def test_gradient_of_a_gradient(sizes):
    """Reverse over reverse (a Hessian-vector product), with and without a split group."""
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs, v = normal(rng, 9, 4), normal(rng, 3, 4, 6), normal(rng, 3, 4, 6)

    def hvp(fn):
        grad = jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1))
        return jax.grad(lambda x, w: jnp.vdot(grad(x, w)[1], v), argnums=(0, 1))(lhs, rhs)

    got = jax.jit(lambda: hvp(lambda x, w: grouped_matmul(x, w, sizes)))()
    want = hvp(lambda x, w: dense_reference(x, w, sizes))
    # The gradient is a chain of 2 products (x @ w, then over the 9 rows for d w), and reverse
    # over it 2 more per product: depth 6, sums of at most 9 terms (tests/numerics.py).
    assert_close(got, want, rtol=program_rtol(width=9, depth=3 * 2))
    lhs_long = normal(rng, 11, 4)  # rows past the last group
    assert_close(dense_reference(lhs_long, rhs, sizes), reference(lhs_long, rhs, sizes, False),
                 rtol=sum_rtol(4))


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

    # d rhs sums the 80 rows of all devices (a psum); the rest is per device (tests/numerics.py).
    assert_close(got, value_and_vjp(per_device, lhs, rhs, g), rtol=sum_rtol(8 * 10))


def test_vmap_runs_each_problem():
    rng = np.random.default_rng(2)
    lhs, rhs = normal(rng, 3, 8, 4), normal(rng, 3, 2, 4, 5)
    sizes = jnp.asarray([[3, 5], [0, 8], [6, 1]], jnp.int32)
    got = jax.jit(jax.vmap(grouped_matmul))(lhs, rhs, sizes)
    want = jnp.stack([reference(lhs[i], rhs[i], sizes[i], False) for i in range(3)])
    assert_close(got, want, rtol=sum_rtol(4))  # one matmul over 4 (tests/numerics.py)


def test_bad_input():
    x, w = jnp.ones((6, 4)), jnp.ones((2, 4, 3))
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, w, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="contracting sizes differ"):
        grouped_matmul(x, w, jnp.ones((2,), jnp.int32), trans_b=True)
