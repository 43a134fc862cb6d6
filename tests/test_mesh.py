"""The device mesh: sizes, `-1` fill, the two-level `host` x `data` split, device order."""

import functools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxspeed as js
from jaxspeed.config.schema import MeshConfig
from jaxspeed.data import TokenDataset
from jaxspeed.errors import ConfigError
from jaxspeed.runtime.mesh import (
    AXES,
    config_axis_sizes,
    cross_host_axes,
    data_parallel_size,
    host_major,
    intra_host_axes,
    make_mesh,
    resolve_axis_sizes,
    resolve_hosts,
)
from numerics import assert_adam_params_close, program_rtol
from children import child_env

ROOT = Path(__file__).resolve().parents[1]


def test_fill_minus_one():
    assert resolve_axis_sizes({"data": -1, "tensor": 2}, 8) == {
        "host": 1, "pipe": 1, "data": 4, "sequence": 1, "expert": 1, "tensor": 2,
    }


@pytest.mark.parametrize(
    "sizes, match",
    [
        ({"data": 3}, "product of axis sizes"),
        ({"data": -1, "tensor": 3}, "not divisible"),
        ({"data": -1, "tensor": -1}, "at most one axis"),
        ({"data": 0}, "positive or -1"),
        ({"date": 8}, "unknown axis"),
    ],
)
def test_bad_mesh(sizes, match):
    with pytest.raises(ConfigError, match=match):
        resolve_axis_sizes(sizes, 8)


def test_make_mesh_axes_and_types():
    mesh = make_mesh({"data": 4, "tensor": 2})
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {
        "host": 1, "pipe": 1, "data": 4, "sequence": 1, "expert": 1, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert data_parallel_size(mesh) == 4
    assert cross_host_axes(mesh) == () and intra_host_axes(mesh) == ("data", "tensor")
    # tensor innermost: tensor-parallel peers are adjacent devices
    assert [d.id for d in mesh.devices[0, 0, 0, 0, 0, :]] == [0, 1]


@pytest.mark.parametrize("sizes, processes, want", [
    ({"data": 8, "hosts": 2}, 1, (2, 4)),             # one process emulates 2 hosts
    ({"data": -1, "tensor": 2, "hosts": 4}, 1, (4, 1)),  # -1 filled first, then split
    ({"data": 4, "tensor": 2}, 2, (2, 2)),            # auto: one host per process
    ({"data": 4, "tensor": 2, "hosts": "auto"}, 3, (1, 4)),  # auto: 3 does not divide 4
    ({"data": 8}, 1, (1, 8)),
    ({"data": 4, "tensor": 2, "hosts": 1}, 2, (1, 4)),  # explicit 1 on 2 processes
])
def test_hosts_split_the_total_data_degree(sizes, processes, want):
    resolved = config_axis_sizes(sizes, 8, processes)
    assert (resolved["host"], resolved["data"]) == want
    assert list(resolved) == list(AXES)


@pytest.mark.parametrize("sizes, match", [
    ({"data": 8, "hosts": 3}, r"mesh.hosts=3 must divide mesh.data=8"),
    ({"data": -1, "tensor": 2, "hosts": 8}, r"mesh.hosts=8 must divide mesh.data=4"),
    ({"data": 8, "hosts": 0}, r"mesh.hosts: expected 'auto' or an int >= 1, got 0"),
    ({"data": 4, "host": 2}, r"'host' is not a config key; set mesh.hosts"),
    ({"date": 8}, r"accepted keys are \['hosts', 'pipe', 'data'"),
])
def test_bad_hosts(sizes, match):
    with pytest.raises(ConfigError, match=match):
        config_axis_sizes(sizes, 8, 1)


def test_auto_needs_more_than_one_process():
    assert resolve_hosts("auto", 8, 1) == 1
    assert resolve_hosts("auto", 8, 4) == 4


@pytest.mark.parametrize("override, match", [
    ("mesh.hosts=3", r"^invalid override 'mesh.hosts=3': mesh: hosts=3 must divide data=8"),
    ("mesh.hosts=0", r"mesh.hosts: expected 'auto' or an int >= 1, got 0$"),
    ("mesh.hosts=true", r"mesh.hosts: expected 'auto' or an int >= 1, got True$"),
    ("mesh.hosts=two", r"mesh.hosts: expected 'auto' or an int >= 1, got 'two'$"),
])
def test_hosts_config_errors_are_one_line(override, match):
    with pytest.raises(ConfigError, match=match) as err:
        js.load_config(None, overrides=["mesh.data=8", override])
    assert "\n" not in str(err.value)


def test_hosts_is_a_config_key_not_an_axis_size():
    cfg = js.load_config(None, overrides=["mesh.data=8", "mesh.hosts=2"])
    assert cfg.mesh.hosts == 2 and MeshConfig().hosts == "auto"
    assert cfg.mesh.axis_sizes() == {"pipe": 1, "data": 8, "sequence": 1, "expert": 1, "tensor": 1}


def test_emulated_hosts_are_host_major():
    mesh = make_mesh(MeshConfig(hosts=2, data=4, tensor=2))
    assert dict(mesh.shape) == {
        "host": 2, "pipe": 1, "data": 2, "sequence": 1, "expert": 1, "tensor": 2}
    assert data_parallel_size(mesh) == 4
    assert cross_host_axes(mesh) == ("host",)
    assert intra_host_axes(mesh) == ("data", "tensor")
    # host h holds devices [4h, 4h + 4): each host one contiguous block
    for h in range(2):
        assert sorted(d.id for d in mesh.devices[h].flat) == list(range(4 * h, 4 * h + 4))
    # a mesh's own shape (naming `host`) rebuilds the same mesh
    again = make_mesh(dict(mesh.shape))
    assert again.devices.tolist() == mesh.devices.tolist()


def test_devices_are_grouped_by_process():
    fake = [SimpleNamespace(id=i, process_index=p) for i, p in enumerate([1, 0, 1, 0])]
    assert [d.id for d in host_major(fake)] == [1, 3, 0, 2]


def test_batch_is_host_major_and_zero_is_data_major():
    mesh = make_mesh(MeshConfig(hosts=2, data=8))
    plan = js.plan_sharding({"w": np.zeros((16, 4), np.float32)}, {"w": ("embed", "mlp")},
                            mesh, stage=3)
    assert plan.batch_sharding(2).spec == P(("host", "data"), None)
    assert plan.leaves["w"].param == P(("data", "host"), None)
    assert "hosts x" in plan.explain().splitlines()[0]
    one = make_mesh(MeshConfig(data=8))  # one host: the axis is left out of specs and explain
    plan = js.plan_sharding({"w": np.zeros((16, 4), np.float32)}, {"w": ("embed", "mlp")},
                            one, stage=3)
    assert plan.batch_sharding(2).spec == P("data", None)
    assert plan.explain().startswith("mesh: pipe=1, data=8,")


INIT = nn.initializers.normal(stddev=0.02)


class TinyLM(nn.Module):
    """Bytes -> logits `[batch, length, 256]`: an embedding, one residual MLP and a head, its
    dimensions named like the GPT's. Splitting the data-parallel degree over hosts concerns
    the mesh, the plan and the step, not the model; this one's steps compile several times
    faster than the tiny GPT's."""

    @nn.compact
    def __call__(self, tokens):
        def weight(name, shape, names):
            return self.param(name, nn.with_logical_partitioning(INIT, names), shape)

        x = weight("embedding", (256, 32), ("vocab", "embed"))[tokens]
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        hidden = nn.gelu(x @ weight("mlp_in", (32, 64), ("embed", "mlp")))
        x = x + hidden @ weight("mlp_out", (64, 32), ("mlp", "embed"))
        return x @ weight("head", (32, 256), ("embed", "vocab"))


TINY = [
    "data.seq_len=16", "data.max_bytes=200000", "train_batch_size=16",
    "optimizer.params.lr=0.003", "mesh.data=8",
]
STEPS, LR = 3, 0.003
#: The same math on the same devices, the rows of a step reduced in another order
#: (tests/numerics.py): sums of up to 16 x 16 tokens; forward the embedding's gradient sum,
#: the MLP's two matmuls, the head and the loss, and two more products each backward.
RHO = program_rtol(width=16 * 16, depth=3 * 5)


@functools.cache
def _engine(*overrides):
    return js.initialize(js.load_config(None, overrides=[*TINY, *overrides]), model=TinyLM())


@functools.cache
def _initial_params():
    """One host's ZeRO-0 init, on the host: the runs that do not init on their own start from
    it (an init program less each)."""
    engine = _engine("zero_optimization.stage=0", "mesh.hosts=1")
    return jax.device_get(engine.init(jax.random.key(0)).params)


@functools.cache
def _train(*overrides, own_init=False):
    engine = _engine(*overrides)
    data = TokenDataset.from_config(engine.config.data, seed=0)
    params = None if own_init else _initial_params()
    state, losses = engine.init(jax.random.key(0), params=params), []
    for step in range(STEPS):
        state, metrics = engine.train_step(state, data.batch(step, global_batch=16))
        losses.append(float(metrics["loss"]))
    return engine, state, np.array(losses)


@pytest.mark.parametrize("case", [
    ["zero_optimization.stage=0"],
    ["zero_optimization.stage=3"],
    ["optimizer.type=OneBitAdam", "optimizer.params={lr: 0.003, freeze_step: 1}"],
])
def test_two_emulated_hosts_train_as_one(case):
    # One host's ZeRO-0 run is both ZeRO stages' reference (ZeRO-3 is the same math, reduced
    # in another order); ZeRO-3 on two hosts inits on its own (params split over data x host),
    # which must equal one host's init.
    zero = case[0].startswith("zero_optimization")
    reference = ("zero_optimization.stage=0",) if zero else tuple(case)
    _, want, want_losses = _train(*reference, "mesh.hosts=1")
    own_init = case == ["zero_optimization.stage=3"]
    engine, got, losses = _train(*case, "mesh.hosts=2", own_init=own_init)
    assert dict(engine.mesh.shape)["host"] == 2
    assert engine.onebit_axes in (None, ("host", "data", "expert"))
    np.testing.assert_allclose(losses, want_losses, rtol=RHO)
    assert_adam_params_close(got.params, want.params, steps=STEPS, lr=LR, rho=RHO)


def test_two_processes_make_two_hosts(tmp_path, monkeypatch):
    """`--set mesh.data=4` on 2 processes x 2 devices: host=2 x data=2, host index = process."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("XLA_FLAGS", child_env()["XLA_FLAGS"])  # fast compiles, no device count
    child = tmp_path / "mesh_child.py"
    child.write_text(
        "import json, sys\n"
        "from jaxspeed.runtime import distributed\n"
        "distributed.initialize()\n"
        "import jaxspeed as js\n"
        "mesh = js.make_mesh(js.load_config(None, overrides=sys.argv[1:]).mesh)\n"
        "print(json.dumps({'shape': dict(mesh.shape),\n"
        "                  'process': [sorted({d.process_index for d in m.flat}) for m in mesh.devices]}))\n"
    )
    cli = [sys.executable, "-m", "jaxspeed.cli"]
    proc = subprocess.run(
        [*cli, "launch", "--nproc", "2", "--cpu-devices", "2", "--timeout", "120", "--",
         sys.executable, str(child), "mesh.data=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    outs = [json.loads(line.split("] ", 1)[1]) for line in proc.stdout.splitlines()
            if line.startswith("[rank ")]
    assert len(outs) == 2
    for out in outs:
        assert out["shape"] == {"host": 2, "pipe": 1, "data": 2, "sequence": 1, "expert": 1,
                                "tensor": 1}
        assert out["process"] == [[0], [1]]
