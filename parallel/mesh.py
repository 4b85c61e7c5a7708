"""Mesh config -> `jax.sharding.Mesh` over pipeline, data, fsdp, context, expert, tensor.

Axes are ordered outermost to innermost so that tensor parallelism, which
communicates every layer, lands on neighbouring devices, and the dcn degrees
(slices or host groups, slow links) are the outer factor of each axis, as in
`mesh_utils.create_hybrid_device_mesh`. All axes are `AxisType.Auto`, so the
GSPMD partitioner places whatever the annotations leave open.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from nestor.parallel.rules import MESH_AXES


class MeshError(ValueError):
    """The mesh degrees do not fit the devices; `key` is the config key to fix."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


def resolve_shape(ici: Mapping[str, int], dcn: Mapping[str, int], device_count: int) -> dict[str, int]:
    """Returns the per-slice degrees with the one -1 filled.

    Raises MeshError when two axes are -1, when the dcn degrees do not divide
    the device count, or when the degrees do not multiply to the devices per slice.
    """
    fills = [axis for axis in MESH_AXES if ici[axis] == -1]
    if len(fills) > 1:
        raise MeshError(f"mesh.{fills[1]}", f"only one axis may be -1, got {', '.join('mesh.' + a for a in fills)}")
    slices = math.prod(dcn[axis] for axis in MESH_AXES)
    if device_count % slices:
        raise MeshError("mesh.dcn", f"dcn degrees multiply to {slices}, which does not divide {device_count} devices")
    per_slice = device_count // slices
    known = math.prod(ici[axis] for axis in MESH_AXES if ici[axis] != -1)
    shape = dict(ici)
    if fills:
        if per_slice % known:
            raise MeshError(f"mesh.{fills[0]}", f"the other axes multiply to {known}, which does not divide {per_slice} devices per slice")
        shape[fills[0]] = per_slice // known
    elif known != per_slice:
        raise MeshError("mesh", f"axes multiply to {known}, but there are {per_slice} devices per slice "
                                f"({device_count} devices / {slices} slices); set one axis to -1 or fix the degrees")
    return shape


def _granules(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
    """Groups devices by slice (multi-slice pods) or else by process: the units joined by dcn."""
    # Devices of one slice, or without slices, report slice_index 0 everywhere; then processes are the units.
    slices = {getattr(d, "slice_index", 0) for d in devices}
    key = (lambda d: d.slice_index) if len(slices) > 1 else (lambda d: d.process_index)
    groups: dict[int, list[jax.Device]] = {}
    for device in sorted(devices, key=lambda d: (key(d), d.id)):
        groups.setdefault(key(device), []).append(device)
    return [groups[k] for k in sorted(groups)]


def _device_grid(ici: dict[str, int], dcn: dict[str, int], devices: Sequence[jax.Device]) -> np.ndarray:
    ici_shape = [ici[axis] for axis in MESH_AXES]
    dcn_shape = [dcn[axis] for axis in MESH_AXES]
    slices = math.prod(dcn_shape)
    if slices == 1:
        return mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
    granules = _granules(devices)
    if len(granules) == 1:
        # One process standing in for several hosts or slices (`nestor explain` of a multi-host
        # config, tests): its devices are split into equal simulated granules.
        size = len(devices) // slices
        granules = [granules[0][i * size:(i + 1) * size] for i in range(slices)]
    if len(granules) % slices:
        raise MeshError("mesh.dcn", f"dcn degrees multiply to {slices}, which does not divide the {len(granules)} "
                                    "processes or slices")
    per_group = len(granules) // slices
    groups = [sum(granules[i * per_group:(i + 1) * per_group], []) for i in range(slices)]
    blocks = np.stack([mesh_utils.create_device_mesh(ici_shape, group, allow_split_physical_axes=True)
                       for group in groups])
    # [slices, *ici] -> [*dcn, *ici] -> interleave (dcn_i, ici_i) -> [dcn_i * ici_i ...]
    blocks = blocks.reshape(dcn_shape + ici_shape)
    n = len(MESH_AXES)
    order = [i for axis in range(n) for i in (axis, n + axis)]
    return blocks.transpose(order).reshape([d * i for d, i in zip(dcn_shape, ici_shape)])


def build_mesh(ici: Mapping[str, int], dcn: Mapping[str, int] | None = None,
               devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Returns a Mesh with axes (pipeline, data, fsdp, context, expert, tensor), all AxisType.Auto.

    `ici` holds per-slice degrees (one may be -1), `dcn` the across-slice
    degrees (default all 1). `devices` defaults to every device of every
    process. Raises MeshError naming the config key when the degrees do not fit.
    """
    devices = list(devices if devices is not None else jax.devices())
    dcn = {axis: 1 for axis in MESH_AXES} | dict(dcn or {})
    ici = resolve_shape(dict(ici), dcn, len(devices))
    grid = _device_grid(ici, dcn, devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))

