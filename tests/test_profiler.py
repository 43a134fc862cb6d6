"""Profiler: collective bytes from HLO, FLOPs from the jaxpr, MFU."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxspeed as js
from jaxspeed.models.gpt import count_params
from jaxspeed.cost.flops import jaxpr_flops, memory_traffic, roofline_seconds
from jaxspeed.cost.hlo import Collective, Dot, collective_bytes, collectives, dots
from jaxspeed.cost.peaks import mfu, peak_flops


def test_each_collective_kind_matches_a_hand_count():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def step(x):  # x: [1024] f32 per device = 4 KiB
        x = jax.lax.psum_scatter(x, "data", tiled=True)  # reads 4 KiB
        x = jax.lax.all_gather(x, "data", tiled=True)  # writes 4 KiB
        x = jax.lax.all_to_all(x, "data", 0, 0, tiled=True)  # 4 KiB
        x = jax.lax.ppermute(x, "data", [(i, (i + 1) % 8) for i in range(8)])  # 4 KiB
        x, _ = jax.lax.scan(lambda c, _: (jax.lax.psum(c, "data") + c, None), x, None, length=3)
        return x  # 3 × 4 KiB of all-reduce

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    text = fn.lower(jnp.ones(8 * 1024)).compile().as_text()
    assert collective_bytes(text, num_devices=8) == {
        "all-reduce": 3 * 4096, "all-gather": 4096, "reduce-scatter": 4096,
        "all-to-all": 4096, "collective-permute": 4096, "total": 7 * 4096,
    }


def test_zero2_moves_the_gradients_once_and_regathers_the_params():
    overrides = [
        "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.d_ff=128",
        "model.max_seq_len=16", "data.seq_len=16", "train_batch_size=8", "mesh.data=8",
        "zero_optimization.stage=2",
    ]
    engine = js.initialize(js.load_config(None, overrides=overrides))
    grad_bytes = 4 * count_params(engine.abstract_state().params)
    moved = engine.profile()["collective_bytes"]
    # N×4 bytes of gradients are reduced (XLA:GPU emits a reduce-scatter; XLA:CPU an
    # all-reduce of the same buffer), plus a few scalars (loss, norm).
    reduced = moved["reduce-scatter"] + moved["all-reduce"]
    assert grad_bytes <= reduced <= grad_bytes + 64
    # The updated shards are gathered back into the replicated params; the tied embedding's
    # scatter-add gradient also gathers the batch's token ids and output cotangents.
    batch, length, width = 8, 16, 64
    assert moved["all-gather"] == grad_bytes + 4 * batch * length * (width + 1)


HLO = """\
HloModule m

%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %ag = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %x), replica_groups=[2,4]<=[8], dimensions={0}
  %done = f32[16]{0} all-gather-done(%ag)
  %rs = bf16[2]{0} reduce-scatter(bf16[16]{0} %y), replica_groups=[2,4]<=[8], dimensions={0}
}

%cond (p: (s32[], f32[16])) -> pred[] {
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%branch (p: f32[8]) -> f32[8] {
  %cp = f32[8]{0} collective-permute(f32[8]{0} %p), source_target_pairs={{0,1}}
}

ENTRY %main (a: f32[16]) -> f32[16] {
  %w = (s32[], f32[16]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %c = f32[8] conditional(%i, %a, %b), branch_computations={%branch, %branch}
  ROOT %ar = f32[16]{0} all-reduce-start(f32[16]{0} %a), replica_groups={{0,1,2,3,4,5,6,7}}
}
"""


def test_async_collectives_loops_and_branches():
    moved = collective_bytes(HLO, num_devices=8)
    assert moved["all-gather"] == 5 * 64  # the gathered f32[16], 5 iterations
    assert moved["reduce-scatter"] == 5 * 2 * 2 * 4  # bf16[2] × group of 4, 5 iterations
    assert moved["collective-permute"] == 2 * 32  # both branches counted (upper bound)
    assert moved["all-reduce"] == 64


def test_each_collective_instruction_with_its_executions():
    assert collectives(HLO, num_devices=8) == [
        Collective("all-gather", "ag", "body", 64, 5),
        Collective("reduce-scatter", "rs", "body", 2 * 2 * 4, 5),
        Collective("collective-permute", "cp", "branch", 32, 2),
        Collective("all-reduce", "ar", "main", 64, 1),
    ]
    unreached = HLO.replace("body=%body", "body=%other")
    assert [op.name for op in collectives(unreached, num_devices=8)] == ["cp", "ar"]


def test_jaxpr_flops_counts_scan_iterations():
    w = jnp.ones((32, 64))
    x = jnp.ones((8, 32))

    def fn(x, w):
        def layer(h, _):
            return (h @ w) @ w.T, None

        return jax.lax.scan(layer, x, None, length=3)[0]

    assert jaxpr_flops(fn, x, w) == 3 * 2 * (2 * 8 * 32 * 64)
    grad_flops = jaxpr_flops(jax.grad(lambda x, w: fn(x, w).sum(), argnums=(0, 1)), x, w)
    assert grad_flops == 3 * jaxpr_flops(fn, x, w)  # forward + two matmuls per matmul back


def test_jaxpr_flops_counts_a_shard_map_body_once_per_device():
    """A `shard_map` body is one device's share: the batch split over 2 x 4 devices, partly
    manual, fully, or by two nested maps, still counts the global matmul."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
    dense = jaxpr_flops(lambda x, w: x @ w, x, w)

    def split(axes, body=lambda x, w: x @ w, mesh=mesh):
        return jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P()), out_specs=P(axes),
                             axis_names=set(axes))

    nested = split(("a",), split(("b",), mesh=None))  # the inner map on the context's mesh
    with jax.set_mesh(mesh):
        assert jaxpr_flops(split(("a",)), x, w) == dense
        assert jaxpr_flops(split(("a", "b")), x, w) == dense
        assert jaxpr_flops(nested, x, w) == dense


def test_peak_and_mfu():
    assert peak_flops("NVIDIA H200") == 989.4e12  # dense bf16: half the datasheet's sparse 1,979
    assert peak_flops("cpu") is None
    assert peak_flops("cpu", 2.0) == 2e12
    assert mfu(1e12, 2.0, 1e12) == 0.5
    assert mfu(1e12, 2.0, None) is None


def _traffic(fn, *args):
    return memory_traffic(jax.jit(fn).lower(*args).compile().as_text())


def test_memory_traffic_counts_loops_per_iteration_and_one_branch():
    x = jnp.ones((256, 256), jnp.float32)
    once = _traffic(lambda a: jnp.tanh(a) * 3, x)
    assert 2 * x.nbytes <= once <= 4 * x.nbytes  # read a, write the result (one or two passes)

    def loop(a, n):
        return jax.lax.fori_loop(0, n, lambda i, b: jnp.tanh(b) * 3, a)

    assert _traffic(lambda a: loop(a, 10), x) >= 8 * _traffic(lambda a: loop(a, 1), x)

    def branches(a, pred):  # one branch runs: the costlier one counts, not both
        return jax.lax.cond(pred, lambda b: loop(b, 10), lambda b: loop(b, 6), a)

    ten, six = _traffic(lambda a: loop(a, 10), x), _traffic(lambda a: loop(a, 6), x)
    assert ten <= _traffic(branches, x, True) < ten + six / 2


def test_memory_traffic_counts_an_in_place_update_by_its_update():
    big, row = jnp.ones((4096, 256), jnp.float32), jnp.ones((1, 256), jnp.float32)

    def update(buf, r, i):
        return jax.lax.dynamic_update_slice(buf, r, (i, 0))

    text = jax.jit(update, donate_argnums=0).lower(big, row, 3).compile().as_text()
    assert memory_traffic(text) < big.nbytes  # not the whole buffer read and written


def _roofline(fn, *args, flops_per_s=1e9, bytes_per_s=1e9):
    text = jax.jit(fn).lower(*args).compile().as_text()
    return roofline_seconds(text, flops_per_s=flops_per_s, bytes_per_s=bytes_per_s), memory_traffic(text)


def test_roofline_counts_each_matmul_and_sums_the_memory_bound_rest():
    a, b = jnp.ones((256, 512), jnp.float32), jnp.ones((512, 128), jnp.float32)
    matmul_flops = 2 * 256 * 512 * 128
    roof, traffic = _roofline(lambda x, y: x @ y, a, b, flops_per_s=1e9, bytes_per_s=1e12)
    assert roof["flops"] == matmul_flops  # found in the HLO, fused or not
    assert roof["compute"] == pytest.approx(matmul_flops / 1e9) and roof["memory"] == 0
    # the same program on a slow memory: the matmul becomes memory-bound
    roof, traffic = _roofline(lambda x, y: x @ y, a, b, flops_per_s=1e15, bytes_per_s=1e6)
    assert roof["compute"] == 0 and roof["memory"] == pytest.approx(traffic / 1e6)

    # a matmul-bound matmul then a memory-bound elementwise pass: the times add, where a
    # roofline of the whole program would take the larger of its FLOPs and its bytes
    x = jnp.ones((512, 512), jnp.float32)

    def both(x):
        y = x @ x
        return jnp.tanh(jnp.sort(y, axis=0))  # a sort stays out of the matmul's fusion

    roof, traffic = _roofline(both, x, flops_per_s=2 * 512**3 / 1.0, bytes_per_s=1e9)
    assert roof["compute"] == pytest.approx(1.0)
    assert 0 < roof["memory"] < traffic / 1e9  # the rest, not the matmul's operands too
    assert roof["compute"] + roof["memory"] > max(1.0, traffic / 1e9)


def test_roofline_counts_loops_per_iteration_and_leaves_collectives_out():
    x = jnp.ones((128, 128), jnp.float32)

    def loop(a, n):
        return jax.lax.fori_loop(0, n, lambda i, b: jnp.tanh(b @ a), a)

    one, _ = _roofline(lambda a: loop(a, 1), x)
    ten, _ = _roofline(lambda a: loop(a, 10), x)
    assert ten["flops"] == 10 * one["flops"] == 10 * 2 * 128**3

    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    sharded = jax.device_put(jnp.ones((8, 4096), jnp.float32), NamedSharding(mesh, P("d")))
    text = jax.jit(lambda v: jnp.sum(v, axis=0)).lower(sharded).compile().as_text()
    assert collectives(text, num_devices=8)  # an all-reduce, costed on its link elsewhere
    roof = roofline_seconds(text, flops_per_s=1e9, bytes_per_s=1.0)
    assert roof["memory"] < memory_traffic(text)  # its bytes are not counted here


def test_dots_lists_each_dot_per_device_with_its_loop_executions():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(jnp.ones((8 * 16, 32), jnp.float32), NamedSharding(mesh, P("d")))
    w = jnp.ones((32, 32), jnp.bfloat16)
    q = jnp.ones((2, 16, 8), jnp.float32)

    def fn(x, w, q):
        h = jax.lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ w.astype(jnp.float32)), x)
        return h, jnp.einsum("bqd,bkd->bqk", q, q)

    found = dots(jax.jit(fn).lower(x, w, q).compile().as_text())
    assert sorted(found, key=lambda d: d.executions) == [
        Dot(lhs=(2, 16, 8), rhs=(2, 16, 8), dtypes=("f32", "f32", "f32"),
            dimension_numbers=(((2,), (2,)), ((0,), (0,))), executions=1),
        # the rows of x on one device (16 of 128), once per iteration
        Dot(lhs=(16, 32), rhs=(32, 32), dtypes=("f32", "f32", "f32"),
            dimension_numbers=(((1,), (0,)), ((), ())), executions=5),
    ]
    assert [d.flops for d in found if d.executions == 5] == [2 * 16 * 32 * 32]
    assert [d.flops for d in found if d.executions == 1] == [2 * 2 * 16 * 16 * 8]
