"""Logical axis names -> mesh axes: one table, overridable from `mesh.rules`.

Models name every dimension with a logical name ("embed", "mlp", "batch"...);
this table decides which mesh axes shard it (GSPMD, arXiv 2105.04663: annotate
a few tensors, the partitioner does the rest). Names of parameters and names of
activations are kept apart where they shard differently: the embed dimension of
a weight is split over fsdp, the embed dimension of an activation is not (fsdp
splits the batch of activations instead).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("pipeline", "data", "fsdp", "context", "expert", "tensor")

Rules = dict[str, tuple[str, ...]]

DEFAULT_RULES: Rules = {
    # parameters
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "norm": (),
    "bias": (),
    "layers": ("pipeline",),
    "dense_layers": (),  # run before the pipeline, on every stage
    "expert": ("expert",),
    "lora_rank": (),  # a LoRA adapter's rank: every device holds it whole
    # activations
    "batch": ("data", "fsdp", "expert"),
    "length": ("context",),  # a row's places (parallel.context lays them out)
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_expert": ("expert",),
    "act_group": ("data", "fsdp", "context"),
    "groups": ("data", "fsdp", "expert", "context"),  # MoE routing groups: a row's tokens cut into groups
    "stage": ("pipeline",),
}


def _as_axes(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def unknown_rule_problems(overrides: Mapping[str, Any], known: Collection[str] | None = DEFAULT_RULES
                          ) -> list[tuple[str, str]]:
    """Returns (key path, message) for every override of a logical axis not in `known` (None: any name is
    known, for a model whose names are learnt later), or that names no mesh axis or repeats one."""
    problems = []
    for name, value in overrides.items():
        key = f"mesh.rules.{name}"
        if known is not None and name not in known:
            problems.append((key, f"{name!r} is not a logical axis; the logical axes are {', '.join(known)}"))
            continue
        if value is not None and not isinstance(value, (str, list, tuple)):
            problems.append((key, f"expected null, a mesh axis or a list of them, got {value!r}"))
            continue
        axes = _as_axes(value)
        unknown = [axis for axis in axes if axis not in MESH_AXES]
        if unknown:
            problems.append((key, f"unknown mesh axis {', '.join(map(repr, unknown))}; mesh axes are {', '.join(MESH_AXES)}"))
        elif len(set(axes)) != len(axes):
            problems.append((key, f"a mesh axis appears twice in {list(axes)}"))
    return problems


def resolve_rules(overrides: Mapping[str, Any] | None = None) -> Rules:
    """Returns the default table with `overrides` (logical name -> axes or null) applied."""
    rules = dict(DEFAULT_RULES)
    for name, value in (overrides or {}).items():
        rules[name] = _as_axes(value)
    return rules


def partition_spec(logical_axes: tuple[str | None, ...], rules: Rules) -> PartitionSpec:
    """Returns the PartitionSpec for one array's logical axes.

    A mesh axis already used by an earlier dimension is skipped for later ones
    (an array cannot be split twice over the same devices), so e.g. tokens
    dispatched to experts keep `expert` on the expert dimension only. A
    logical name without a rule is replicated (a model's own names, until
    mesh.rules maps them).
    """
    used: set[str] = set()
    entries = []
    for name in logical_axes:
        if name is None:
            entries.append(None)
            continue
        axes = tuple(axis for axis in rules.get(name, ()) if axis not in used)
        used.update(axes)
        entries.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*entries)


def split_degree(logical_name: str, rules: Rules, degrees: Mapping[str, int]) -> int:
    """Returns how many ways a dimension named `logical_name` is split on a mesh of `degrees` (axis -> size)."""
    return math.prod(degrees[axis] for axis in rules.get(logical_name, ()))


def is_logical_axes(node: Any) -> bool:
    """True for a tuple of logical names (a leaf of a logical-axes tree)."""
    return isinstance(node, tuple) and all(isinstance(n, (str, type(None))) for n in node)


def tree_shardings(logical_tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """Returns a tree of NamedShardings on `mesh` with the structure of `logical_tree`."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, partition_spec(axes, rules)), logical_tree, is_leaf=is_logical_axes
    )


def _without(spec: PartitionSpec, dropped: tuple[str, ...]) -> PartitionSpec:
    """Returns `spec` with the mesh axes `dropped` taken out of every entry."""
    entries = []
    for entry in spec:
        axes = tuple(axis for axis in ((entry,) if isinstance(entry, str) else entry or ()) if axis not in dropped)
        entries.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*entries)


def mesh_here(mesh: Mesh) -> tuple[Mesh | AbstractMesh, tuple[str, ...]]:
    """Returns (the mesh to lay arrays out on at this point of a trace, its manual axes): `mesh` and none,
    or inside a `jax.shard_map` over some of its axes (a pipeline stage's own program) the context's
    abstract mesh and those axes."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty or not context.manual_axes:
        return mesh, ()
    return context, tuple(context.manual_axes)


def shard_map_here(f: Callable, mesh: Mesh, in_specs: tuple, out_specs: PartitionSpec) -> Callable:
    """Returns `jax.shard_map(f)` over every axis of `mesh` that is not already manual here (`mesh_here`),
    with those axes taken out of the specs (`in_specs`: a pytree of PartitionSpecs; check_vma off)."""
    here, manual = mesh_here(mesh)
    in_specs = jax.tree.map(lambda spec: _without(spec, manual), in_specs,
                            is_leaf=lambda node: isinstance(node, PartitionSpec))
    return jax.shard_map(f, mesh=here, in_specs=in_specs, out_specs=_without(out_specs, manual),
                         axis_names=frozenset(axis for axis in here.axis_names if axis not in manual), check_vma=False)


def activation_constrainer(mesh: Mesh, rules: Rules) -> Callable[[jax.Array, tuple[str | None, ...]], jax.Array]:
    """Returns f(x, logical_axes) that pins an activation's layout inside a jitted function.

    Inside a `jax.shard_map` over some of the mesh axes (a pipeline stage's own program) the layout is on
    the context's mesh, whose manual axes no activation dimension may name: those are dropped."""

    def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
        if len(logical_axes) != x.ndim:
            raise ValueError(f"{len(logical_axes)} logical axes {logical_axes} for an array of rank {x.ndim}")
        here, manual = mesh_here(mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(here, _without(partition_spec(logical_axes, rules),
                                                                                manual)))

    return constrain
