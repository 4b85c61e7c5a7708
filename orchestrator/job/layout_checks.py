"""What a model of the user's must hold for its parameters to be laid out on a mesh: variables the step trains,
dimensions their mesh axes divide, stacks the pipeline can split, `mesh.rules` entries for names it uses; and
which of its parameters the rules leave replicated."""

from __future__ import annotations

import math

from flax import nnx
from jax.sharding import Mesh

from nestor.models import axes, task
from nestor.models.params import logical_axes_of, named_by_model
from nestor.models.stack import Stack
from nestor.orchestrator.config.degrees import schedule_for
from nestor.orchestrator.config.schema import Config
from nestor.parallel.rules import DEFAULT_RULES, Rules, partition_spec


def entry_axes(entry: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """Returns the mesh axes one entry of a PartitionSpec (or its JSON form) splits a dimension over."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _pipelined_stack_problems(config: Config, model: nnx.Module, mesh: Mesh) -> list[tuple[str, str]]:
    """Returns the problems of pipelining the model's stack `pipeline.stack` over `mesh.pipeline` stages: no
    stack of that name (or two), one whose blocks do not split into stages x repeats, and for a schedule that
    runs the backward pass in its loop a model without the split around that stack (models.task)."""
    if mesh.shape["pipeline"] == 1 or hasattr(model, "pipeline_units"):  # a model that gives its stack itself
        return []
    found = [node for _, node in nnx.iter_graph(model) if isinstance(node, Stack)]
    names = [node.name for node in found]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        return [("model.class", f"two stacks are named {', '.join(map(repr, twice))}: give each Stack a name= of "
                                "its own")]
    stacks = {node.name: node for node in found}
    name = config.pipeline.stack
    if name not in stacks:
        return [("pipeline.stack", f"the model has no stack named {name!r} to pipeline; its stacks (models.stack."
                                   f"Stack) are {', '.join(sorted(stacks)) or 'none'}")]
    schedule = schedule_for(config, mesh.shape["pipeline"])
    problems = [(f"pipeline.{what}" if what != "layers" else "pipeline.stack", f"stack {name!r}: {message}")
                for what, message in schedule.problems(stacks[name].count)]
    if not schedule.one_f_one_b:
        return problems
    missing = [method for method in task.PIPELINE_METHODS if not callable(getattr(model, method, None))]
    split_stack = getattr(model, task.PIPELINE_STACK, name)
    if missing:
        problems.append(("pipeline.schedule", f"{config.pipeline.schedule} runs the backward pass inside its loop, "
                                              f"which needs the model split around its stack: "
                                              f"{type(model).__name__} has no {', '.join(missing)} (docs/models.md); "
                                              "gpipe and circular need nothing more"))
    elif split_stack != name:
        problems.append(("pipeline.stack", f"{config.pipeline.schedule} runs {type(model).__name__}'s split around "
                                           f"its stack {split_stack!r} (its {task.PIPELINE_STACK}), not {name!r}; "
                                           f"pipeline {split_stack!r}, or {name!r} with gpipe or circular"))
    return problems


def trained_variable_problems(state: nnx.State) -> list[tuple[str, str]]:
    """Returns a problem for each variable of a model of the user's that is neither a parameter nor an expert
    bias: the step trains nnx.Param and keeps nothing else (RNG state, batch statistics)."""
    problems = []
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Param):
            problems.append(("model.class", f"{'/'.join(map(str, path))} is an {type(var).__name__}; the step trains "
                                            "nnx.Param variables and keeps no other state (use models.task.step_key "
                                            "for randomness; no batch statistics)"))
    return problems


def layout_problems(config: Config, model: nnx.Module, state: nnx.State, mesh: Mesh, rules: Rules,
                    batch_axes: set[str]) -> list[tuple[str, str]]:
    """Returns config problems of a model of the user's (`model`, its parameters `state`) on `mesh`: a
    dimension the rules map to mesh axes that do not divide it, a stack the pipeline cannot split, and a
    `mesh.rules` entry for a name neither the parameters nor the batch (`batch_axes`) nor nestor's
    activations use. A parameter without names the rules map is replicated, not refused
    (`replicated_params`)."""
    problems = _pipelined_stack_problems(config, model, mesh)  # the stages' split, said once per stack
    names: set[str] = set()
    for path, var in nnx.to_flat_state(state):
        logical = logical_axes_of(var)
        if logical is None:
            continue
        names.update(name for name in logical if name)
        where, shape = "/".join(map(str, path)), var.get_value().shape
        spec = partition_spec(logical, rules)
        for size, name, entry in zip(shape, logical, list(spec) + [None] * len(shape)):
            mesh_axes = entry_axes(entry)
            shards = math.prod(mesh.shape[axis] for axis in mesh_axes)
            if size % shards and "pipeline" not in mesh_axes:
                problems.append(("model.class", f"parameter {where} {list(shape)}: its {name!r} dimension of {size} "
                                                f"does not split over {' x '.join(f'mesh.{a}' for a in mesh_axes)} "
                                                f"(= {shards}); change mesh.rules.{name} or the mesh"))
    known = names | batch_axes | set(DEFAULT_RULES)
    for name in config.mesh.rules:
        if name not in known:
            problems.append((f"mesh.rules.{name}", f"the model never names {name!r}; its parameters' logical axes "
                                                   f"are {', '.join(sorted(names)) or 'none'}"))
    return problems


def replicated_params(state: nnx.State, rules: Rules) -> tuple[str, ...]:
    """Returns the paths of the parameters that every device holds whole because the model gave them no name
    the rules map: none at all (Flax's own nnx.Linear bias and nnx.LayerNorm scale), only a stack's
    leading one, or only names `rules` does not know. A dimension named None on purpose is not counted."""
    paths = []
    for path, var in nnx.to_flat_state(state):
        own = [name for name in logical_axes_of(var) or () if name and name != axes.LAYERS]
        if not named_by_model(var) or (own and not any(name in rules for name in own)):
            paths.append("/".join(map(str, path)))
    return tuple(paths)
