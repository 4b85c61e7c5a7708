"""The jitted train step: the model's loss (its task contract, models.task), grads, optax update.

State in and out keep the shardings of `orchestrator.job.state`; the state is
donated so its buffers are reused. A batch is a dict of arrays, rows first
(orchestrator.data.batches). Gradient accumulation splits the global batch
into `train.grad_accum` micro-batches and scans over them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nestor.backend import Backend, BackendError, BackendRequest, backend_of_devices
from nestor.models import ops, stack, task
from nestor.models.dpo import preference_loss
from nestor.models.axes import activation_sharding
from nestor.models.moe import EXPERT_LOAD, expert_parallelism
from nestor.models.stack import LayerFn, RematPolicy, StackRunner, scan_layers, unrolled_layers
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.job.context_wiring import ATTENTION_AXES, sequence_layout, with_context_attention
from nestor.orchestrator.data.batches import Field, batch_fields, shardings
from nestor.orchestrator.config.degrees import schedule_for
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.moe_wiring import EXPERT_BIAS, balanced_expert_bias, dropless_exchange, routing_key
from nestor.orchestrator.job.optimizer import learning_rate
from nestor.orchestrator.specs.registry import spec_of
from nestor.orchestrator.job import user_lora
from nestor.orchestrator.job.state import REFERENCE, StateLayout, joined, subtree
from nestor.parallel.context import context_degree
from nestor.parallel.pipeline import Schedule, pipeline_runner, to_microbatches
from nestor.parallel.pipeline_1f1b import one_f_one_b
from nestor.parallel.rules import Rules, activation_constrainer, resolve_rules

Metrics = dict[str, jax.Array]
Batch = dict[str, jax.Array]
# grad_fn(params, batch, key=None, expert_bias=None, frozen=None) -> ((loss, metrics), grads), as
# value_and_grad(loss_fn): grads of the trained `params` only (with `frozen`, the whole params they update)
GradFn = Callable[..., tuple[tuple[jax.Array, Metrics], Any]]


def backend_request(config: Config) -> BackendRequest:
    """Returns what the run asks of the backend: its target and choice keys, and its model's dropless trait."""
    m, moe = config.model, config.moe
    return BackendRequest(
        accelerator=config.cluster.accelerator, device_kind=config.cluster.device_kind, dtype=m.dtype,
        remat=m.remat, remat_names=tuple(m.remat_names), attention=m.attention, matmul_precision=m.matmul_precision,
        context_attention=m.context_attention, context_balance=m.context_balance, grouped_matmul=moe.grouped_matmul,
        exchange=moe.exchange, dropless_layers=spec_of(config).dropless_layers(config))


def backend_for(config: Config, mesh: Mesh) -> Backend:
    """Returns the backend (nestor.backend) of `config` on `mesh`'s devices: what the run's target runs.
    Raises ConfigError for a choice the target cannot run."""
    try:
        return backend_of_devices(backend_request(config), mesh.devices.flat,
                                  context_degree(mesh, resolve_rules(config.mesh.rules), ATTENTION_AXES))
    except BackendError as error:
        raise ConfigError([(error.key, error.message)]) from None


def model_context(backend: Backend, mesh: Mesh, rules: Rules) -> Callable[[], contextlib.AbstractContextManager]:
    """Returns context() -> a block in which the model traces as the run compiles it: activations laid out
    by `rules` on `mesh` (rows in the context layout where mesh.context splits them), and `backend`'s ops,
    context attention and expert exchange as compiled on the mesh's devices."""
    compiled = backend.compiled_here()
    constrainer = activation_constrainer(mesh, rules)
    exchange = dropless_exchange(compiled, mesh, rules)
    layout = sequence_layout(compiled, mesh, rules)
    model_ops = with_context_attention(compiled.ops(), compiled, mesh, rules, layout)

    @contextlib.contextmanager
    def context():
        with activation_sharding(constrainer, layout), expert_parallelism(exchange), ops.installed(model_ops):
            yield

    return context


# (model, batch, reference model or None) -> (loss, metrics)
Objective = Callable[[nnx.Module, Batch, nnx.Module | None], tuple[jax.Array, Metrics]]


def objective_of(config: Config) -> Objective | None:
    """Returns what the step minimises when it is not the model's own loss (`train.objective: dpo`: DPO on
    preference pairs, models.dpo, against the reference model, or the model with its adapters off), else
    None."""
    if config.train.objective != "dpo":
        return None
    beta = config.dpo.beta

    def forward_of(model: nnx.Module) -> Callable[[jax.Array], jax.Array]:
        return lambda tokens: model(tokens, train=task.training(), routing_key=task.step_key())[0]

    def dpo(model: nnx.Module, batch: Batch, reference: nnx.Module | None = None) -> tuple[jax.Array, Metrics]:
        return preference_loss(forward_of(model), batch, beta, None if reference is None else forward_of(reference))

    return dpo


def make_loss_fn(layout: StateLayout, mesh: Mesh, rules: Rules, backend: Backend,
                 runners: dict[str | None, StackRunner] | None = None,
                 train: bool = True, objective: Objective | None = None) -> Callable[..., tuple[jax.Array, Metrics]]:
    """Returns loss(params, batch, key=None, expert_bias=None, frozen=None) -> (loss, metrics): the model's
    task contract (models.task) traced in `model_context(backend, mesh, rules)`, its stacks run by `runners`
    (models.stack; default: scans), `train=False` tracing it for evaluation, `key` the micro-batch's random
    key; with `frozen` (all params) `params` are the trained ones (LoRA's adapters), put in its place;
    `objective` (objective_of) replaces the model's loss, `reference` (params) the model it compares with."""
    context = model_context(backend, mesh, rules)

    def loss_fn(params: dict, batch: Batch, key: jax.Array | None = None, expert_bias: dict | None = None,
                frozen: dict | None = None, reference: dict | None = None) -> tuple[jax.Array, Metrics]:
        whole = params if frozen is None else joined(frozen, params)
        if layout.adapter_scale:  # a model of the user's: its adapters' update merged into the weights
            whole = user_lora.merged(whole, layout.adapter_scale)
        model = nnx.merge(layout.graphdef, expert_bias or {}, whole)
        with context(), stack.runners(runners or {}), task.step_info(train, key):
            if objective:
                result = objective(model, batch, None if reference is None else
                                   nnx.merge(layout.graphdef, expert_bias or {}, reference))
            else:
                result = getattr(model, task.LOSS_METHOD)(batch)
        return checked_loss(model, result)

    return loss_fn


def checked_loss(model: nnx.Module, result: Any) -> tuple[jax.Array, Metrics]:
    """Returns a model's `loss(batch)` result when it keeps the task contract, (scalar loss, dict of
    metrics); raises ConfigError (model.class) saying what it returned otherwise."""
    if (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)
            and jnp.ndim(result[0]) == 0 and jnp.issubdtype(jnp.result_type(result[0]), jnp.floating)):
        return result
    shown = (f"a tuple of {len(result)} ({', '.join(map(_described, result))})" if isinstance(result, tuple)
             else _described(result))
    raise ConfigError([("model.class", f"{type(model).__name__}.{task.LOSS_METHOD}(batch) returned {shown}; it "
                                       "must return (a float scalar loss, a dict of metrics) (docs/models.md)")])


def _described(value: Any) -> str:
    """Returns what a value a model returned is, in a few words: `an array float32 (32,)`, `a dict`."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array {value.dtype} {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def micro_batches(batch: Batch, count: int) -> Batch:
    """Returns `batch` split into `count` micro-batches: every field [count, rows / count, ...]."""
    return {name: to_microbatches(value, count) for name, value in batch.items()}


def constrain_batch(batch: Batch, fields: dict[str, Field], constrain) -> Batch:
    """Returns a micro-batch with every field pinned to its logical axes."""
    return {name: constrain(value, fields[name].logical_axes) for name, value in batch.items()}


def _accumulated_grads(grad_fn: GradFn, params: dict, batch: Batch, key: jax.Array, accum: int,
                       pin: Callable[[Batch], Batch]) -> tuple[Any, Metrics]:
    """Returns (grads, metrics) averaged over `accum` micro-batches (each laid out by `pin`); micro-batch i
    draws its random numbers from `fold_in(key, i)`, so no two micro-batches draw the same."""
    if accum == 1:
        (loss, metrics), grads = grad_fn(params, batch, key=key)
        return grads, {**metrics, "loss": loss}  # a metric of the model's never hides the loss
    micro = micro_batches(batch, accum)

    def body(carry, inputs):
        index, micro_batch = inputs
        (loss, metrics), grads = grad_fn(params, pin(micro_batch), key=jax.random.fold_in(key, index))
        summed = jax.tree.map(jnp.add, carry, (grads, {**metrics, "loss": loss}))
        return summed, None

    first = jax.tree.map(lambda value: value[0], micro)
    (loss_shape, metrics_shape), grads_shape = jax.eval_shape(functools.partial(grad_fn, key=key), params, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         (grads_shape, {**metrics_shape, "loss": loss_shape}))
    (grads, metrics), _ = jax.lax.scan(body, zeros, (jnp.arange(accum), micro))
    return jax.tree.map(lambda g: g / accum, (grads, metrics))


def like(tree: dict, template: dict) -> dict:
    """Returns the part of the nested dict `tree` at the keys of `template` (a subtree of it)."""
    return {key: like(tree[key], value) if isinstance(value, dict) else tree[key] for key, value in template.items()}


def pipeline_schedule(config: Config, mesh: Mesh) -> Schedule | None:
    """Returns the pipeline schedule when the mesh has more than one stage, else None."""
    stages = mesh.shape["pipeline"]
    return None if stages == 1 else schedule_for(config, stages)


def layer_runner(config: Config, policy: RematPolicy | None) -> StackRunner:
    """Returns how a stack of layers runs outside a pipeline: a scan, or unrolled (`model.scan_layers=false`)."""
    return functools.partial(scan_layers if config.model.scan_layers else unrolled_layers, remat_policy=policy)


def stack_runners(config: Config, mesh: Mesh, rules: Rules, backend: Backend) -> dict[str | None, StackRunner]:
    """Returns how the model's stacks (models.stack) run forward: the stack `pipeline.stack` ("blocks" for
    nestor's LM) pipelined when `mesh.pipeline > 1`, every other stack (and that one without a pipeline) by
    `layer_runner`'s (an MoE model's first dense layers before the pipeline: on every stage); every unit is
    rematerialised by the backend's remat policy, and a pipeline runs the backend's loop."""
    compiled = backend.compiled_here()
    policy = compiled.remat_policy()
    layers = layer_runner(config, policy)
    schedule = pipeline_schedule(config, mesh)
    if schedule is None:
        return {None: layers}
    # 1F1B's loop runs the backward pass too; a forward alone (evaluation) is GPipe's (circular's, interleaved)
    # over the same stages and layer groups
    forward = dataclasses.replace(schedule, one_f_one_b=False, zero_bubble=False)
    spec = spec_of(config)

    def pipelined(layer_fn, stacked_params, x, row_inputs=None):  # x [batch, ...]: laid out as the spec says
        runner = pipeline_runner(forward, mesh, rules, spec.activation_axes(x.ndim), policy, compiled.pipeline_loop)
        return runner(layer_fn, stacked_params, x, row_inputs)

    return {config.pipeline.stack: pipelined, None: layers}


def make_grad_fn(config: Config, layout: StateLayout, mesh: Mesh, rules: Rules,
                 backend: Backend | None = None) -> GradFn:
    """Returns grad_fn(params, batch, key=None, expert_bias=None) -> ((loss, metrics), grads) of the model's
    loss: jax's autodiff of the forward, or, for a schedule that runs the backward pass inside its loop
    (1F1B, interleaved or not, and zero-bubble), that schedule's own gradients. `backend` defaults to
    `backend_for(config, mesh)`."""
    backend = backend or backend_for(config, mesh)
    schedule = pipeline_schedule(config, mesh)
    if schedule is None or not schedule.one_f_one_b:
        loss_fn = make_loss_fn(layout, mesh, rules, backend, stack_runners(config, mesh, rules, backend),
                               objective=objective_of(config))
        return jax.value_and_grad(loss_fn, has_aux=True)
    policy = backend.compiled_here().remat_policy()
    other_stacks = {None: layer_runner(config, policy)}  # the stacks outside the pipeline: on every stage
    context = model_context(backend, mesh, rules)
    name = config.pipeline.stack

    def grad_fn(params: dict, batch: Batch, key: jax.Array | None = None, expert_bias: dict | None = None,
                frozen: dict | None = None, reference: dict | None = None):
        del reference  # an objective of its own (DPO's) runs under gpipe or circular (the config's checks)
        # The model split around its pipelined stack (models.task's pipeline methods): the schedule computes the
        # stack's gradients itself, and those of the rest through pipeline_input and pipeline_output.
        trained = params
        if frozen is not None:  # LoRA: the schedule differentiates every parameter it is given, so the frozen
            params = joined(frozen, params)  # ones pass through stop_gradient: no weight gradient is computed

        def model(params: dict) -> nnx.Module:
            return nnx.merge(layout.graphdef, expert_bias or {}, params)

        with context(), task.step_info(True, key):
            whole = model(params)
            path, layer_fn, stacked = pipelined_units(whole, name)
            stack_params = nested_get(params, path)
            rest = nested_without(params, path)
            if frozen is not None:
                layer_fn = frozen_except(layer_fn, nested_get(trained, path))
            outer_trained = nested_without(trained, path) if frozen is not None else None

            def input_fn(rest: dict, micro: Batch) -> jax.Array:  # the first stage
                rest = rest if outer_trained is None else stop_gradient_except(rest, outer_trained)
                with stack.runners(other_stacks), task.step_info(True, key):
                    return model(nested_with(rest, path, stack_params)).pipeline_input(micro)

            def head_fn(rest: dict, y: jax.Array, micro: Batch) -> tuple[jax.Array, Metrics]:  # the last stage
                rest = rest if outer_trained is None else stop_gradient_except(rest, outer_trained)
                with stack.runners(other_stacks), task.step_info(True, key):
                    return model(nested_with(rest, path, stack_params)).pipeline_output(y, micro)

            rows = whole.pipeline_rows(batch) if hasattr(whole, "pipeline_rows") else None
            stats_loss = whole.pipeline_stats_loss if hasattr(whole, "pipeline_stats_loss") else None
            x_shape = jax.eval_shape(input_fn, rest, batch)
            activation_axes = spec_of(config).activation_axes(len(x_shape.shape))
            value_and_grad = one_f_one_b(schedule, mesh, rules, activation_axes, policy)
            (loss, metrics, stats), (stacked_grads, rest_grads) = value_and_grad(
                layer_fn, input_fn, head_fn, stacked, rest, batch, rows,
                None if stats_loss is None else lambda stats: stats_loss(stats)[0])
        stats_part, stats_metrics = stats_loss(stats) if stats_loss else (0.0, {})
        unit_grads = stacked_grads[0] if isinstance(stacked, tuple) else stacked_grads  # (params, keys)
        # the units may carry untrained variables (an expert bias) beside their weights: their gradients drop
        grads = nested_with(rest_grads, path, like(unit_grads, stack_params))
        return (loss + stats_part, {**metrics, **stats_metrics}), subtree(grads, trained)

    return grad_fn


def stop_gradient_except(tree: dict, trained: dict) -> dict:
    """Returns the nested dict `tree` with every leaf outside `trained` (a subtree of it) through stop_gradient."""
    return {key: (stop_gradient_except(value, trained[key]) if isinstance(value, dict) else value)
            if key in trained else jax.lax.stop_gradient(value) for key, value in tree.items()}


def frozen_except(layer_fn: LayerFn, trained: dict) -> LayerFn:
    """Returns `layer_fn` with the unit's parameters outside `trained` (the stack's trained part) frozen
    (`stop_gradient_except`); a unit's inputs are its parameters or (parameters, random key)."""
    def unit_fn(unit_inputs: Any, x: jax.Array, rows: Any) -> tuple[jax.Array, Metrics]:
        if isinstance(unit_inputs, tuple):
            unit_inputs = (stop_gradient_except(unit_inputs[0], trained), *unit_inputs[1:])
        else:
            unit_inputs = stop_gradient_except(unit_inputs, trained)
        return layer_fn(unit_inputs, x, rows)

    return unit_fn


def pipelined_units(model: nnx.Module, name: str) -> tuple[tuple[str, ...], Any, Any]:
    """Returns (path of the stack's parameters in the params tree, layer_fn, stacked inputs) of the model's
    stack `name`: the model's own `pipeline_units` (models.task), else its models.stack.Stack of that name."""
    if hasattr(model, "pipeline_units"):
        return model.pipeline_units(name)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, stack.Stack) and node.name == name:
            return (*path, "blocks"), *node.units()
    raise ConfigError([("pipeline.stack", f"the model has no stack named {name!r} to pipeline")])


def nested_get(tree: dict, path: tuple[str, ...]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def nested_with(tree: dict, path: tuple[str, ...], value: Any) -> dict:
    """Returns a copy of the nested dict `tree` with `value` at `path`."""
    head, *tail = path
    return {**tree, head: nested_with(tree.get(head, {}), tuple(tail), value) if tail else value}


def nested_without(tree: dict, path: tuple[str, ...]) -> dict:
    """Returns a copy of the nested dict `tree` without the entry at `path` (nor dicts it leaves empty)."""
    head, *tail = path
    if not tail:
        return {key: value for key, value in tree.items() if key != head}
    inner = nested_without(tree[head], tuple(tail))
    return {key: value for key, value in tree.items() if key != head} | ({head: inner} if inner else {})


def make_train_step(config: Config, layout: StateLayout, mesh: Mesh, rules: Rules, backend: Backend | None = None,
                    fields: dict[str, Field] | None = None):
    """Returns the jitted step(state, batch) -> (state, metrics), state donated, for batches of `fields`
    (default: `batch_fields(config)`, the training data's).

    Gradients come from `make_grad_fn(config, layout, mesh, rules, backend)`.
    """
    grad_fn = make_grad_fn(config, layout, mesh, rules, backend)
    schedule = learning_rate(config)
    constrain = activation_constrainer(mesh, rules)
    fields = batch_fields(config) if fields is None else fields
    accum = config.train.grad_accum

    def step(state: dict, batch: Batch) -> tuple[dict, Metrics]:
        params = layout.trained_part(state["params"])  # LoRA: the adapters; the base is frozen
        frozen = None if layout.trained is None else state["params"]
        key = routing_key(config.run.seed, state["step"])
        grads, metrics = _accumulated_grads(functools.partial(grad_fn, expert_bias=state.get("expert_bias"),
                                                              frozen=frozen, reference=state.get(REFERENCE)), params,
                                            task.normalized_weights(batch), key, accum,
                                            lambda micro: constrain_batch(micro, fields, constrain))
        # under optimizer.shard_update each replica of the batch updates its share only (ZeRO stage 1); the
        # norms are taken on the shares, and out_shardings gathers the new parameters back to their layout
        grads, params = layout.update_shares(grads), layout.update_shares(params)
        updates, opt_state = layout.optimizer.update(grads, state["opt_state"], params)
        params = layout.update_shares(optax.apply_updates(params, updates))
        if frozen is not None:
            params = joined(frozen, params)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "param_norm": optax.tree.norm(params),
                   "lr": schedule(state["step"])}
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        if REFERENCE in state:
            new_state[REFERENCE] = state[REFERENCE]
        if "expert_bias" in state:  # auxiliary-loss-free balancing: outside the optimizer
            if EXPERT_LOAD not in metrics:
                raise ConfigError([("model.class", f"a model with ExpertBias variables returns the metric "
                                                   f"{EXPERT_LOAD} (models.moe.moe_losses), which moves them")])
            new_state["expert_bias"] = balanced_expert_bias(state["expert_bias"], metrics[EXPERT_LOAD],
                                                            layout.bias_update_rate)
            metrics[EXPERT_BIAS] = jax.tree.leaves(new_state["expert_bias"])[0]
        return new_state, metrics

    return jax.jit(step, in_shardings=(layout.shardings, shardings(fields, mesh, rules)),
                   out_shardings=(layout.shardings, NamedSharding(mesh, PartitionSpec())),
                   donate_argnums=0)  # metrics replicated: every process can read them
