"""The checks an abstract build of a run makes with no device: the model built by `nnx.eval_shape`, its
parameters laid out on a mesh of the run's shape (state.state_layout), the state held against the devices'
memory and its loss traced on abstract inputs (the task contract). A launcher runs them in the user's
process before any worker starts."""

from __future__ import annotations

from jax.sharding import AbstractMesh, AxisType

from nestor.backend import BackendError, resolve_backend
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.batches import batch_fields
from nestor.orchestrator.job.build import Job, batch_axes, check_state_fits, mesh_error, traced_use
from nestor.orchestrator.job.eval_loss import check_eval_fields
from nestor.orchestrator.job.state import state_layout
from nestor.orchestrator.job.context_wiring import ATTENTION_AXES
from nestor.orchestrator.job.step import backend_request
from nestor.parallel.context import context_degree
from nestor.parallel.mesh import MeshError, resolve_shape
from nestor.parallel.rules import MESH_AXES, resolve_rules


def abstract_mesh(config: Config) -> AbstractMesh | None:
    """Returns a mesh of the run's shape with no devices behind it (`cluster.hosts` x
    `cluster.devices_per_host`), or None where `cluster.devices_per_host=-1` leaves the count to the hosts.
    Raises ConfigError where the mesh degrees do not fit that count."""
    cluster = config.cluster
    if cluster.devices_per_host == -1:
        return None
    dcn = config.mesh.dcn_shape()
    try:
        ici = resolve_shape(config.mesh.ici_shape(), dcn, cluster.hosts * cluster.devices_per_host)
    except MeshError as error:
        raise mesh_error(config, error) from None
    return AbstractMesh(tuple(ici[axis] * dcn[axis] for axis in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))


def check_abstractly(config: Config) -> None:
    """Raises ConfigError for what a run would refuse once its workers built the model: its layout on the
    mesh (`layout_checks.layout_problems`), a train state larger than the devices' memory
    (`check_state_fits`, on CPU a host's RAM over `cluster.devices_per_host`) and a loss that breaks the
    task contract; the user's code's own exceptions pass through (the CLI shows them with their frames).
    Nothing is allocated or compiled and no device is touched."""
    mesh = abstract_mesh(config)
    if mesh is None:
        return
    rules = resolve_rules(config.mesh.rules)
    fields = batch_fields(config)
    check_eval_fields(config, fields)
    layout = state_layout(config, mesh, rules, batch_axes(fields))
    try:  # the choices of a compile on CPU: the plain op in place of any kernel (Backend.compiled_here)
        backend = resolve_backend(backend_request(config), "cpu", None, None,
                                  context_degree(mesh, rules, ATTENTION_AXES))
    except BackendError:  # a kernel for devices the driver cannot judge (a GPU of unknown kind): the workers do
        return
    check_state_fits(config, backend, layout, config.cluster.devices_per_host)
    traced_use(Job(config, mesh, rules, backend, layout, step_fn=None, data=None))
