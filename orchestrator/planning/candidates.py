"""The candidates of a plan: every way to lay a run's fixed global batch over the target's devices that the
user has not pinned, as dotted settings a config takes. A layout (mesh degrees within and across hosts; with
stages, the pipeline's schedule, layer groups per stage and micro-batches; with a split row, how attention
crosses it; with expert devices, how dropless tokens reach them) has a ladder of rungs from the least
recompute and communication to the least memory (remat, then the sharded update, then gradient
accumulation); the search tries a layout's rungs in order."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING, Any

from nestor.orchestrator.config.degrees import REPEATED_SCHEDULES, total_devices
from nestor.orchestrator.config.schema import CONTEXT_STRATEGIES, EXCHANGE_CHOICES
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.specs.lm import LM
from nestor.parallel.rules import MESH_AXES

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config

OUTER_AXES = ("pipeline", "data", "fsdp", "context", "expert")  # the axes that may cross hosts (mesh.dcn.*)
SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "circular", "interleaved_1f1b")
REPEATS = (1, 2)  # layer groups per stage: 1 for the others, 2 for the repeated ones (a pin keeps its own)
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


def _given(overrides: list[str]) -> dict[str, str]:
    """Returns the command line's KEY=VALUE items as key -> value (the last of a key's items, as it loads)."""
    return {key.strip(): value.strip() for key, sep, value in (item.partition("=") for item in overrides) if sep}


def pinned_keys(overrides: list[str]) -> set[str]:
    """Returns the dotted keys the command line pins (its KEY=VALUE items; a -1 mesh degree pins nothing)."""
    return {key for key, value in _given(overrides).items() if not (key.startswith("mesh.") and value == "-1")}


def free_mesh(overrides: list[str]) -> list[str]:
    """Returns the overrides a plan loads CONFIG with before the user's: every mesh degree the command line
    does not pin reset to 1 (across hosts too) and one of them to -1, so that a config written for other
    devices loads for the target the plan is for; and for a pinned `pipeline.repeats` above 1 with the
    schedule left to the plan, a schedule that reads it (the rules refuse repeats on the others)."""
    pins = pinned_keys(overrides)
    free = [f"mesh.{axis}" for axis in MESH_AXES if f"mesh.{axis}" not in pins]
    free += [f"mesh.dcn.{axis}" for axis in MESH_AXES if f"mesh.dcn.{axis}" not in pins]
    fill = next((key for key in ("mesh.data", "mesh.fsdp", "mesh.pipeline", "mesh.context", "mesh.expert",
                                 "mesh.tensor") if key in free), None)
    loaded = [f"{key}={-1 if key == fill else 1}" for key in free]
    if _given(overrides).get("pipeline.repeats", "1") not in ("", "1") and "pipeline.schedule" not in pins:
        loaded.append(f"pipeline.schedule={REPEATED_SCHEDULES[0]}")
    return loaded


def load_for_plan(path: str | None, overrides: list[str]) -> Config:
    """Loads CONFIG as `nestor plan` searches it: its mesh free (`free_mesh`), and without the checks that
    need the device count, which each candidate's own layout answers."""
    from nestor.orchestrator.loader.config import load

    return load(path, free_mesh(overrides) + overrides, device_checks=False)


def searched_keys(config: Config, pins: set[str]) -> set[str]:
    """Returns the dotted keys a plan sets for the user (the mesh, the pipeline's schedule, repeats and
    micro-batches unless a pin leaves one stage, the attention over a split row unless a pin leaves it whole,
    the expert exchange of a dropless MoE model, the ladder's keys), less the `pins`."""
    keys = {f"mesh.{axis}" for axis in MESH_AXES} | {f"mesh.dcn.{axis}" for axis in MESH_AXES} | set(LADDER_KEYS)
    if not _pinned_to_one(config, pins, "pipeline"):
        keys |= {"pipeline.schedule", "pipeline.repeats", "pipeline.microbatches"}
    if "context" in searched_axes(config) and not _pinned_to_one(config, pins, "context"):
        keys.add("model.context_attention")
    if config.dropless_moe and not _pinned_to_one(config, pins, "expert"):
        keys.add("moe.exchange")
    return keys - pins


def _pinned_to_one(config: Config, pins: set[str], axis: str) -> bool:
    """Whether the pins leave `axis` one device in every candidate."""
    return f"mesh.{axis}" in pins and config.mesh.ici_shape()[axis] * config.mesh.dcn_shape()[axis] == 1


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


def pipelines(config: Config, stages: int, pins: set[str]) -> list[dict[str, Any]]:
    """Returns the pipeline settings of a mesh with `stages` stages: each schedule (circular and interleaved
    1F1B with 2 layer groups per stage, the others with 1) with 1, 2 or 4 micro-batches per stage; a pinned
    repeat count keeps the schedules that read it (above 1) or the others (1). A layer count the stages and
    groups do not divide is left to the config's rules to refuse, with the reason."""
    schedules = _choices(config, "pipeline.schedule", SCHEDULES, pins)
    repeats = _choices(config, "pipeline.repeats", REPEATS, pins)
    pairs = [(s, r) for s in schedules for r in repeats if (r > 1) == (s in REPEATED_SCHEDULES)]
    if not pairs and {"pipeline.schedule", "pipeline.repeats"} <= pins:  # the user's own pair, as they pinned it
        pairs = [(config.pipeline.schedule, config.pipeline.repeats)]
    microbatches = _choices(config, "pipeline.microbatches", tuple(stages * m for m in MICROBATCHES_PER_STAGE), pins)
    return [{"pipeline.schedule": s, "pipeline.repeats": r, "pipeline.microbatches": m}
            for (s, r), m in itertools.product(pairs, microbatches)]


def variants(config: Config, total: dict[str, int], pins: set[str], accelerator: bool) -> list[dict[str, Any]]:
    """Returns the ways to run a mesh of `total` degrees that change its step but not its split: the
    pipeline's (`pipelines`) with several stages; all-gathered or ring attention over a row split by
    `mesh.context`; and for a dropless MoE model over expert devices of a GPU or TPU, the all-gather or the
    ragged all-to-all exchange (XLA:CPU has only the first, which `auto` takes there)."""
    found: list[dict[str, Any]] = [{}]
    if total["pipeline"] > 1:
        found = [v | p for v in found for p in pipelines(config, total["pipeline"], pins)]
    if total["context"] > 1 and "context" in searched_axes(config):  # nestor's LM: a user's model splits no row
        found = [v | {"model.context_attention": a} for v in found
                 for a in _choices(config, "model.context_attention", CONTEXT_STRATEGIES, pins)]
    if config.dropless_moe and total["expert"] > 1 and accelerator:
        found = [v | {"moe.exchange": e} for v in found
                 for e in _choices(config, "moe.exchange", EXCHANGE_CHOICES, pins)]
    return found


def layouts(config: Config, pins: set[str], accelerator: bool = False) -> list[dict[str, Any]]:
    """Returns the layouts of a plan: mesh degrees within and across hosts, each with its `variants`, as
    dotted settings; `accelerator` when the plan compiles for a GPU or TPU."""
    found = []
    for total in mesh_degrees(config, pins):
        split = split_over_hosts(config, total, pins)
        if split is None:
            continue
        ici, dcn = split
        mesh = {f"mesh.{axis}": ici[axis] for axis in MESH_AXES} | {f"mesh.dcn.{axis}": dcn[axis] for axis in MESH_AXES}
        found += [mesh | variant for variant in variants(config, total, pins, accelerator)]
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


def candidates(config: Config, pins: set[str], accelerator: bool = False) -> list[list[Candidate]]:
    """Returns every layout's ladder of candidates (see `layouts`, `ladder`)."""
    found = []
    for layout in layouts(config, pins, accelerator):
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
