"""Communication cost of a compiled step: device groups from HLO, link formulas, placement."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspeed.autoplan.comm import step_comm_seconds
from jaxspeed.network.collectives import collective_time, hosts_spanned
from jaxspeed.network.links import collective_seconds
from jaxspeed.network.placement import group_axes
from jaxspeed.runtime.mesh import AXES, make_mesh
from jaxspeed.cost.hlo import Collective, collectives


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth_gbps: float
    latency_us: float


NVLINK = Link(bandwidth_gbps=400.0, latency_us=2.0)
IB = Link(bandwidth_gbps=50.0, latency_us=10.0)
SHAPE = {"data": 4, "tensor": 2}


def _compiled(fn, *args, **jit_kwargs) -> list[Collective]:
    text = jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()
    return collectives(text, num_devices=8)


def _sets(groups) -> set[frozenset[int]]:
    return {frozenset(g) for g in groups}


def _mesh_groups(shape: dict[str, int], axes: tuple[str, ...]) -> set[frozenset[int]]:
    """Partition ids that differ only along `axes`, from the row-major layout over `AXES`."""
    ids = np.arange(math.prod(shape.values())).reshape([shape.get(a, 1) for a in AXES])
    grouped = [AXES.index(a) for a in axes]
    rest = [i for i in range(len(AXES)) if i not in grouped]
    size = math.prod(shape.get(a, 1) for a in axes)
    return _sets(ids.transpose(rest + grouped).reshape(-1, size).tolist())


# --- Device groups from HLO. ----------------------------------------------------------------


@pytest.mark.parametrize("reverse", [False, True], ids=["devices", "reversed-devices"])
@pytest.mark.parametrize(
    "shape,axes",
    [(SHAPE, ("data",)), (SHAPE, ("tensor",)), (SHAPE, ("data", "tensor")),
     ({"pipe": 2, "data": 2, "tensor": 2}, ("pipe", "tensor"))],
)
def test_parsed_groups_are_the_devices_a_psum_adds(shape, axes, reverse):
    devices = jax.devices()[::-1] if reverse else jax.devices()
    mesh = make_mesh(shape, devices=devices)
    # The device at mesh position p contributes 2**p, so each sum spells its group in bits.
    x = (1 << np.arange(8, dtype=np.int32)).reshape(mesh.devices.shape)
    spec = P(*AXES)
    fn = jax.shard_map(lambda v: jax.lax.psum(v, axes), mesh=mesh, in_specs=spec,
                       out_specs=spec, check_vma=False)
    summed = np.asarray(jax.jit(fn)(x)).reshape(-1)
    added = _sets([i for i in range(8) if total >> i & 1] for total in summed)
    (op,) = _compiled(fn, x)
    assert op.kind == "all-reduce"
    assert _sets(op.groups) == added == _mesh_groups(shape, axes)
    assert group_axes(op.groups, shape) == axes


def _shard_map_op(kind: str, axes: tuple[str, ...]):
    n = math.prod(SHAPE[a] for a in axes)
    ring = [(i, (i + 1) % n) for i in range(n)]
    return {
        "all-reduce": lambda v: jax.lax.psum(v, axes),
        "all-gather": lambda v: jax.lax.all_gather(v, axes, tiled=True),
        "reduce-scatter": lambda v: jax.lax.psum_scatter(v, axes, scatter_dimension=0, tiled=True),
        "all-to-all": lambda v: jax.lax.all_to_all(v, axes, 0, 1, tiled=True),
        "collective-permute": lambda v: jax.lax.ppermute(v, axes, ring),
    }[kind]


@pytest.mark.parametrize("axes", [("data",), ("tensor",), ("data", "tensor")])
@pytest.mark.parametrize(
    "kind", ["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]
)
def test_group_axes_recovers_the_axes_of_each_collective(kind, axes):
    mesh = make_mesh(SHAPE)
    fn = jax.shard_map(_shard_map_op(kind, axes), mesh=mesh, in_specs=P(), out_specs=P(),
                       check_vma=False)
    (op,) = _compiled(fn, jnp.ones((8, 8)))
    assert op.kind == kind
    assert group_axes(op.groups, SHAPE) == axes
    if kind != "collective-permute":
        assert _sets(op.groups) == _mesh_groups(SHAPE, axes)


def test_groups_of_collectives_that_xla_inserts():
    mesh = make_mesh(SHAPE)
    ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    w = jax.device_put(jnp.ones((16, 16)), ns("data", "tensor"))
    x = jax.device_put(jnp.ones((8, 16)), ns("data", None))
    ops = _compiled(lambda w, x: (x @ w).sum(), w, x)  # iota and XLA-named mesh forms
    assert {op.kind: _sets(op.groups) for op in ops if op.kind == "all-gather"} == {
        "all-gather": _mesh_groups(SHAPE, ("data",))}
    assert sorted(group_axes(op.groups, SHAPE) for op in ops) == [("data",), ("data",), ("tensor",)]
    # Summing over a reshape of a data-sharded vector runs on sub-axes of `data`.
    v = jax.device_put(jnp.arange(64.0), NamedSharding(make_mesh({"data": 8}), P("data")))
    ops = {op.kind: _sets(op.groups) for op in _compiled(lambda v: v.reshape(2, 32).sum(0), v)}
    assert ops["all-reduce"] == _sets([(0, 4), (1, 5), (2, 6), (3, 7)])
    assert ops["all-gather"] == _sets([(0, 1, 2, 3), (4, 5, 6, 7)])


_DATA_GROUPS = [(0, 2, 4, 6), (1, 3, 5, 7)]
_TENSOR_GROUPS = [(0, 1), (2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize(
    "attribute,groups",
    [  # each form as jax 0.12 prints it
        ("replica_groups=mesh['pipe'=1,'data'=4,'sequence'=1,'expert'=1,'tensor'=2] {'data'}",
         _DATA_GROUPS),
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", _TENSOR_GROUPS),
        ("replica_groups=mesh['pipe'=1,'data'=4,'sequence'=1,'expert'=1,'tensor'=2] "
         "{'tensor','data'}", [range(8)]),
        ("replica_groups=mesh['pipe'=1,'data'=8,'sequence'=1,'expert'=1,'tensor'=1] {'data':(1)2}",
         [(0, 4), (1, 5), (2, 6), (3, 7)]),
        ("replica_groups=mesh['pipe'=1,'data'=8,'sequence'=1,'expert'=1,'tensor'=1] {'data':(2)4}",
         [(0, 1, 2, 3), (4, 5, 6, 7)]),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", _DATA_GROUPS),
        ("replica_groups=[4,2]<=[8]", _TENSOR_GROUPS),
        ("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", [(0, 2), (1, 3), (4, 6), (5, 7)]),
        ("replica_groups={{0,2,4,6},{1,3,5,7}}", _DATA_GROUPS),
        ("replica_groups={}", [range(8)]),
    ],
)
def test_each_replica_group_form(attribute, groups):
    hlo = f"""\
HloModule m

ENTRY %main (a: f32[16]) -> f32[16] {{
  ROOT %ar = f32[16]{{0}} all-reduce(f32[16]{{0}} %a), channel_id=1, {attribute}, to_apply=%add
}}
"""
    (op,) = collectives(hlo, num_devices=8)
    assert _sets(op.groups) == _sets(groups)


def test_source_target_pairs_and_the_axes_they_cross():
    hlo = """\
HloModule m

ENTRY %main (a: f32[16]) -> f32[16] {
  ROOT %cp = f32[16]{0} collective-permute(f32[16]{0} %a), source_target_pairs={{0,0},{2,4},{4,2}}
}
"""
    (op,) = collectives(hlo, num_devices=8)
    assert op.groups == ((0, 0), (2, 4), (4, 2))
    assert group_axes(op.groups, {"pipe": 2, "data": 2, "tensor": 2}) == ("pipe", "data")
    with pytest.raises(ValueError, match="outside the mesh"):
        group_axes(op.groups, {"data": 4})


# --- Link formulas against measured bytes. --------------------------------------------------


@pytest.mark.parametrize(
    "kind,seconds",
    [
        ("all-reduce", 2 * 7 / 8 * 1e9 / 100e9 + 2 * 7 * 5e-6),
        ("all-gather", 7 / 8 * 1e9 / 100e9 + 7 * 5e-6),
        ("reduce-scatter", 7 / 8 * 1e9 / 100e9 + 7 * 5e-6),
        ("all-to-all", 7 / 8 * 1e9 / 100e9 + 7 * 5e-6),
        ("collective-permute", 1e9 / 100e9 + 5e-6),
    ],
)
def test_collective_seconds_by_hand(kind, seconds):
    link = Link(bandwidth_gbps=100.0, latency_us=5.0)
    assert collective_seconds(kind, 1e9, 8, link) == pytest.approx(seconds)
    assert collective_seconds(kind, 1e9, 1, link) == 0.0


def test_collective_seconds_rejects_bad_input():
    with pytest.raises(ValueError, match="accepted kinds"):
        collective_seconds("all-sum", 1.0, 2, NVLINK)
    with pytest.raises(ValueError, match="bandwidth_gbps must be > 0"):
        collective_seconds("all-gather", 1.0, 2, Link(0.0, 1.0))


def _zero_step() -> tuple[list[Collective], int]:
    """ZeRO-style: params sharded over `data`, all-gathered in the forward, gradient reduced."""
    mesh = make_mesh(SHAPE)
    ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    w = jax.device_put(jnp.ones((32, 16)), ns("data", None))
    x = jax.device_put(jnp.ones((8, 32)), ns("data", None))
    grad = jax.grad(lambda w, x: jnp.sum((x @ w) ** 2))
    return _compiled(grad, w, x, out_shardings=ns("data", None)), 32 * 16 * 4


def test_zero_step_moves_the_param_bytes_and_costs_them_on_its_links():
    ops, param_bytes = _zero_step()
    moved = {kind: sum(op.bytes * op.executions for op in ops if op.kind == kind)
             for kind in ("all-gather", "all-reduce", "reduce-scatter")}
    assert moved["all-gather"] == param_bytes  # the gathered params
    # the gradient: XLA:CPU all-reduces it, XLA:GPU reduce-scatters the same buffer
    assert moved["all-reduce"] + moved["reduce-scatter"] == param_bytes
    assert {group_axes(op.groups, SHAPE) for op in ops} == {("data",)}

    gather, reduce = 3 / 4 * param_bytes, 2 * 3 / 4 * param_bytes
    one_host = step_comm_seconds(ops, SHAPE, devices_per_host=8, intra=NVLINK, inter=IB)
    assert one_host["total"] == pytest.approx(gather / 400e9 + 3 * 2e-6 + reduce / 400e9 + 6 * 2e-6)
    assert one_host["by_axes"] == {"data": one_host["total"]}
    assert one_host["by_kind"]["all-gather"] == pytest.approx(gather / 400e9 + 3 * 2e-6)
    # 2 devices per host: the data group {0, 2, 4, 6} has one member on each of 4 hosts
    per_device = step_comm_seconds(ops, SHAPE, devices_per_host=2, intra=NVLINK, inter=IB)
    assert per_device["total"] == pytest.approx(gather / 50e9 + 3e-5 + reduce / 50e9 + 6e-5)


# --- Placement on hosts. --------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,axes,per_host,spanned",
    [
        ({"data": 16, "tensor": 8}, ("tensor",), 8, (1, 8)),
        ({"data": 16, "tensor": 8}, ("data",), 8, (16, 1)),
        ({"data": 16, "tensor": 8}, ("data", "tensor"), 8, (16, 8)),
        ({"data": 2, "tensor": 4}, ("data",), 8, (1, 2)),
        ({"data": 4, "tensor": 8}, ("data",), 16, (2, 2)),
        ({"pipe": 2, "data": 4, "tensor": 2}, ("pipe",), 8, (2, 1)),
    ],
)
def test_hosts_spanned(shape, axes, per_host, spanned):
    assert hosts_spanned(axes, shape, per_host) == spanned


@pytest.mark.parametrize(
    "kind", ["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]
)
def test_flat_collectives_run_on_one_link(kind):
    shape, b, links = {"data": 16, "tensor": 8}, 1e9, dict(intra=NVLINK, inter=IB)
    inside = collective_time(kind, b, ("tensor",), shape, devices_per_host=8, **links)
    across = collective_time(kind, b, ("data",), shape, devices_per_host=8, **links)
    assert inside == pytest.approx(collective_seconds(kind, b, 8, NVLINK))
    assert across == pytest.approx(collective_seconds(kind, b, 16, IB))


def test_a_group_over_hosts_runs_hierarchically():
    # data 4 x tensor 8 on 16-device hosts: the data group {0, 8, 16, 24} is 2 hosts x 2.
    shape, b = {"data": 4, "tensor": 8}, 1e9

    def cost(kind: str) -> float:
        return collective_time(kind, b, ("data",), shape, devices_per_host=16,
                               intra=NVLINK, inter=IB)

    half_intra = 1 / 2 * b / 400e9 + 2e-6  # a 2-device ring step on B inside a host
    half_inter = 1 / 2 * (b / 2) / 50e9 + 10e-6  # a 2-host ring step on B/2
    assert cost("all-reduce") == pytest.approx(half_intra + 2 * half_inter + half_intra)
    assert cost("all-gather") == pytest.approx(half_inter + half_intra)
    assert cost("reduce-scatter") == pytest.approx(half_intra + half_inter)
    assert cost("all-to-all") == pytest.approx(3 / 4 * b / 50e9 + 3 * 10e-6)
    assert cost("collective-permute") == pytest.approx(b / 50e9 + 10e-6)


# --- Proxy compiles. ------------------------------------------------------------------------


def _manual_zero_step(shape: dict[str, int]) -> list[Collective]:
    """ZeRO with explicit collectives: gather the data-sharded params, scatter their gradient.

    (On a data 2 x tensor 4 mesh XLA reshards the jitted `_zero_step` onto the idle tensor axis,
    so the proxy test spells its collectives out.)
    """
    mesh = make_mesh(shape)

    def step(w, x):  # w: [32 / data, 16 / tensor], x: [8 / data, 32]
        full = jax.lax.all_gather(w, "data", tiled=True)
        grad = jax.grad(lambda full: jnp.sum((x @ full) ** 2))(full)
        return jax.lax.psum_scatter(grad, "data", scatter_dimension=0, tiled=True)

    spec = P("data", "tensor")
    fn = jax.shard_map(step, mesh=mesh, in_specs=(spec, P("data")), out_specs=spec)
    return _compiled(fn, jnp.ones((32, 16)), jnp.ones((8, 32)))


def test_proxy_step_costs_as_the_real_data_axis():
    proxy, real = {"data": 2, "tensor": 4}, {"data": 64, "tensor": 4}
    ops = _manual_zero_step(proxy)
    assert sorted(op.kind for op in ops) == ["all-gather", "reduce-scatter"]
    assert [op.bytes for op in ops] == [32 * 4 * 4] * 2  # the full [32, 16 / tensor] buffer
    scaled = step_comm_seconds(ops, proxy, devices_per_host=8, intra=NVLINK, inter=IB,
                               scale_axes={"data": 64})
    # The same collectives written by hand on the real mesh: data groups of 64, stride 4.
    data_groups = tuple(tuple(range(t, 256, 4)) for t in range(4))
    by_hand = step_comm_seconds([dataclasses.replace(op, groups=data_groups) for op in ops], real,
                                devices_per_host=8, intra=NVLINK, inter=IB)
    assert scaled["by_kind"] == pytest.approx(by_hand["by_kind"])
    assert scaled["by_axes"] == pytest.approx(by_hand["by_axes"])
    # ... each one over data = 64 with 2 members on each of 32 hosts, which the proxy is not.
    assert hosts_spanned(("data",), real, 8) == (32, 2)
    b = 32 * 4 * 4
    over_64 = (1 / 2 * b / 400e9 + 2e-6) + (31 / 32 * (b / 2) / 50e9 + 31 * 10e-6)
    assert scaled["total"] == pytest.approx(2 * over_64)
    unscaled = step_comm_seconds(ops, proxy, devices_per_host=8, intra=NVLINK, inter=IB)
    assert unscaled["total"] == pytest.approx(2 * (1 / 2 * b / 400e9 + 2e-6))


def test_proxy_places_other_axes_on_the_real_mesh():
    # pipe peers are 4 apart on the proxy (one host) but 128 apart with data = 64.
    proxy = {"pipe": 2, "data": 2, "tensor": 2}
    pairs = ((0, 4), (4, 0), (1, 5), (5, 1), (2, 6), (6, 2), (3, 7), (7, 3))
    ops = [Collective("collective-permute", "cp", "main", 1000, 3, pairs)]
    cost = lambda **kw: step_comm_seconds(  # noqa: E731
        ops, proxy, devices_per_host=8, intra=NVLINK, inter=IB, **kw)["by_axes"]
    assert cost() == {"pipe": pytest.approx(3 * (1000 / 400e9 + 2e-6))}
    assert cost(scale_axes={"data": 64}) == {"pipe": pytest.approx(3 * (1000 / 50e9 + 10e-6))}


@pytest.mark.parametrize(
    "mesh_shape,scale_axes,match",
    [
        ({"data": 1, "tensor": 8}, {"data": 64}, r"mesh_shape\['data'\]=1"),
        ({"data": 4, "tensor": 2}, {"data": 2}, "data=2 must be >= the compiled size"),
        ({"data": 4, "tensor": 2}, {"stage": 4}, "unknown axis"),
    ],
)
def test_scale_axes_is_validated(mesh_shape, scale_axes, match):
    with pytest.raises(ValueError, match=match):
        step_comm_seconds([], mesh_shape, devices_per_host=8, intra=NVLINK, inter=IB,
                          scale_axes=scale_axes)
