"""The candidates of a plan: every way to lay a run's fixed global batch over the target's devices that the
user has not pinned, as dotted settings a config takes. A layout (mesh degrees within and across hosts,
pipeline schedule and micro-batches) has a ladder of rungs from the least recompute and communication to the least memory
(remat, then the sharded update, then gradient accumulation); the search tries a layout's rungs in order."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING, Any

from nestor.orchestrator.config.degrees import total_devices
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.specs.lm import LM
from nestor.parallel.rules import MESH_AXES

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config

OUTER_AXES = ("pipeline", "data", "fsdp", "context", "expert")  # the axes that may cross hosts (mesh.dcn.*)
SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES_PER_STAGE = (1, 2, 4)
REMAT = ("none", "dots", "full")  # fewest recomputed FLOPs first
GRAD_ACCUM = (1, 2, 4)
LADDER_KEYS = ("model.remat", "optimizer.shard_update", "train.grad_accum")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One candidate: its settings (dotted key -> value), the layout it is a rung of, its rung's index."""

    settings: tuple[tuple[str, Any], ...]
    layout: tuple[tuple[str, Any], ...]
    rung: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.settings)


def pinned_keys(overrides: list[str]) -> set[str]:
    """Returns the dotted keys the command line pins (its KEY=VALUE items; a -1 mesh degree pins nothing)."""
    pins = set()
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and not (key.strip().startswith("mesh.") and value.strip() == "-1"):
            pins.add(key.strip())
    return pins


def free_mesh(overrides: list[str]) -> list[str]:
    """Returns the overrides a plan loads CONFIG with before the user's: every mesh degree the command line
    does not pin reset to 1 (across hosts too) and one of them to -1, so that a config written for other
    devices loads for the target the plan is for."""
    pins = pinned_keys(overrides)
    free = [f"mesh.{axis}" for axis in MESH_AXES if f"mesh.{axis}" not in pins]
    free += [f"mesh.dcn.{axis}" for axis in MESH_AXES if f"mesh.dcn.{axis}" not in pins]
    fill = next((key for key in ("mesh.data", "mesh.fsdp", "mesh.pipeline", "mesh.context", "mesh.expert",
                                 "mesh.tensor") if key in free), None)
    return [f"{key}={-1 if key == fill else 1}" for key in free]


def load_for_plan(path: str | None, overrides: list[str]) -> Config:
    """Loads CONFIG as `nestor plan` searches it: its mesh free (`free_mesh`), and without the checks that
    need the device count, which each candidate's own layout answers."""
    from nestor.orchestrator.loader.config import load

    return load(path, free_mesh(overrides) + overrides, device_checks=False)


def searched_keys(config: Config, pins: set[str]) -> set[str]:
    """Returns the dotted keys a plan sets for the user (the mesh, the pipeline's schedule and micro-batches
    unless a pin leaves one stage, the ladder's keys), less the `pins`."""
    keys = {f"mesh.{axis}" for axis in MESH_AXES} | {f"mesh.dcn.{axis}" for axis in MESH_AXES} | set(LADDER_KEYS)
    if not ("mesh.pipeline" in pins and config.mesh.ici_shape()["pipeline"] * config.mesh.dcn_shape()["pipeline"] == 1):
        keys |= {"pipeline.schedule", "pipeline.microbatches"}
    return keys - pins


def _factorizations(n: int, slots: int):
    """Yields every tuple of `slots` positive integers whose product is `n`."""
    if slots == 1:
        yield (n,)
        return
    for first in (d for d in range(1, n + 1) if n % d == 0):
        for rest in _factorizations(n // first, slots - 1):
            yield (first, *rest)


def searched_axes(config: Config) -> tuple[str, ...]:
    """Returns the mesh axes a plan splits: expert only for a model with MoE layers, context only for nestor's
    LM (a model that reads the sequence layout; a user's model is not searched over context)."""
    return tuple(axis for axis in MESH_AXES if not (axis == "expert" and not config.moe_layers)
                 and not (axis == "context" and config.model.class_ != LM))


def mesh_degrees(config: Config, pins: set[str]) -> list[dict[str, int]]:
    """Returns every total degree per mesh axis (ici x dcn) over the target's devices that keeps the pinned
    degrees, with tensor parallelism within a host (its degree divides cluster.devices_per_host)."""
    devices, per_host = total_devices(config), config.cluster.devices_per_host
    if devices is None:
        raise ConfigError([("cluster.devices_per_host", "-1 (all the devices present): a plan needs the target's "
                                                        "count; name how many devices each host has")])
    ici, dcn = config.mesh.ici_shape(), config.mesh.dcn_shape()
    fixed = {axis: ici[axis] * dcn[axis] for axis in MESH_AXES if f"mesh.{axis}" in pins}
    free = [axis for axis in searched_axes(config) if axis not in fixed]
    rest = devices // math.prod(fixed.values())
    if devices % math.prod(fixed.values()):
        return []
    found = []
    for degrees in _factorizations(rest, len(free)) if free else [()]:
        total = {axis: 1 for axis in MESH_AXES} | fixed | dict(zip(free, degrees))
        if math.prod(total.values()) == devices and per_host % total["tensor"] == 0:
            found.append(total)
    return found


def split_over_hosts(config: Config, total: dict[str, int], pins: set[str]) -> tuple[dict, dict] | None:
    """Returns (ici, dcn) degrees for `total`: the hosts' factor taken by the outermost axes first (an axis
    whose degree or dcn degree is pinned keeps the config's dcn degree), or None when the axes cannot take it."""
    hosts = config.cluster.hosts
    kept = {axis for axis in MESH_AXES if f"mesh.{axis}" in pins or f"mesh.dcn.{axis}" in pins}
    dcn = {axis: config.mesh.dcn_shape()[axis] if axis in kept else 1 for axis in MESH_AXES}
    left = hosts // math.prod(dcn.values()) if hosts % math.prod(dcn.values()) == 0 else 0
    for axis in OUTER_AXES:
        if axis not in kept and left > 1:
            dcn[axis] = math.gcd(total[axis], left)
            left //= dcn[axis]
    if left != 1 or any(total[axis] % dcn[axis] for axis in MESH_AXES):
        return None
    return {axis: total[axis] // dcn[axis] for axis in MESH_AXES}, dcn


def _choices(config: Config, key: str, options: tuple, pins: set[str]) -> tuple:
    """Returns `options` for a searched key, or the config's value alone where the user pinned it."""
    if key in pins:
        section, name = key.split(".")
        return (getattr(getattr(config, section), name),)
    return options


def layouts(config: Config, pins: set[str]) -> list[dict[str, Any]]:
    """Returns the layouts of a plan: mesh degrees within and across hosts and, with several stages, the
    pipeline schedule and micro-batches (1, 2 or 4 per stage), as dotted settings."""
    found = []
    for total in mesh_degrees(config, pins):
        split = split_over_hosts(config, total, pins)
        if split is None:
            continue
        ici, dcn = split
        mesh = {f"mesh.{axis}": ici[axis] for axis in MESH_AXES} | {f"mesh.dcn.{axis}": dcn[axis] for axis in MESH_AXES}
        stages = total["pipeline"]
        if stages == 1:
            found.append(mesh)
            continue
        schedules = _choices(config, "pipeline.schedule", SCHEDULES, pins)
        microbatches = _choices(config, "pipeline.microbatches", tuple(stages * m for m in MICROBATCHES_PER_STAGE),
                                pins)
        found += [mesh | {"pipeline.schedule": s, "pipeline.microbatches": m}
                  for s, m in itertools.product(schedules, microbatches)]
    return found


def ladder(config: Config, layout: dict[str, Any], pins: set[str]) -> list[dict[str, Any]]:
    """Returns the rungs of `layout`, least recompute and accumulation first, each later one lighter on memory:
    remat none, dots, full (the config's own policy alone where it sets model.remat_names); then the update
    sharded over the batch's devices (where they split it); then gradient accumulation 2 and 4."""
    batch_devices = math.prod(layout[f"mesh.{axis}"] * layout[f"mesh.dcn.{axis}"] for axis in ("data", "fsdp", "expert"))
    # model.remat_names only mean something to the config's own named policy (minimal, offload): it is kept
    remat = (config.model.remat,) if config.model.remat_names else _choices(config, "model.remat", REMAT, pins)
    shard = _choices(config, "optimizer.shard_update", (False, True) if batch_devices > 1 else (False,), pins)
    accum = _choices(config, "train.grad_accum", GRAD_ACCUM, pins)
    return [{"model.remat": r, "optimizer.shard_update": s, "train.grad_accum": a}
            for a, s, r in itertools.product(accum, shard, remat)]


def candidates(config: Config, pins: set[str]) -> list[list[Candidate]]:
    """Returns every layout's ladder of candidates (see `layouts`, `ladder`)."""
    found = []
    for layout in layouts(config, pins):
        key = tuple(layout.items())
        found.append([Candidate(tuple((layout | rung).items()), key, index)
                      for index, rung in enumerate(ladder(config, layout, pins))])
    return found


def rule_problem(config: Config, settings: dict[str, Any]) -> tuple[Config | None, str | None]:
    """Returns (the candidate's validated config, None), or (None, the first problem the config's rules find:
    `key: message`)."""
    try:
        return config.replace(**settings), None
    except ConfigError as error:
        key, message = error.problems[0]
        return None, f"{key}: {message}"
