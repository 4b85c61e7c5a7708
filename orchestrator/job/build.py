"""A training job assembled from a config: its devices, mesh, rules, backend, state layout, compiled-to-be
step, data and evaluation. Training (orchestrator.loop.train), explain and the eval commands start from it."""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh

from nestor.backend import ACCELERATORS, Backend, BackendError, platform_family
from nestor.backend.targets import TargetDevices, target_devices
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.batches import DataPipeline, Field, abstract, batch_fields
from nestor.orchestrator.config.degrees import mesh_axes_key
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.eval_loss import Evaluator, check_eval_fields
from nestor.orchestrator.loader.memory_fit import state_problems
from nestor.orchestrator.job.state import StateLayout, param_table, per_device_bytes, state_layout
from nestor.models import axes, ops
from nestor.orchestrator.job.step import (backend_for, make_loss_fn, make_train_step, objective_of,
                                          stack_runners)
from nestor.parallel.mesh import MeshError, build_mesh
from nestor.parallel.rules import Rules, resolve_rules


def select_devices(config: Config) -> list[jax.Device]:
    """Returns the devices the run uses: `cluster.devices_per_host` of each process's devices.

    A single process standing in for `cluster.hosts` hosts (explain, the
    in-process launcher) takes the devices of all of them. Raises ConfigError
    when `cluster.accelerator` names GPUs or TPUs and jax has other devices, or
    when a process has fewer devices than asked for.
    """
    accelerator, platform = config.cluster.accelerator, platform_family(jax.devices()[0].platform)
    if accelerator in ACCELERATORS and platform != accelerator:
        raise ConfigError([("cluster.accelerator", f"{accelerator}, but jax here has {platform} devices only; set "
                                                   f"cluster.accelerator={platform}, or install jax for {accelerator}s "
                                                   "(docs/cluster.md)")])
    wanted = config.cluster.devices_per_host
    if wanted != -1 and jax.process_count() == 1:
        wanted *= config.cluster.hosts
    by_process: dict[int, list[jax.Device]] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    selected = []
    for process, devices in sorted(by_process.items()):
        if wanted != -1 and len(devices) < wanted:
            raise ConfigError([("cluster.devices_per_host",
                                f"asks for {wanted} devices but process {process} has {len(devices)} "
                                f"({devices[0].platform}); lower it or use -1 for all")])
        selected += devices if wanted == -1 else devices[:wanted]
    return selected


def compile_target(config: Config, present: str | None = None) -> TargetDevices:
    """Returns the devices a compile-only command (explain, its fit check) compiles `config` for and the
    compiler's name: the deviceless topology of the target `cluster.device_kind` names, `cluster.hosts` x
    `cluster.devices_per_host` devices, where its compiler is installed (backend.targets), else None (the
    devices present, `select_devices`). `present`: the platform family taken as this process's devices
    (default: jax's, which opens them). Raises ConfigError for a TPU slice libtpu does not know."""
    cluster = config.cluster
    try:
        return target_devices(cluster.device_kind, present or platform_family(jax.devices()[0].platform),
                              cluster.hosts, cluster.devices_per_host, math.prod(config.mesh.dcn_shape().values()))
    except BackendError as error:
        raise ConfigError([(error.key, error.message)]) from None


def make_mesh(config: Config, devices: list[jax.Device] | None = None) -> Mesh:
    """Returns the run's mesh; a degree that does not fit the devices raises ConfigError."""
    try:
        return build_mesh(config.mesh.ici_shape(), config.mesh.dcn_shape(),
                          devices if devices is not None else select_devices(config))
    except MeshError as error:
        raise mesh_error(config, error) from None


def mesh_error(config: Config, error: MeshError) -> ConfigError:
    """Returns the ConfigError of mesh degrees that do not fit the devices, naming the key to change."""
    key = mesh_axes_key(config) if error.key == "mesh" else error.key
    return ConfigError([(key, str(error).split(": ", 1)[1] + " (or change cluster.devices_per_host)")])


def batch_axes(fields: dict[str, Field]) -> frozenset[str]:
    """Returns the logical names the batch's `fields` give their dimensions."""
    return frozenset(name for field in fields.values() for name in field.logical_axes if name)


def devices_here(mesh: Mesh) -> int:
    """Returns how many of `mesh`'s devices this process holds: on CPU, the devices that share its RAM."""
    return sum(device.process_index == jax.process_index() for device in mesh.devices.flat)


def check_state_fits(config: Config, backend: Backend, layout: StateLayout, devices_here: int) -> None:
    """Raises ConfigError naming the key that sizes the largest parameter when the train state alone, as
    `layout` shards it, needs more than a device's memory (memory_fit.state_problems; on CPU the host's RAM
    over the `devices_here` devices of a process), before any of it is allocated."""
    params = param_table(layout)
    state_bytes = sum(per_device_bytes(leaf) for leaf in jax.tree.leaves(layout.abstract))
    largest = max(params, key=lambda row: row["bytes_total"])
    if problems := state_problems(config, backend, state_bytes, largest, devices_here):
        raise ConfigError(problems)


@dataclasses.dataclass
class Job:
    """A compiled-to-be training job: mesh, rules, state layout, step function, data, evaluation."""

    config: Config
    mesh: Mesh
    rules: Rules
    backend: Backend
    layout: StateLayout
    step_fn: object
    data: DataPipeline | None  # None when built without data (explain)
    evaluator: Evaluator | None = None  # with eval.every and data only


def build_job(config: Config, devices: list[jax.Device] | None = None, with_data: bool = True) -> Job:
    """Returns the job for `config` on `devices` (default: `select_devices`), nothing compiled yet.

    `with_data=False` leaves the data sources unopened (no file listed, no tokenizer loaded), for a
    job that is only compiled; with data and `eval.every`, the job has its evaluator.
    """
    mesh = make_mesh(config, devices)
    rules = resolve_rules(config.mesh.rules)
    backend = backend_for(config, mesh)
    fields = batch_fields(config)
    check_eval_fields(config, fields)
    layout = state_layout(config, mesh, rules, batch_axes(fields))
    if with_data:  # a job that runs allocates its state: refused here, before anything is, if it cannot fit
        check_state_fits(config, backend, layout, devices_here(mesh))
    step_fn = make_train_step(config, layout, mesh, rules, backend, fields)
    data = DataPipeline(config, mesh, rules, fields=fields) if with_data else None
    evaluator = Evaluator(config, layout, mesh, rules, backend) if with_data and config.eval.every else None
    return Job(config, mesh, rules, backend, layout, step_fn, data, evaluator)


def abstract_batch(job: Job) -> dict[str, jax.ShapeDtypeStruct]:
    """Returns the shapes, dtypes and shardings of one global batch: what the step compiles for, no data read."""
    return abstract(batch_fields(job.config), job.mesh, job.rules)


def traced_use(job: Job) -> tuple[set[str], set[str]]:
    """Returns (the ops (models.ops) the model's forward pass calls, the logical axes its activations name
    and models.axes.LAYOUT_READ where it reads the sequence layout), from one abstract trace of its loss."""
    loss_fn = make_loss_fn(job.layout, job.mesh, job.rules, job.backend,
                           stack_runners(job.config, job.mesh, job.rules, job.backend), objective=objective_of(job.config))
    state = job.layout.abstract
    seed = job.config.run.seed  # a training trace has a key (random routing, a user's dropout), made inside it
    with ops.recording() as called, axes.recording() as named:  # a fresh function: traced anew, never cached
        jax.eval_shape(lambda params, batch, bias: loss_fn(params, batch, jax.random.key(seed), bias),
                       state["params"], abstract_batch(job), state.get("expert_bias"))
    return called, named


def unsplit_rows_warning(job: Job, named: set[str]) -> str | None:
    """Returns a warning where mesh.context splits rows but the model (its activations `named`, `traced_use`)
    neither names the `length` axis nor reads the sequence layout: its context devices compute replicas."""
    if job.mesh.shape.get("context", 1) == 1 or named & {axes.LENGTH, axes.LAYOUT_READ}:
        return None
    return (f"warning: mesh.context={job.mesh.shape['context']} splits the `{axes.LENGTH}` axis of rows, but "
            f"model.class {job.config.model.class_} names no activation `{axes.LENGTH}` and reads no positions "
            "(models.axes.sequence_layout): its context devices compute the same thing; set mesh.context=1, or "
            "name the sequence axis of its activations (docs/models.md, 'Rows split over context devices')")
