import jax
import pytest

from jaxspeed.errors import ConfigError
from jaxspeed.runtime.mesh import AXES, data_parallel_size, make_mesh, resolve_axis_sizes


def test_fill_minus_one():
    assert resolve_axis_sizes({"data": -1, "tensor": 2}, 8) == {
        "pipe": 1, "data": 4, "sequence": 1, "expert": 1, "tensor": 2,
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
    assert dict(mesh.shape) == {"pipe": 1, "data": 4, "sequence": 1, "expert": 1, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert data_parallel_size(mesh) == 4
    # tensor innermost: tensor-parallel peers are adjacent devices
    assert [d.id for d in mesh.devices[0, 0, 0, 0, :]] == [0, 1]
