"""The train state: built abstractly, laid out by logical names, initialised sharded.

The state is a plain dict `{"step", "params", "opt_state"}` whose params are a
nested dict of arrays with layers stacked `[layers, ...]`: the one canonical
layout checkpoints store, whatever the mesh. A model with auxiliary-loss-free
MoE balancing adds `"expert_bias"`: its `ExpertBias` variables, laid out as
the params are, which the step moves and the optimizer never sees.

With LoRA (models.lora) the params hold the frozen base and its adapters; only
the adapters (`StateLayout.trained`) have gradients and optimizer state, and
only they are checkpointed: a restore reads the base again (`with_base`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nestor.models import axes, task
from nestor.models.lora import Adapter
from nestor.models.moe import ExpertBias
from nestor.models.params import logical_axes_of
from nestor.models.stack import Stack
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.hf.load import load_params
from nestor.orchestrator.job import user_lora
from nestor.orchestrator.job.user_lora import nest
from nestor.orchestrator.job.layout_checks import (entry_axes, layout_problems, replicated_params,
                                                   trained_variable_problems)
from nestor.orchestrator.job.optimizer import make_optimizer
from nestor.orchestrator.specs.registry import build_model, spec_of
from nestor.parallel.rules import Rules, is_logical_axes, tree_shardings


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Everything known about the train state before any device holds it."""

    graphdef: Any            # the model's structure; merge with params to get a module
    logical: dict            # params tree of logical-axis tuples
    abstract: dict           # state tree of jax.ShapeDtypeStruct (with shardings)
    shardings: dict          # state tree of NamedSharding
    optimizer: optax.GradientTransformation
    update_shardings: dict | None = None  # params tree: where each share of a parameter is updated (None: as held)
    bias_update_rate: float = 0.0  # how far the step moves the model's ExpertBias variables (auxiliary-loss-free)
    trained: dict | None = None  # LoRA: the logical axes of the trained params (the adapters); None: all of them
    adapter_scale: float = 0.0  # LoRA on a model of the user's: alpha / rank of its adapters (0: none)
    replicated: tuple[str, ...] = ()  # the params the model gave no name the rules map (`replicated_params`)
    perplexity: bool = False  # its eval loss is a token cross-entropy (models.task.TOKEN_CROSS_ENTROPY), not DPO's

    def update_shares(self, tree: dict) -> dict:
        """Returns the params-like `tree` (all params or the trained ones) constrained to where the optimizer
        updates it (`update_shardings`), or `tree` itself when the update is not sharded (call inside a
        jitted function)."""
        if self.update_shardings is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, subtree(self.update_shardings, tree))

    def trained_part(self, params: dict) -> dict:
        """Returns the part of the params tree `params` that trains: the adapters with LoRA, else all."""
        return params if self.trained is None else subtree(params, self.trained)

    @property
    def saved(self) -> dict:
        """Returns the abstract tree a checkpoint holds: the state, of the params the trained ones only."""
        return self.saved_part(self.abstract)

    def saved_part(self, state: dict) -> dict:
        """Returns what a checkpoint keeps of `state` (or an abstract one): the base of a LoRA run and DPO's
        reference are left to their source (model.init_from, or run.seed)."""
        return {**{name: part for name, part in state.items() if name != REFERENCE},
                "params": self.trained_part(state["params"])}

    @property
    def from_source(self) -> bool:
        """Returns whether a restore reads part of the state from the run's source (`with_base`)."""
        return self.trained is not None or REFERENCE in self.shardings


REFERENCE = "reference"  # DPO without LoRA: a frozen copy of the params the run started from


def subtree(tree: dict, template: dict) -> dict:
    """Returns the part of the nested dict `tree` at the keys of `template` (a subtree of it)."""
    return {key: subtree(tree[key], value) if isinstance(value, dict) else tree[key] for key, value in template.items()}


def joined(tree: dict, part: dict) -> dict:
    """Returns a copy of the nested dict `tree` with the leaves of `part` (a subtree of it) in place of its own."""
    return {key: (joined(value, part[key]) if isinstance(value, dict) else part[key]) if key in part else value
            for key, value in tree.items()}


def _adapters(state: nnx.State, logical: dict) -> dict | None:
    """Returns the logical-axes tree of the model's LoRA adapters (models.lora.Adapter), or None without."""
    paths = [tuple(path) for path, var in nnx.to_flat_state(state) if isinstance(var, Adapter)]
    if not paths:
        return None
    trained: dict = {}
    for path in paths:
        node, source = trained, logical
        for part in path[:-1]:
            node, source = node.setdefault(part, {}), source[part]
        node[path[-1]] = source[path[-1]]
    return trained


def split_model(model: nnx.Module) -> tuple[Any, nnx.State, nnx.State]:
    """Returns (graphdef, expert biases, everything else: the parameters); merge them back in that order."""
    return nnx.split(model, ExpertBias, ...)


def _logical_and_values(state: nnx.State) -> tuple[dict, dict]:
    """Returns (tree of logical-axes tuples, tree of values) of a model state's variables; a variable
    without names gets (None, ...): replicated, as GSPMD and Flax's get_partition_spec leave it
    (`replicated_params` names them)."""
    flat = nnx.to_flat_state(state)
    logical = {}
    for path, var in flat:
        names = logical_axes_of(var)
        logical[tuple(path)] = names if names is not None else (None,) * len(var.get_value().shape)
    return nest(logical), nest({tuple(path): var.get_value() for path, var in flat})


SHARDING_AXES = ("fsdp", "tensor")  # the mesh axes that split a model's weight matrices


def _unpipelined_stacks_whole(config: Config, model: nnx.Module, logical: dict) -> dict:
    """Returns the logical axes with the stacking dimension of every stack the pipeline does not split
    replicated (None): those stacks run on every stage, so their blocks are not spread over the stages."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Stack) and node.name != config.pipeline.stack:
            subtree = logical
            for part in (*path, "blocks")[:-1]:
                subtree = subtree[part]
            subtree["blocks"] = jax.tree.map(lambda names: (None, *names[1:]), subtree["blocks"],
                                             is_leaf=is_logical_axes)
    return logical


def update_sharding(sharding: NamedSharding, shape: tuple[int, ...], batch_axes: tuple[str, ...]) -> NamedSharding:
    """Returns where a parameter of `shape` held as `sharding` is updated under ZeRO stage 1: split further
    over the `batch_axes` (those the batch is split on, of size > 1) it is not split over already, on the
    dimension whose share they divide (the largest such share), so that each replica of the batch updates
    one share and keeps that share's optimizer state. Where no dimension divides, the last of those axes are
    dropped until one does; `sharding` itself when none is left."""
    mesh = sharding.mesh
    entries = [entry_axes(entry) for entry in sharding.spec]
    entries += [()] * (len(shape) - len(entries))
    used = {axis for entry in entries for axis in entry}
    free = tuple(axis for axis in batch_axes if axis not in used and mesh.shape[axis] > 1)
    shares = [size // math.prod(mesh.shape[axis] for axis in entry) for size, entry in zip(shape, entries)]
    while free:
        ways = math.prod(mesh.shape[axis] for axis in free)
        dividing = [dim for dim, share in enumerate(shares) if share % ways == 0]
        if dividing:
            dim = max(dividing, key=lambda d: shares[d])
            entries[dim] += free
            return NamedSharding(mesh, PartitionSpec(*(entry[0] if len(entry) == 1 else entry or None
                                                       for entry in entries)))
        free = free[:-1]
    return sharding


def _bias_update_rate(bias: nnx.State) -> float:
    """Returns the update rate of the model's ExpertBias variables; raises ConfigError unless the model holds
    them in one stack (one array [MoE layers, experts], which the step moves by its metric `moe_expert_load`)
    at one rate."""
    flat = nnx.to_flat_state(bias)
    rates = {var.get_metadata().get("update_rate", 0.0) for _, var in flat}
    if len(flat) != 1 or len(rates) != 1:
        raise ConfigError([("model.class", f"auxiliary-loss-free balancing moves one ExpertBias array [MoE layers, "
                                          f"experts] at one rate; the model holds {len(flat)} at rates "
                                          f"{sorted(rates)}: keep its MoE layers in one models.stack.Stack")])
    return float(rates.pop())


def _traced(make: Callable[[], Any]) -> Any:
    """Returns make() run inside an abstract trace, so that the arrays it creates on the way (optax's
    placeholder state) touch no device; what it returns must hold no array."""
    made = []
    jax.eval_shape(lambda: made.append(make()))
    return made[0]


def state_layout(config: Config, mesh: Mesh, rules: Rules, batch_axes: frozenset[str] = frozenset()) -> StateLayout:
    """Returns the abstract, sharded layout of the train state for `mesh`; `batch_axes` are the logical names
    of the batch's fields (for the checks of a model of the user's). Raises ConfigError where a model of
    the user's cannot be laid out (`layout_problems`)."""
    abstract_model = nnx.eval_shape(lambda: build_model(config, config.run.seed))
    graphdef, abstract_bias, abstract_params = split_model(abstract_model)
    checked = spec_of(config).layout_checked
    if checked:
        if problems := (trained_variable_problems(abstract_params)
                        or layout_problems(config, abstract_model, abstract_params, mesh, rules, batch_axes)):
            raise ConfigError(problems)
    logical, params_shape = _logical_and_values(abstract_params)
    if checked:
        logical = _unpipelined_stacks_whole(config, abstract_model, logical)
    bias_logical, bias_shape = _logical_and_values(abstract_bias)
    trained = _adapters(abstract_params, logical)
    adapter_scale = 0.0
    if checked and config.lora.rank:  # a model of the user's: adapters beside its params (job.user_lora)
        adapter_logical, adapter_shapes = user_lora.adapter_layout(config, logical, params_shape)
        logical, params_shape = {**logical, user_lora.KEY: adapter_logical}, {**params_shape,
                                                                              user_lora.KEY: adapter_shapes}
        trained, adapter_scale = {user_lora.KEY: adapter_logical}, config.lora.alpha / config.lora.rank
    trained_logical = logical if trained is None else trained
    optimizer = make_optimizer(config, trained_logical)
    opt_shape = jax.eval_shape(optimizer.init, subtree(params_shape, trained_logical))

    param_shardings = tree_shardings(logical, mesh, rules)
    update_shardings = None
    if config.optimizer.shard_update:
        update_shardings = jax.tree.map(lambda sharding, leaf: update_sharding(sharding, leaf.shape, rules[axes.BATCH]),
                                        param_shardings, params_shape)
    replicated = NamedSharding(mesh, PartitionSpec())
    # the moments live where their parameter is updated: sharded with it under `optimizer.shard_update`
    opt_shardings = _traced(lambda: optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, opt_shape, subtree(update_shardings or param_shardings,
                                                                    trained_logical),
        transform_non_params=lambda _: replicated,
    ))
    shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings}
    shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params_shape, "opt_state": opt_shape}
    bias_update_rate = 0.0
    if bias_shape:
        shardings["expert_bias"] = tree_shardings(bias_logical, mesh, rules)
        shapes["expert_bias"] = bias_shape
        bias_update_rate = _bias_update_rate(abstract_bias)
    if config.train.objective == "dpo" and trained is None:  # DPO's reference: the start, frozen
        shardings[REFERENCE], shapes[REFERENCE] = param_shardings, params_shape
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    perplexity = task.token_cross_entropy(abstract_model) and config.train.objective == "lm"
    return StateLayout(graphdef, logical, abstract, shardings, optimizer, update_shardings, bias_update_rate,
                       trained, adapter_scale, replicated_params(abstract_params, rules), perplexity)


def init_state(config: Config, layout: StateLayout) -> dict:
    """Returns the train state initialised directly into its shardings (no full copy anywhere): fresh
    parameters, or with `model.init_from` a Hugging Face checkpoint's (orchestrator.hf.load), each process
    reading only its slices, and with `lora.init_from` a PEFT adapter's (orchestrator.hf.peft); the
    optimizer starts fresh either way."""
    loaded = _loaded(config, layout)

    def init(loaded: dict) -> dict:
        _, bias, params = split_model(build_model(config, config.run.seed))
        params = joined(_with_user_adapters(config, layout, nnx.to_pure_dict(params)), loaded)  # what was loaded
        state = {"step": jnp.zeros((), jnp.int32), "params": params,
                 "opt_state": layout.optimizer.init(layout.trained_part(params))}
        if REFERENCE in layout.shardings:
            state[REFERENCE] = params
        return {**state, "expert_bias": nnx.to_pure_dict(bias)} if "expert_bias" in layout.shardings else state

    return jax.jit(init, out_shardings=layout.shardings, donate_argnums=0)(loaded)


def _with_user_adapters(config: Config, layout: StateLayout, params: dict) -> dict:
    """Returns a model of the user's `params` with its fresh LoRA adapters (job.user_lora) when it has them."""
    if not layout.adapter_scale:
        return params
    return {**params, user_lora.KEY: user_lora.init_adapters(config, layout.abstract["params"][user_lora.KEY],
                                                             layout.logical[user_lora.KEY])}


def _loaded(config: Config, layout: StateLayout, base_only: bool = False) -> dict:
    """Returns the params read from `model.init_from` (the base) and, unless `base_only`, `lora.init_from`
    (the adapters), laid out as `layout` holds them; {} where neither is set."""
    loaded: dict = {}
    if config.model.init_from:
        base = layout.abstract["params"]
        if layout.trained is not None:  # the checkpoint holds no adapters
            base = _without(base, layout.trained)
        loaded, _ = load_params(config, base)
    if config.lora.init_from and not base_only and layout.trained is not None:
        from nestor.orchestrator.hf.peft import load_adapters

        loaded = _merged(loaded, load_adapters(config, subtree(layout.abstract["params"], layout.trained)))
    return loaded


def _without(tree: dict, part: dict) -> dict:
    """Returns the nested dict `tree` without the leaves of `part` (nor dicts left empty)."""
    result = {}
    for key, value in tree.items():
        if key not in part:
            result[key] = value
        elif isinstance(value, dict) and isinstance(part[key], dict):
            if rest := _without(value, part[key]):
                result[key] = rest
    return result


def _merged(first: dict, second: dict) -> dict:
    """Returns the union of two nested dicts with disjoint leaves."""
    result = dict(first)
    for key, value in second.items():
        result[key] = _merged(result[key], value) if key in result and isinstance(value, dict) else value
    return result


def initial_params(config: Config, layout: StateLayout, base_only: bool = False) -> dict:
    """Returns the params a fresh run starts from, laid out as `layout` holds them: those read from
    `model.init_from` and `lora.init_from` (not with `base_only`), the rest initialised from run.seed."""
    def params(loaded: dict) -> dict:
        _, _, params = split_model(build_model(config, config.run.seed))
        # what was loaded is not initialised (XLA drops it)
        return joined(_with_user_adapters(config, layout, nnx.to_pure_dict(params)), loaded)

    return jax.jit(params, out_shardings=layout.shardings["params"], donate_argnums=0)(
        _loaded(config, layout, base_only))


def with_base(config: Config, layout: StateLayout, saved: dict) -> dict:
    """Returns the whole state of a checkpoint's `saved` one (`StateLayout.saved`): a LoRA run's frozen
    base read again from `model.init_from` (or initialised from run.seed without one) under its adapters, or
    DPO's reference read again so."""
    if REFERENCE in layout.shardings:
        return {**saved, REFERENCE: initial_params(config, layout)}
    if layout.trained is None:
        return saved
    return {**saved, "params": joined(initial_params(config, layout, base_only=True), saved["params"])}


def per_device_bytes(leaf: jax.ShapeDtypeStruct) -> int:
    """Returns the bytes one device holds of the sharded abstract array `leaf`."""
    return math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize


def _flatten(tree: Any, is_leaf=None) -> list[tuple[str, Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf) for path, leaf in leaves]


def _spec_entries(leaf: jax.ShapeDtypeStruct) -> list[str | list[str] | None]:
    """Returns the PartitionSpec of `leaf` as JSON: per dimension None, a mesh axis, or a list of axes."""
    spec = list(leaf.sharding.spec) + [None] * (leaf.ndim - len(leaf.sharding.spec))
    return [list(entry) if isinstance(entry, tuple) else entry for entry in spec]


def param_table(layout: StateLayout) -> list[dict[str, Any]]:
    """Returns one row per parameter of `layout`: name, shape, logical axes, PartitionSpec (see
    `_spec_entries`), bytes per device and in all."""
    logical = dict(_flatten(layout.logical, is_leaf=is_logical_axes))
    rows = []
    for name, leaf in _flatten(layout.abstract["params"]):
        rows.append({
            "name": name, "shape": list(leaf.shape), "logical_axes": list(logical[name]),
            "spec": _spec_entries(leaf), "bytes_per_device": per_device_bytes(leaf),
            "bytes_total": leaf.size * np.dtype(leaf.dtype).itemsize,
        })
    return rows


def bytes_text(n: float) -> str:
    """Returns `n` bytes in the largest binary unit under 1024 of it: `512 B`, `1.5 KiB`, `2.0 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def layout_warnings(layout: StateLayout, rules: Rules) -> list[str]:
    """Returns the warning lines of a layout: the parameters replicated for want of a name the rules map
    (`StateLayout.replicated`) with their bytes per device, where the mesh's fsdp or tensor split others,
    and each of fsdp and tensor that splits no parameter at all."""
    rows = param_table(layout)
    mesh = layout.abstract["step"].sharding.mesh
    splitting = [axis for axis in SHARDING_AXES if mesh.shape[axis] > 1]
    warnings = []
    replicated = [row for row in rows if row["name"] in layout.replicated]
    if replicated and splitting:
        listed = ", ".join(f"{row['name']} {row['shape']} {bytes_text(row['bytes_per_device'])}" for row in replicated)
        held = bytes_text(sum(row["bytes_per_device"] for row in replicated))
        # a name of the largest one's own, where it has one, for the mesh.rules entry the line suggests
        largest = max(replicated, key=lambda row: row["bytes_per_device"])
        own = [name for name in largest["logical_axes"] if name and name != axes.LAYERS]
        entry = f" (e.g. mesh.rules={{{own[-1]}: {splitting[-1]}}})" if own else ""
        warnings.append(f"warning: {len(replicated)} parameter(s) have no logical name the rules map, so every device "
                        f"holds them whole ({held} per device, their optimizer state aside) while "
                        f"{', '.join(f'mesh.{axis}={mesh.shape[axis]}' for axis in splitting)} split the others: "
                        f"{listed}; name their dimensions (nnx.with_partitioning) or map their names with mesh.rules"
                        f"{entry} to split them (docs/models.md)")
    used = {axis for row in rows for entry in row["spec"] for axis in entry_axes(entry)}
    for axis in splitting:
        if axis not in used:
            batch = ", only the batch" if axis in rules.get(axes.BATCH, ()) else ""
            warnings.append(f"warning: mesh.{axis}={mesh.shape[axis]} splits no parameter{batch}: no logical name of "
                            f"the parameters maps to {axis}; map one with mesh.rules (mesh.rules={{NAME: {axis}}}) or "
                            "give its devices to another mesh axis")
    return warnings
