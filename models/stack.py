"""Stacks of identical blocks: parameters stacked [count, ...] along one logical axis, run by whatever
runner the training job installed for the stack's name (a scan by default; unrolled, rematerialised or
pipelined by the job), so a model says what repeats and the job decides how it runs.

A runner is `runner(layer_fn, stacked_params, x, row_inputs) -> (x, stats stacked [count, ...])` with
`layer_fn(unit_params, x, row_inputs) -> (x, stats)`; `row_inputs` are per-row tensors every unit reads
unchanged (a mask, segment ids) or None.
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nestor.models import task
from nestor.models.params import UNNAMED, logical_axes_of

Stats = dict[str, jax.Array]
LayerFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Stats]]
StackRunner = Callable[[LayerFn, Any, jax.Array, Any], tuple[jax.Array, Stats]]
RematPolicy = Callable[..., Any]  # a jax.checkpoint policy


def scan_layers(layer_fn: LayerFn, stacked_params: Any, x: jax.Array, row_inputs: Any = None, *,
                remat_policy: RematPolicy | None = None) -> tuple[jax.Array, Stats]:
    """Runs `layer_fn` over the leading `layers` dimension of `stacked_params`.

    With a `remat_policy` every unit runs under `jax.checkpoint` with it: the
    backward pass keeps each unit's input and what the policy saves, and
    recomputes the rest; None keeps everything. Returns the final activations
    and each layer's stats stacked `[layers, ...]`.
    """
    if remat_policy is not None:
        layer_fn = jax.checkpoint(layer_fn, policy=remat_policy, prevent_cse=False)  # no CSE to fear in a scan
    return jax.lax.scan(lambda carry, params: layer_fn(params, carry, row_inputs), x, stacked_params)


def unrolled_layers(layer_fn: LayerFn, stacked_params: Any, x: jax.Array, row_inputs: Any = None, *,
                    remat_policy: RematPolicy | None = None) -> tuple[jax.Array, Stats]:
    """`scan_layers` written out: one call of `layer_fn` per unit, in order, on the same inputs and outputs.

    A scan keeps what its backward pass needs of each unit in buffers stacked
    [layers, ...] that XLA zero-fills before the loop and writes slice by
    slice; unrolled, each unit's saved activations are buffers of their own
    and its parameters' gradients are concatenated once (the transpose of
    `lax.split`). Compile time grows with depth.
    """
    if remat_policy is not None:  # unrolled, XLA could merge a recomputation with the forward pass: keep them apart
        layer_fn = jax.checkpoint(layer_fn, policy=remat_policy, prevent_cse=True)
    leaves, treedef = jax.tree.flatten(stacked_params)
    count = leaves[0].shape[0]
    parts = [jax.lax.split(leaf, (1,) * count, axis=0) for leaf in leaves]
    stats = []
    for index in range(count):
        x, unit_stats = layer_fn(treedef.unflatten([jnp.squeeze(part[index], 0) for part in parts]), x, row_inputs)
        stats.append(unit_stats)
    return x, jax.tree.map(lambda *per_unit: jnp.stack(per_unit), *stats)


_runners: contextvars.ContextVar[Mapping[str | None, StackRunner]] = contextvars.ContextVar("stack_runners",
                                                                                            default={})


@contextlib.contextmanager
def runners(by_name: Mapping[str | None, StackRunner]) -> Iterator[None]:
    """Installs how the stacks traced inside the block run: `by_name[stack name]`, else `by_name[None]`,
    else `scan_layers`."""
    token = _runners.set(by_name)
    try:
        yield
    finally:
        _runners.reset(token)


def runner_for(name: str) -> StackRunner:
    """Returns the installed runner of the stack called `name`."""
    installed = _runners.get()
    return installed.get(name, installed.get(None, scan_layers))


def run(name: str, layer_fn: LayerFn, stacked_params: Any, x: jax.Array, row_inputs: Any = None
        ) -> tuple[jax.Array, Stats]:
    """Runs the stack called `name` with its installed runner (`runners`)."""
    return runner_for(name)(layer_fn, stacked_params, x, row_inputs)


def stacked(make_unit: Callable[[nnx.Rngs], nnx.Module], count: int, axis_name: str, rngs: nnx.Rngs) -> nnx.Module:
    """Returns `count` units made by `make_unit(rngs)` as one module, parameters stacked [count, ...]
    along the logical axis `axis_name`."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis_name, "logical_axes": axis_name})
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return make_unit(rngs)

    module = make(rngs)
    for _, variable in nnx.iter_graph(module):  # a variable the model left unnamed still has the stack's axis
        if isinstance(variable, nnx.Variable) and logical_axes_of(variable) is None:
            variable.set_metadata("logical_axes", (axis_name,) + (None,) * (variable.get_value().ndim - 1))
            variable.set_metadata(UNNAMED, True)
    return module


class Stack(nnx.Module):
    """`count` blocks made by `make_block(rngs)`, parameters stacked [count, ...] along the logical axis
    `axis` (default "layers", which the pipeline splits into stages), run as the stack called `name`.

    Calling it runs `block(x)` (or `block(x, row_inputs)` when `row_inputs` is given: per-row tensors every
    block reads unchanged) through every block in order; a block returns x, or (x, stats) with stats a dict
    of arrays, which the call returns stacked [count, ...]. Inside a block, `models.task.step_key()` is a key
    of that block's own, drawn from the step's key and the stack's name.
    """

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], count: int, *, rngs: nnx.Rngs,
                 name: str = "blocks", axis: str = "layers"):
        if count < 1:  # an empty stack has no layer for a runner to run
            raise ValueError(f"Stack {name!r} needs a count of at least one block, got {count!r}")
        self.name = name
        self.count = count
        self.blocks = stacked(make_block, count, axis, rngs)

    def __call__(self, x: jax.Array, row_inputs: Any = None) -> tuple[jax.Array, Stats]:
        layer_fn, inputs = self.units()
        return run(self.name, layer_fn, inputs, x, row_inputs)

    def units(self) -> tuple[LayerFn, Any]:
        """Returns (layer_fn, stacked inputs): one block as a function of its inputs, and every block's inputs
        stacked [count, ...] (its parameters, with a key each when the step has one); what a runner takes."""
        graphdef, state = nnx.split(self.blocks)
        key, train = task.step_key(), task.training()
        params = nnx.to_pure_dict(state)
        if key is not None:  # each block draws from a key of its own; two stacks never share one
            key = jax.random.fold_in(key, zlib.crc32(self.name.encode()) & 0x7FFFFFFF)
        inputs = params if key is None else (params, jax.random.split(key, self.count))

        def layer_fn(unit_inputs: Any, h: jax.Array, rows: Any) -> tuple[jax.Array, Stats]:
            unit_params, unit_key = (unit_inputs, None) if key is None else unit_inputs
            block = nnx.merge(graphdef, unit_params)
            with task.step_info(train, unit_key):
                out = block(h) if rows is None else block(h, rows)
            return out if isinstance(out, tuple) else (out, {})

        return layer_fn, inputs
