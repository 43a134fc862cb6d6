"""ZeRO-3's gathers of several leaves as one collective (`zero.collectives.gather_group`), and
over one mesh axis that spans hosts in two stages (`jaxspeed.sharding.two_level`), on 8
emulated devices.

The inputs are small integers in floating point, so every sum is exact in any order and each
result is held to the collective it replaces bit for bit; the engine's step to a
single-device reference at the suite's fp32 tolerance (`tests/numerics.py`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxspeed.cost import hlo
from jaxspeed.ops.matmul import ENV
from jaxspeed.sharding import two_level
from jaxspeed.zero import collectives as zc
from jaxspeed.zero import layout as zl
from jaxspeed.zero import step as zero_step
from numerics import assert_adam_params_close
from test_engine import LR, RHO, tiny_config
from test_zero_step import dataset  # noqa: F401  (a fixture)
from test_zero_step import HOSTS2, Z, engine_of, params0, single_device, train

N = 8
AXES = ("data", "host")  # data-major, as jaxspeed.runtime.mesh.ZERO_AXES splits ZeRO


def ints(key, shape):
    """Small integers in fp32, drawn on the host (a jitted draw would compile for each shape)."""
    return np.random.default_rng(key).integers(-8, 8, shape).astype(np.float32)


@pytest.fixture(scope="module")
def line():
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def hosts_mesh():
    return jax.make_mesh((2, 4), ("host", "data"), axis_types=(AxisType.Auto,) * 2)


def mapped(mesh, fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 axis_names=set(mesh.axis_names)))


def kinds(fn, *args):
    text = fn.lower(*args).compile().as_text()
    return sorted(op.kind for op in hlo.collectives(text, num_devices=N))


@pytest.mark.parametrize("hosts", [2, 4])
def test_two_level_collectives_equal_the_flat_ones(line, hosts):
    x, rows = ints(0, (N * 3, 5)), ints(1, (N, N, 3, 5))

    def ours(x, rows):
        return (two_level.all_gather(x, "data", hosts=hosts)[None],
                two_level.reduce_scatter(rows[0], "data", hosts=hosts)[None])

    def flat(x, rows):
        return (jax.lax.all_gather(x, "data")[None],
                jax.lax.psum_scatter(rows[0], "data", scatter_dimension=0)[None])

    specs = (P("data"), P("data")), (P("data"), P("data"))
    staged = mapped(line, ours, *specs)  # one jit: its HLO below is the program that ran
    for a, b in zip(staged(x, rows), mapped(line, flat, *specs)(x, rows)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # one message a device a stage: (hosts - 1) across, (8 / hosts - 1) inside
    assert set(kinds(staged, x, rows)) == {"collective-permute"}


#: Three leaves split on different dimensions: [3, 48] on 1, [16, 5] on 0, [32] on 0.
SHAPES, DIMS = ((3, 48), (16, 5), (32,)), (1, 0, 0)


def _leaves(mesh_axes):
    xs = [ints(i, s) for i, s in enumerate(SHAPES)]
    ws = [ints(10 + i, (N, *s)) for i, s in enumerate(SHAPES)]
    specs = [P(*([None] * d), mesh_axes) for d in DIMS]
    return xs, ws, specs


def _gather_and_pull(mesh, axes, gather, dtype):
    """The gathered leaves and the gradient of `sum(w * gathered)` w.r.t. the shards."""
    xs, ws, specs = _leaves(axes)
    all_axes = tuple(mesh.axis_names)

    def local(xs, ws):
        got, pull = jax.vjp(lambda xs: gather(xs, dtype), xs)
        return [g.astype(jnp.float32)[None] for g in got], pull([w[0].astype(dtype)
                                                                   for w in ws])[0]

    fn = mapped(mesh, local, (specs, [P(all_axes)] * 3), ([P(all_axes)] * 3, specs))
    return fn, fn(xs, ws), (xs, ws)


@pytest.mark.parametrize("switches,dtype", [
    (zl.Switches(), jnp.float32), (zl.Switches(bucket=40), jnp.float32),
    (zl.Switches(), jnp.bfloat16)], ids=["one-buffer", "in-pieces", "bf16"])
def test_a_group_gathers_and_reduces_like_each_leaf_alone(hosts_mesh, switches, dtype):
    def grouped(xs, dtype):
        return zc.gather_group(xs, AXES, DIMS, dtype=dtype, switches=switches)

    def alone(xs, dtype):
        return [zc.gather_stage(x, AXES, d, dtype=dtype, switches=switches)
                for x, d in zip(xs, DIMS)]

    fn, (got, grads), args = _gather_and_pull(hosts_mesh, AXES, grouped, dtype)
    _, (want, want_grads), _ = _gather_and_pull(hosts_mesh, AXES, alone, dtype)
    for a, b in zip([*got, *grads], [*want, *want_grads]):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ops = kinds(fn, *args)
    if switches.bucket is None:  # one collective a direction for the three leaves
        assert ops == ["all-gather", "reduce-scatter"]
    else:  # shards of 18 + 10 + 4 elements, 8 peers: pieces of 5 columns (40 elements), 7
        assert ops == ["all-gather", *["reduce-scatter"] * 7]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_group_over_an_axis_across_hosts_runs_in_two_stages(line, dtype):
    def with_hosts(hosts):
        switches = zl.Switches(two_level=(("data", hosts),) if hosts > 1 else ())

        def gather(xs, dtype):
            return zc.gather_group(xs, ("data",), DIMS, dtype=dtype, switches=switches)
        return gather

    fn, staged, args = _gather_and_pull(line, "data", with_hosts(2), dtype)
    _, flat, _ = _gather_and_pull(line, "data", with_hosts(1), dtype)
    for a, b in zip(jax.tree.leaves(staged), jax.tree.leaves(flat)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # gather: across (1 shift) then inside (3); reduce-scatter: inside (3) then across (1)
    assert kinds(fn, *args) == ["collective-permute"] * 8
    # a shard is 32 elements: the gather moves it across, then the 2 hosts' inside, in the
    # compute dtype (bf16 as 16-bit words); the reduce-scatter the same back, in fp32
    ops = hlo.collectives(fn.lower(*args).compile().as_text(), num_devices=N)
    moved = [32, 64, 64, 64]
    assert sorted(op.bytes for op in ops) == sorted(
        [n * jnp.dtype(dtype).itemsize for n in moved] + [n * 4 for n in moved])
    assert zl.Switches(two_level=(("data", 2),)).hosts(("data",)) == 2
    assert zl.Switches(two_level=(("data", 2),)).hosts(AXES) == 1  # a `host` axis names them


def test_leaves_gathered_per_layer_move_in_one_collective_a_layer():
    """The tiny GPT gathered layer by layer across 2 hosts: each layer's leaves in one
    all-gather (forward and recomputed backward) and one reduce-scatter."""
    engine = engine_of(*HOSTS2)  # test_zero_step's ZeRO-3 across hosts: compiled once
    text = engine.compile_train_step().as_text()
    per_layer = [op for op in hlo.collectives(text, num_devices=N) if op.executions > 1]
    assert sorted(op.kind for op in per_layer) == ["all-gather", "all-gather", "reduce-scatter"]


def test_a_data_axis_across_two_processes_trains_like_one_device(  # noqa: F811
        dataset, monkeypatch):
    """`mesh.data=8` over 2 processes (their count stubbed: this is one process): the step's
    ZeRO collectives over `data` run in two stages, to one device's losses and params
    (`test_zero_step.single_device`, from the same params)."""
    monkeypatch.setattr(zero_step, "process_count", lambda devices: 2)
    overrides = ["mesh.data=8", Z + "max_live_parameters=0", Z + "collectives=explicit"]
    engine, state, losses = train(tiny_config(Z + "stage=3", *overrides), dataset, 2,
                                  params=params0())
    assert engine.explicit_zero.switches.two_level == (("data", 2),)
    ops = {op.kind for op in hlo.collectives(engine.compile_train_step().as_text(),
                                             num_devices=N)}
    assert "collective-permute" in ops and not ops & {"all-gather", "reduce-scatter"}, ops
    ref_losses, ref_params = single_device(2)
    np.testing.assert_allclose(losses, ref_losses, rtol=RHO)
    assert_adam_params_close(state.params, ref_params, steps=2, lr=LR, rho=RHO)


def test_a_groups_gradients_reduce_in_runs_of_whole_leaves():
    """With a bucket, consecutive leaves up to the bucket reduce-scatter together, a larger one
    alone (then in pieces): the step never holds every leaf's fp32 gradient at once."""
    assert zc._buckets([144, 80, 32], None) == [[0, 1, 2]]
    assert zc._buckets([144, 80, 32], 40) == [[0], [1], [2]]
    assert zc._buckets([10, 20, 15, 5, 50], 40) == [[0, 1], [2, 3], [4]]
    assert zc._buckets([10, 30, 40], 40) == [[0, 1], [2]]


@pytest.mark.parametrize("layer_by_layer", [False, True], ids=["once-per-step", "layer-by-layer"])
def test_runs_of_whole_leaves_keep_the_step_peak_at_the_sharding_paths(layer_by_layer, monkeypatch):
    """In one buffer a group's gathered weights are held twice (the buffer and the leaves
    cut from it) and its fp32 gradients built at once: once per step, this 0.4M-param GPT
    peaked 10% over the sharding path. In runs of 16k elements it stays within 5% of it (the
    issue's bound), and once per step under the one-buffer step (layer by layer, a layer's
    one buffer already peaked under the sharding path, 3,301,896 against 3,317,240 bytes:
    there only the bound is compiled). Compiled peaks: deterministic.

    The bf16 dots stay bf16, as on a GPU: on a CPU without bf16 units `jaxspeed.ops.matmul`
    widens them to fp32, and there the explicit step layer by layer peaked 1.42x the sharding
    path's (4,708,432 against 3,317,240 bytes; AVX2, jax 0.12.1)."""
    monkeypatch.setenv(ENV, "native")
    from jaxspeed.config import load_config
    from jaxspeed.cost.memory import compiled_stats, step_peak
    from jaxspeed.train.engine import initialize

    def peak(collectives, elements):
        config = load_config({
            "mesh": {"data": -1}, "train_micro_batch_size_per_device": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "collectives": collectives,
                                  "max_live_parameters": 0 if layer_by_layer else 10**9,
                                  "max_reduce_scatter_elements": elements},
            "model": {"vocab_size": 256, "d_model": 128, "n_layers": 2, "n_heads": 4,
                      "d_ff": 512, "max_seq_len": 32, "tie_embeddings": True},
            "data": {"seq_len": 32},
        })
        return step_peak(compiled_stats(initialize(config).compile_train_step()))

    sharding, runs = peak("compiler", 2**14), peak("explicit", 2**14)
    assert runs <= 1.05 * sharding, (runs, sharding)
    if not layer_by_layer:
        one_buffer = peak("explicit", 2**30)
        assert runs < one_buffer, (runs, one_buffer)
