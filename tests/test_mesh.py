"""Mesh building: axis order, -1 filling, dcn across processes, errors naming keys."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from nestor.parallel.mesh import MESH_AXES, MeshError, _device_grid, build_mesh, resolve_shape

ONES = {axis: 1 for axis in MESH_AXES}


def test_fill_axis_takes_the_remaining_devices_and_axes_are_auto():
    mesh = build_mesh(ONES | {"data": -1, "tensor": 2})
    assert dict(mesh.shape) == {"pipeline": 1, "data": 4, "fsdp": 1, "context": 1, "expert": 1, "tensor": 2}
    assert mesh.axis_names == MESH_AXES
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_tensor_is_innermost_so_its_devices_are_neighbours():
    mesh = build_mesh(ONES | {"data": 4, "tensor": 2})
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(4, 2)
    assert (ids[:, 1] - ids[:, 0] == 1).all()


@pytest.mark.parametrize("ici, key", [
    (ONES | {"data": -1, "fsdp": -1}, "mesh.fsdp"),
    (ONES | {"data": 3}, "mesh"),
    (ONES | {"data": -1, "tensor": 3}, "mesh.data"),
])
def test_mismatches_name_the_key(ici, key):
    with pytest.raises(MeshError) as caught:
        build_mesh(ici)
    assert caught.value.key == key


def test_dcn_degree_must_divide_devices():
    with pytest.raises(MeshError) as caught:
        resolve_shape(ONES | {"data": -1}, ONES | {"data": 3}, 8)
    assert caught.value.key == "mesh.dcn"


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def test_dcn_axis_spans_processes_as_the_outer_factor():
    # 2 processes x 4 devices; data = dcn 2 x ici 2, tensor ici 2.
    devices = [FakeDevice(i, i // 4) for i in range(8)]
    grid = _device_grid(ONES | {"data": 2, "tensor": 2}, ONES | {"data": 2}, devices)
    processes = np.vectorize(lambda d: d.process_index)(grid).reshape(4, 2)
    assert grid.shape == (1, 4, 1, 1, 1, 2)
    # The first half of the data axis lives on process 0, the second on process 1.
    assert processes.tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]


def test_dcn_degree_that_does_not_divide_processes_is_an_error():
    devices = [FakeDevice(i, i // 4) for i in range(8)]
    with pytest.raises(MeshError) as caught:
        _device_grid(ONES | {"data": 1, "tensor": 2}, ONES | {"data": 4}, devices)
    assert caught.value.key == "mesh.dcn"


def test_a_subset_of_devices_builds_a_smaller_mesh():
    mesh = build_mesh(ONES | {"fsdp": -1}, devices=jax.devices()[:4])
    assert mesh.shape["fsdp"] == 4 and mesh.devices.size == 4
