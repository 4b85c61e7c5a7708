"""Checks a Config before any device is touched; every problem is listed with its key path.

Divisibility follows the logical-axis rules: a dimension must split evenly
over the product of the mesh axes its logical name maps to.
"""

from __future__ import annotations

import dataclasses
import math
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nestor.backend.remat import NAMED_POLICIES
from nestor.orchestrator.config.keys import ARRAY_SOURCES, INT32_MAX, key_table
from nestor.orchestrator.config.degrees import REPEATED_SCHEDULES, mesh_axes_key, mesh_degrees, schedule_for, total_devices
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.loader.memory_fit import DEVICE_MEMORY_GIB, table_entry
from nestor.orchestrator.specs.base import ModelSpec
from nestor.orchestrator.specs.registry import spec_of
from nestor.parallel.rules import DEFAULT_RULES, resolve_rules, unknown_rule_problems

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config


def table_problems(config: Config) -> list[tuple[str, str]]:
    """Returns (key path, message) for every value outside its key's declared range or choices."""
    plain = config.to_dict()
    problems = []
    for path, _, _, spec in key_table(type(config)):
        value = plain
        for part in path.split("."):
            value = value[part]
        if value is None or isinstance(value, dict):
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if (message := spec.problem(item)) is not None:
                problems.append((path if index is None else f"{path}[{index}]", message))
    return problems


def validate(config: Config) -> Config:
    """Returns `config` if it is consistent, with the values the model chooses for the mesh where the run
    left a key unset (`ModelSpec.chosen_keys`, each said in `config.chosen`); otherwise raises ConfigError
    listing every problem.

    First every key against its own range and choices (the key table in
    orchestrator.config.schema); only when all hold, the checks across keys, which
    rely on them. Checks that need the device count (the mesh product) are
    done here when the mesh has no -1 or when `cluster.hosts *
    cluster.devices_per_host` is known.
    """
    problems = table_problems(config)
    if problems:
        raise ConfigError(problems)
    spec = spec_of(config)
    problems = spec.key_problems(config)
    problems += _remat_problems(config)
    problems += _device_memory_problems(config)
    if config.eval.every:
        problems += eval_problems(config)
    problems += _profile_problems(config)
    problems += _schedule_problems(config)
    problems += _mesh_problems(config, spec.rule_axes())
    if not problems and (degrees := _known_degrees(config)) is not None:
        config = _with_chosen_keys(config, spec.chosen_keys(config, degrees))
    problems += spec.mesh_problems(config, None if problems else _known_degrees(config))
    if not problems:
        problems += _repeats_problems(config)  # the device count may still be unknown
        if (degrees := _known_degrees(config)) is not None:
            problems += spec.split_problems(config, degrees)
            problems += _pipeline_problems(config, spec, degrees)
    if problems:
        raise ConfigError(problems)
    return config


def _with_chosen_keys(config: Config, chosen: list[tuple[str, Any, str]]) -> Config:
    """Returns `config` with each (dotted key, value, why) of `chosen` set, and each said in `config.chosen`."""
    if not chosen:
        return config
    for key, value, _ in chosen:
        section, name = key.split(".")
        config = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section),
                                                                             **{name: value})})
    object.__setattr__(config, "chosen", tuple(f"{key}={value} {why}; set {key} to choose another"
                                               for key, value, why in chosen))  # not a key: never written
    return config


def _device_memory_problems(config: Config) -> list[tuple[str, str]]:
    """cluster.device_kind names a device of the memory table unless cluster.device_memory_gb gives the
    memory itself."""
    kind, memory = config.cluster.device_kind, config.cluster.device_memory_gb
    if kind is not None and memory is None and table_entry(kind) is None:
        return [("cluster.device_kind", f"{kind!r} is not in the device memory table "
                                        f"({', '.join(DEVICE_MEMORY_GIB)}); pick one or set cluster.device_memory_gb")]
    return []


def eval_problems(config: Config) -> list[tuple[str, str]]:
    """Returns (key path, message) when the eval source cannot be read: `heldout` needs prepared shards
    (data.source=tokens), `text` and `tokens` need eval.paths. Checked when eval.every is set, and by
    `nestor eval`, with an evaluation's size (`evaluation_problems`)."""
    if problems := evaluation_problems(config):
        return problems
    source = config.eval.source
    if source == "heldout" and config.data.source not in ("tokens", "python"):
        example = ""
        if config.data.source == "text" and not config.data.paths:  # the standard library's top-level sources
            package = Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py"
            example = (f"; the default text is the standard library's top-level modules, so its packages are "
                       f"held out: eval.source=text 'eval.paths=[{package}]'")
        return [("eval.source", f"heldout is the eval split of prepared shards, and data.source is "
                                f"{config.data.source}; set eval.source to text, tokens, synthetic or arrays (with "
                                f"eval.paths), or train on data.source=tokens{example}")]
    if source == "arrays" and not config.eval.paths:
        return [("eval.paths", "eval.source=arrays needs .npz files or directories of .npy files held out from "
                               "training")]
    if (source == "arrays") != (config.data.source in ARRAY_SOURCES) and source != "heldout":
        return [("eval.source", f"evaluates a model trained on data.source={config.data.source} on {source} batches; "
                                "named arrays evaluate a model of your own, the token sources nestor's LM")]
    if source == "tokens" and not config.eval.paths:
        return [("eval.paths", "eval.source=tokens needs directories written by `nestor data prepare`")]
    if source == "text" and not config.eval.paths:
        # Without globs the text source reads the standard library's sources: the quickstart's training text.
        return [("eval.paths", "eval.source=text needs globs of held-out text files; without them it would "
                               "evaluate on the standard library's sources, the default training text")]
    return []


def _profile_problems(config: Config) -> list[tuple[str, str]]:
    profile, steps = config.profile, config.train.steps
    problems: list[tuple[str, str]] = []
    if profile.start_step > steps:
        problems.append(("profile.start_step", f"step {profile.start_step} is past train.steps={steps}"))
    elif profile.start_step and profile.start_step + profile.steps - 1 > steps:
        problems.append(("profile.steps", f"steps {profile.start_step}..{profile.start_step + profile.steps - 1} "
                                          f"run past train.steps={steps}; trace at most {steps - profile.start_step + 1}"))
    return problems


def _remat_problems(config: Config) -> list[tuple[str, str]]:
    """model.remat_names need a policy that saves by name."""
    m = config.model
    if m.remat_names and m.remat not in NAMED_POLICIES:
        return [("model.remat_names", f"model.remat={m.remat} does not save by name; names apply to "
                                      f"{' and '.join(NAMED_POLICIES)}")]
    return []


def _schedule_problems(config: Config) -> list[tuple[str, str]]:
    """The learning-rate schedule's lengths; a null decay_steps (train.steps) cuts the warmup instead."""
    opt = config.optimizer
    problems = []
    if opt.decay_steps is not None:
        if opt.warmup_steps > opt.decay_steps:
            problems.append(("optimizer.warmup_steps", f"{opt.warmup_steps} exceeds optimizer.decay_steps="
                                                       f"{opt.decay_steps}; warm up for at most the decay steps"))
    return problems


def _mesh_problems(config: Config, known_axes=DEFAULT_RULES) -> list[tuple[str, str]]:
    problems = []
    mesh = config.mesh
    fills = [axis for axis, size in mesh.ici_shape().items() if size == -1]
    if len(fills) > 1:
        problems.append((f"mesh.{fills[1]}", f"only one mesh axis may be -1; found {', '.join('mesh.' + a for a in fills)}"))
    problems += unknown_rule_problems(mesh.rules, known_axes)
    if (config.cluster.min_hosts or 0) > config.cluster.hosts:
        problems.append(("cluster.min_hosts", f"{config.cluster.min_hosts} is more than cluster.hosts="
                                              f"{config.cluster.hosts}; at most that many hosts run"))
    devices = total_devices(config)
    if devices is not None and not problems:
        dcn = math.prod(mesh.dcn_shape().values())
        if devices % dcn:
            problems.append(("mesh.dcn", f"the dcn degrees multiply to {dcn}, which does not divide {devices} devices"))
        elif config.cluster.hosts % dcn:
            problems.append(("mesh.dcn", f"the dcn degrees multiply to {dcn}, which does not divide cluster.hosts={config.cluster.hosts}"))
        else:
            per_slice = devices // dcn
            known = math.prod(size for size in mesh.ici_shape().values() if size != -1)
            if fills and per_slice % known:
                problems.append((f"mesh.{fills[0]}", f"the other axes multiply to {known}, which does not divide {per_slice} devices per slice"))
            elif not fills and known != per_slice:
                problems.append((mesh_axes_key(config), f"multiply to {known} but each slice has {per_slice} "
                                 f"devices (cluster.hosts={config.cluster.hosts} x cluster.devices_per_host="
                                 f"{config.cluster.devices_per_host} / {dcn} slices); set one axis to -1, change "
                                 "a degree or cluster.devices_per_host"))
    return problems


def _known_degrees(config: Config) -> dict[str, int] | None:
    """Returns the mesh degrees, or None while a -1 axis waits for the device count."""
    if total_devices(config) is None and -1 in config.mesh.ici_shape().values():
        return None
    return mesh_degrees(config)


def _repeats_problems(config: Config) -> list[tuple[str, str]]:
    """pipeline.repeats > 1 needs a schedule that repeats its stages."""
    p = config.pipeline
    if p.repeats > 1 and p.schedule not in REPEATED_SCHEDULES:
        return [("pipeline.repeats", f"repeats={p.repeats} needs pipeline.schedule=circular or interleaved_1f1b "
                                     f"(got {p.schedule}); set repeats to 1 or use one of those")]
    return []


def _pipeline_problems(config: Config, spec: ModelSpec, degrees: dict[str, int]) -> list[tuple[str, str]]:
    """The checks a pipeline schedule needs on the known mesh `degrees`: the model's units into stages x
    repeats (as `spec` counts them), batch into micro-batches."""
    p, t = config.pipeline, config.train
    problems = []
    if degrees["pipeline"] == 1:
        return problems
    schedule = schedule_for(config, degrees["pipeline"])
    keys = {"layers": "model.num_layers", "microbatches": "pipeline.microbatches", "repeats": "pipeline.repeats"}
    units, note = spec.pipeline_units(config, schedule)
    problems += [(keys[what], message + (note if what == "layers" else ""))
                 for what, message in schedule.problems(units)]
    per_step_batch = t.global_batch // t.grad_accum
    if per_step_batch % p.microbatches:
        problems.append(("train.global_batch", f"the per-step batch {per_step_batch} (global_batch / grad_accum) "
                                               f"does not split into pipeline.microbatches={p.microbatches}; "
                                               f"use a multiple of {p.microbatches * t.grad_accum}"))
        return problems
    batch_axes = resolve_rules(config.mesh.rules).get("batch") or ()
    shards = math.prod(degrees[a] for a in batch_axes)
    microbatch = per_step_batch // p.microbatches
    if microbatch % shards:
        names = " x ".join(f"mesh.{a}={degrees[a]}" for a in batch_axes)
        problems.append(("pipeline.microbatches", f"a micro-batch of {microbatch} sequences does not split over "
                                                  f"{names} (= {shards}); use at most "
                                                  f"{max(per_step_batch // shards, 1)} micro-batches or a larger global batch"))
    return problems


def evaluation_problems(config: Config) -> list[tuple[str, str]]:
    """Returns (eval.steps, message) when an evaluation's tokens (rows for a model of the user's), eval.steps
    batches of a step's, pass INT32_MAX, else nothing."""
    t, lm = config.train, spec_of(config).counts_tokens
    step = t.global_batch * (t.seq_len + 1 if lm else 1)
    evaluation = config.eval.steps * step
    if evaluation <= INT32_MAX:
        return []
    return [("eval.steps", f"{config.eval.steps:,} batches of {step:,} {'tokens' if lm else 'rows'} = "
                           f"{evaluation:,} an evaluation, more than {INT32_MAX:,}; use eval.steps <= "
                           f"{INT32_MAX // step:,}")]
