"""`plan`'s bytes across hosts: the collectives whose device groups span the two-level mesh's
hosts, read from the compiled step (one process emulating 2 hosts x 4 devices)."""

import functools

import jax
import numpy as np
from test_onebit_engine import TINY

import jaxspeed as js
from jaxspeed.cost.cross_host import cross_host_bytes
from jaxspeed.cost.hlo import collectives
from jaxspeed.cost.plan_table import format_profile
from jaxspeed.runtime.mesh import host_of_devices


@functools.cache
def profile(*extra):
    engine = js.initialize(js.load_config(None, overrides=[*TINY, *extra]))
    return engine, engine.profile()


def test_one_host_moves_nothing_across_hosts():
    _, p = profile()
    assert p["collective_bytes"]["total"] > 0 and p["cross_host_bytes"]["total"] == 0
    assert not any("across hosts" in line for line in format_profile(p))


def test_tensor_parallel_stays_inside_the_host():
    """host 2 x data 2 x tensor 2: the tensor all-reduces run inside a host, the gradient
    all-reduce over host x data crosses; every counted collective spans both hosts."""
    engine, p = profile("mesh.hosts=2", "mesh.tensor=2", "mesh.data=4")
    assert dict(engine.mesh.shape)["host"] == 2
    across, total = p["cross_host_bytes"], p["collective_bytes"]
    assert 0 < across["total"] < total["total"]
    hosts = host_of_devices(engine.mesh)
    assert hosts == [0] * 4 + [1] * 4
    text = engine.compile_train_step().as_text()
    spanning = [op for op in collectives(text, num_devices=8)
                if any(len({hosts[d] for d in g}) > 1 for g in op.groups)]
    assert sum(op.bytes * op.executions for op in spanning) == across["total"]
    inside = [op for op in collectives(text, num_devices=8) if op not in spanning]
    assert inside and all(len({hosts[d] for d in g}) == 1 for op in inside for g in op.groups)
    assert any("across hosts" in line for line in format_profile(p))


def test_every_host_alone_counts_nothing():
    _, p = profile("mesh.hosts=2")
    engine, _ = profile("mesh.hosts=2")
    text = engine.compile_train_step().as_text()
    assert cross_host_bytes(text, num_devices=8, host_of=[0] * 8)["total"] == 0
    assert p["cross_host_bytes"] == p["collective_bytes"]  # data parallel over both hosts
    np.testing.assert_array_equal(
        host_of_devices(engine.mesh), np.repeat([0, 1], 4))
    assert jax.device_count() == 8
