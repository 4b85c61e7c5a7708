"""What a config's mesh and schedule come to before any device is touched: the degree of each mesh axis,
the tokens an MoE layer sees per device, the pipeline schedule. Validation checks them; the job builds
from them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from nestor.orchestrator.errors import ConfigError
from nestor.parallel.pipeline import Schedule
from nestor.parallel.rules import MESH_AXES, resolve_rules, split_degree

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config


def mesh_axes_key(config: Config) -> str:
    """Returns the keys of the mesh axes that split the devices (degree > 1), e.g. `mesh.data, mesh.tensor`:
    what to change when their product does not fit the devices."""
    split = [f"mesh.{axis}" for axis, size in config.mesh.ici_shape().items() if size != 1]
    return ", ".join(split or [f"mesh.{axis}" for axis in MESH_AXES])


def total_devices(config: Config) -> int | None:
    """Returns the device count the run will use, or None when it is 'all local devices'."""
    if config.cluster.devices_per_host == -1:
        return None
    return config.cluster.hosts * config.cluster.devices_per_host


def mesh_degrees(config: Config, devices: int | None = None) -> dict[str, int]:
    """Returns the total degree of each mesh axis (ici x dcn) with -1 resolved."""
    devices = devices if devices is not None else total_devices(config)
    ici = config.mesh.ici_shape()
    dcn = config.mesh.dcn_shape()
    if -1 in ici.values():
        if devices is None:
            raise ConfigError([("cluster.devices_per_host", "needed to resolve a -1 mesh axis")])
        known = math.prod(size for size in ici.values() if size != -1)
        fill = devices // math.prod(dcn.values()) // known
        ici = {axis: fill if size == -1 else size for axis, size in ici.items()}
    return {axis: ici[axis] * dcn[axis] for axis in MESH_AXES}


def microbatch_rows(config: Config, degrees: dict[str, int]) -> int:
    """Returns the rows of one micro-batch, what a layer sees at a time: the global batch split by gradient
    accumulation and, with more than one stage, by the pipeline's micro-batches."""
    t = config.train
    return t.global_batch // (t.grad_accum * (config.pipeline.microbatches if degrees["pipeline"] > 1 else 1))


def moe_tokens_per_device(config: Config, degrees: dict[str, int]) -> int:
    """Returns the tokens an MoE layer sees per device at a time: one micro-batch split over the devices of
    the `groups` rule (the batch's and a row's context devices)."""
    groups_shards = split_degree("groups", resolve_rules(config.mesh.rules), degrees)
    return microbatch_rows(config, degrees) * config.train.seq_len // groups_shards


REPEATED_SCHEDULES = ("circular", "interleaved_1f1b")  # the pipeline.schedule values that read pipeline.repeats


def schedule_for(config: Config, stages: int) -> Schedule:
    """Returns the pipeline schedule `config.pipeline` asks for over `stages` stages."""
    p = config.pipeline
    return named_schedule(p.schedule, stages, p.microbatches, p.repeats)


def named_schedule(name: str, stages: int, microbatches: int, repeats: int) -> Schedule:
    """Returns the pipeline schedule `name` (a `pipeline.schedule` value) over `stages` stages; `repeats`
    counts only for the schedules that read it."""
    return Schedule(stages, microbatches, repeats if name in REPEATED_SCHEDULES else 1,
                    one_f_one_b=name in ("1f1b", "interleaved_1f1b", "zero_bubble"), zero_bubble=name == "zero_bubble")
