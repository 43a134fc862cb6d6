"""ZeRO-3's explicit gather / reduce-scatter and ZeRO++'s variants, on 2 emulated hosts x 4.

Each against the collective it replaces (`all_gather`, `psum_scatter`), exactly where nothing
is quantized, within the block quantizer's error (`|err| <= scale / 2` per element and per
quantization, `scale = max|block| / qmax`) where something is; and what the compiled program
moves, read from its HLO.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxspeed.cost import hlo
from jaxspeed.ops import quantize as qz
from jaxspeed.zero import collectives as zc
from jaxspeed.zero import layout as zl
from jaxspeed.zero import comm

HOSTS, DATA = 2, 4
AXES = ("data", "host")  # the ZeRO split: data-major (jaxspeed.runtime.mesh.ZERO_AXES)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((HOSTS, DATA), ("host", "data"), axis_types=(AxisType.Auto,) * 2)


def shard_fn(mesh, fn, in_spec, out_spec):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                                 axis_names={"host", "data"}))


def test_leaf_gather_from_spec_and_stages():
    leaf = zl.leaf_gather(P(None, ("data", "host"), "tensor"))
    assert leaf == zl.LeafGather(1, AXES, (None, None, "tensor"))
    assert leaf.kept_axes == ("tensor",)
    assert zl.leaf_gather(P(None, ("data", "host"))) == zl.LeafGather(1, AXES)
    assert leaf.stages(hpz=False) == (AXES,)
    assert leaf.stages(hpz=True) == (("host",), ("data",))
    assert zl.leaf_gather(P("tensor")) is None
    assert zl.LeafGather(1, ("host",)).stages(hpz=True) == (("host",),)
    assert leaf.sliced() == zl.LeafGather(0, AXES, (None, "tensor"))
    # inside a tensor group, ZeRO's shards of a dimension split over both are not contiguous
    with pytest.raises(ValueError, match="split over .*'data'.*alone"):
        zl.leaf_gather(P(("data", "tensor"), None))


@pytest.mark.parametrize("switches", [zl.Switches(), zl.Switches(hpz=True)], ids=["zero3", "hpz"])
def test_gather_equals_all_gather_and_its_transpose_psum_scatter(mesh, switches):
    """Gathered: the whole array on every device. Gradient of `sum(w * gathered)` with a
    per-device `w`: the sum over devices of `w` (psum_scatter), each device its block."""
    x = jax.random.normal(jax.random.key(0), (3, 8 * 6))
    w = jax.random.normal(jax.random.key(1), (HOSTS * DATA, 3, 8 * 6))
    leaf = zl.LeafGather(1, AXES)

    def local(x, w):
        gathered, pull = jax.vjp(
            lambda x: zc.gather_leaf(x, leaf, dtype=jnp.float32, switches=switches), x)
        return gathered[None], pull(w[0])[0]

    got, grad = shard_fn(mesh, local, (P(None, AXES), P(("host", "data"))),
                         (P(("host", "data")), P(None, AXES)))(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(np.asarray(x), got.shape))
    np.testing.assert_allclose(np.asarray(grad), np.asarray(w.sum(0)), rtol=1e-6, atol=1e-6)


def test_gather_matches_reference_collectives_bit_for_bit(mesh):
    x = jax.random.normal(jax.random.key(0), (8 * 4, 5))
    g = jax.random.normal(jax.random.key(1), (HOSTS * DATA * 8 * 4, 5))

    def ours(x, g):
        return (comm.all_gather(x, AXES, 0, dtype=jnp.float32)[None],
                comm.reduce_scatter(g, AXES, 0))

    def reference(x, g):
        return (jax.lax.all_gather(x, AXES, axis=0, tiled=True)[None],
                jax.lax.psum_scatter(g, AXES, scatter_dimension=0, tiled=True))

    specs = ((P(AXES), P(("host", "data"))), (P(("host", "data")), P(AXES)))
    for a, b in zip(shard_fn(mesh, ours, *specs)(x, g), shard_fn(mesh, reference, *specs)(x, g)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dim, bucket", [(0, 40), (1, 48), (1, 40), (1, 7), (0, 10_000)],
                         ids=["rows", "columns", "ragged", "below-peers", "one-piece"])
def test_bucketed_reduce_scatter_equals_psum_scatter(mesh, dim, bucket):
    """`max_reduce_scatter_elements`: the same sum and blocks as one `psum_scatter`, bit for
    bit (each element is summed over the same devices, in pieces of at most `bucket`)."""
    shape = [HOSTS * DATA * 3, 10] if dim == 0 else [6, HOSTS * DATA * 2]
    g = jax.random.normal(jax.random.key(2), (HOSTS * DATA, *shape))
    spec_in = P(("host", "data"))
    out_spec = P(AXES) if dim == 0 else P(None, AXES)

    def local(fn):
        return lambda g: fn(g[0])

    ours = shard_fn(mesh, local(lambda g: comm.reduce_scatter(g, AXES, dim, bucket=bucket)),
                    spec_in, out_spec)
    ref = shard_fn(mesh, local(lambda g: jax.lax.psum_scatter(
        g, AXES, scatter_dimension=dim, tiled=True)), spec_in, out_spec)
    np.testing.assert_array_equal(np.asarray(ours(g)), np.asarray(ref(g)))
    text = ours.lower(g).compile().as_text()
    sizes = [op.bytes // 4 for op in hlo.collectives(text, num_devices=HOSTS * DATA)]
    columns = int(np.prod(shape)) // (HOSTS * DATA)  # of each peer's block, flattened
    width = max(1, bucket // (HOSTS * DATA))  # at least one element a peer
    assert len(sizes) == (-(-columns // width) if bucket < np.prod(shape) else 1), sizes
    assert max(sizes) <= max(bucket, HOSTS * DATA), sizes


def test_bucketed_gather_transpose_keeps_the_gradient(mesh):
    """The gather's transpose with `bucket`: the gradient equals the unbucketed one."""
    x = jax.random.normal(jax.random.key(0), (3, 8 * 6))
    w = jax.random.normal(jax.random.key(1), (HOSTS * DATA, 3, 8 * 6))
    leaf = zl.LeafGather(1, AXES)

    def grad_with(switches):
        def local(x, w):
            _, pull = jax.vjp(
                lambda x: zc.gather_leaf(x, leaf, dtype=jnp.float32, switches=switches), x)
            return pull(w[0])[0]
        return shard_fn(mesh, local, (P(None, AXES), P(("host", "data"))), P(None, AXES))(x, w)

    np.testing.assert_array_equal(np.asarray(grad_with(zl.Switches(bucket=16))),
                                  np.asarray(grad_with(zl.Switches())))


def test_quantized_gather_within_half_a_scale(mesh):
    x = jax.random.normal(jax.random.key(0), (8 * 40, 3)) * 5
    block = 64

    def local(x):
        return comm.all_gather(x, AXES, 0, dtype=jnp.float32, quantized=True, block=block)[None]

    got = np.asarray(shard_fn(mesh, local, P(AXES), P(("host", "data")))(x))
    shards = np.asarray(x).reshape(HOSTS * DATA, 40 * 3)  # each device's shard, flattened
    padded = np.pad(shards, ((0, 0), (0, 128 - 40 * 3))).reshape(HOSTS * DATA, -1, block)
    bound = np.repeat(np.abs(padded).max(2) / 127 / 2, block, axis=1)[:, : 40 * 3]
    err = np.abs(got - np.asarray(x)[None]).reshape(HOSTS * DATA, HOSTS * DATA, 40 * 3)
    assert np.all(err <= bound[None] * (1 + 2**-20)), err.max()
    assert err.max() > 0  # it did quantize


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("axes", [AXES, ("host", "data")], ids=["data-major", "host-major"])
def test_quantized_reduce_scatter_within_its_error_bound(mesh, bits, axes):
    """Two all-to-alls, each quantizing what it sends: inside the host `DATA` chunks of
    at most `max|g|`, then across hosts `HOSTS` partial sums of at most `DATA * max|g|`, a
    `1 / DATA` part of the gradient. Host-major (`shard_order: host`), the first scatters
    the inner part of the dimension."""
    g = jax.random.normal(jax.random.key(2), (HOSTS * DATA, 8 * 16, 4))

    def ours(g):
        return comm.reduce_scatter(g[0], axes, 0, bits=bits, block=32)

    fn = shard_fn(mesh, ours, P(("host", "data")), P(axes))
    got = np.asarray(fn(g))
    want = np.asarray(g).sum(0)
    step = np.abs(np.asarray(g)).max() / qz.QMAX[bits]
    bound = (DATA * step + HOSTS * DATA * step) / 2
    err = np.abs(got - want)
    assert err.max() <= bound, (err.max(), bound)
    assert err.max() > 0
    sent = {len(op.groups[0]): op.bytes for op in hlo.collectives(
        fn.lower(g).compile().as_text(), num_devices=HOSTS * DATA) if op.kind == "all-to-all"}
    assert sent[HOSTS] < sent[DATA]  # across hosts: what is left after the host's scatter


def _hlo_collectives(mesh, switches, *, shape=(8 * 64, 4)):
    x = jnp.ones(shape)
    leaf = zl.LeafGather(0, AXES)

    def local(x):
        def loss(x):
            y = zc.gather_leaf(x, leaf, dtype=jnp.bfloat16, switches=switches)
            y = y.astype(jnp.float32)
            return jnp.sum(y * y * (1 + jax.lax.axis_index(("host", "data"))))
        return jax.grad(loss)(x)

    text = shard_fn(mesh, local, P(AXES), P(AXES)).lower(x).compile().as_text()
    return hlo.collectives(text, num_devices=HOSTS * DATA), text


def _crosses_hosts(op) -> bool:
    return any(len({d // DATA for d in group}) > 1 for group in op.groups)


def test_hlo_zero3_is_all_gather_and_reduce_scatter(mesh):
    ops, text = _hlo_collectives(mesh, zl.Switches())
    kinds = sorted(op.kind for op in ops)
    assert kinds == ["all-gather", "reduce-scatter"], kinds
    gather = next(op for op in ops if op.kind == "all-gather")
    assert gather.bytes == 8 * 64 * 4 * 2  # bf16, the gathered buffer
    assert "all-reduce" not in text


def test_hlo_qwz_gathers_int8_and_qgz_all_to_alls_packed_int4(mesh):
    ops, text = _hlo_collectives(mesh, zl.Switches(quantized_weights=True, gradient_bits=4))
    assert {op.kind for op in ops} == {"all-gather", "all-to-all"}
    assert any(line for line in text.splitlines() if "all-gather" in line and "s8[" in line)
    packed = [line for line in text.splitlines()
              if " all-to-all(" in line and "u8[" in line]
    assert packed, "qgZ's all-to-all moves packed uint8"
    a2a = [op for op in ops if op.kind == "all-to-all" and op.bytes > 64]  # values, not scales
    # inside the host first: the full-size gradient in 4 chunks, each 64*4*2/4 elements at 4 bits
    intra = [op for op in a2a if not _crosses_hosts(op)]
    cross = [op for op in a2a if _crosses_hosts(op)]
    assert [op.bytes for op in intra] == [8 * 64 * 4 // 2] and [op.bytes for op in cross] == [
        8 * 64 * 4 // 2 // DATA]


def test_hlo_hpz_gathers_across_hosts_once_then_inside(mesh):
    ops, _ = _hlo_collectives(mesh, zl.Switches(hpz=True))
    gathers = [op for op in ops if op.kind == "all-gather"]
    assert sorted(_crosses_hosts(op) for op in gathers) == [False, True]
    scatters = [op for op in ops if op.kind == "reduce-scatter"]
    assert sorted(_crosses_hosts(op) for op in scatters) == [False, True]

