"""The jitted train step: LM loss (+ model aux losses), grads, optax update.

State in and out keep the shardings of `orchestrator.state`; the state is
donated so its buffers are reused. Gradient accumulation splits the global
batch into `train.grad_accum` micro-batches and scans over them.
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

from nestor.backend import Backend, BackendError, backend_of_devices
from nestor.models import axes, ops
from nestor.models.axes import activation_sharding
from nestor.models.moe import expert_parallelism
from nestor.models.transformer import RematPolicy, StackRunner, scan_layers, unrolled_layers
from nestor.orchestrator.config import Config, ConfigError, MoEConfig
from nestor.orchestrator.data.batches import document_ids, masks_documents
from nestor.orchestrator.degrees import schedule_for
from nestor.orchestrator.moe_step import (EXPERT_BIAS, EXPERT_LOAD, balanced_expert_bias, dropless_exchange,
                                          moe_loss_and_metrics, routing_key)
from nestor.orchestrator.optimizer import learning_rate
from nestor.orchestrator.state import StateLayout
from nestor.parallel.pipeline import Schedule, pipeline_runner, to_microbatches
from nestor.parallel.pipeline_1f1b import one_f_one_b
from nestor.parallel.rules import Rules, activation_constrainer, partition_spec

ACTIVATION_AXES = (axes.BATCH, axes.LENGTH, axes.ACT_EMBED)  # of the stack's input and output
Metrics = dict[str, jax.Array]
# grad_fn(params, tokens, routing_key=None, expert_bias=None) -> ((loss, metrics), grads), as value_and_grad(loss_fn)
GradFn = Callable[..., tuple[tuple[jax.Array, Metrics], Any]]


def backend_for(config: Config, mesh: Mesh) -> Backend:
    """Returns the backend (nestor.backend) of `config` on `mesh`'s devices: what the run's target runs.
    Raises ConfigError for a choice the target cannot run."""
    try:
        return backend_of_devices(config, mesh.devices.flat)
    except BackendError as error:
        raise ConfigError([(error.key, error.message)]) from None


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Returns the sharding of a token batch [batch, length]."""
    return NamedSharding(mesh, partition_spec((axes.BATCH, axes.LENGTH), rules))


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Returns the mean next-token cross-entropy in float32."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.mean(losses)


def model_context(backend: Backend, mesh: Mesh, rules: Rules) -> Callable[[], contextlib.AbstractContextManager]:
    """Returns context() -> a block in which the model traces as the run compiles it: activations laid out
    by `rules` on `mesh`, and `backend`'s ops and expert exchange as compiled on the mesh's devices."""
    compiled = backend.compiled_here()
    constrainer = activation_constrainer(mesh, rules)
    exchange = dropless_exchange(compiled, mesh, rules)
    model_ops = compiled.ops()

    @contextlib.contextmanager
    def context():
        with activation_sharding(constrainer), expert_parallelism(exchange), ops.installed(model_ops):
            yield

    return context


def make_loss_fn(layout: StateLayout, mesh: Mesh, rules: Rules, backend: Backend,
                 stack_runner: StackRunner = scan_layers, moe: MoEConfig = MoEConfig(), document_mask: bool = False,
                 dense_runner: StackRunner = scan_layers, train: bool = True) -> Callable[..., tuple[jax.Array, Metrics]]:
    """Returns loss(params, tokens [b, t+1], routing_key=None, expert_bias=None) -> (loss, metrics) with activations
    laid out by `rules`; the loss adds the MoE layers' weighted aux and z losses (`moe`). The layer
    stack runs through `stack_runner`, an MoE model's first dense layers through `dense_runner`.
    With `document_mask`, no token attends across a document separator (`data.document_ids`);
    `train=False` runs the model as in evaluation (MoE at the eval capacity factor, no random routing).
    The model traces in `model_context(backend, mesh, rules)`."""
    context = model_context(backend, mesh, rules)

    def loss_fn(params: dict, tokens: jax.Array, routing_key: jax.Array | None = None,
                expert_bias: dict | None = None) -> tuple[jax.Array, Metrics]:
        model = nnx.merge(layout.graphdef, expert_bias or {}, params)
        inputs = tokens[:, :-1]
        segment_ids = document_ids(inputs) if document_mask else None
        with context():
            logits, stats = model(inputs, segment_ids=segment_ids, stack_runner=stack_runner,
                                  dense_runner=dense_runner, train=train, routing_key=routing_key)
        loss = lm_loss(logits, tokens[:, 1:])
        moe_loss, moe_metrics = moe_loss_and_metrics(stats, moe)
        return loss + moe_loss, {"lm_loss": loss, **moe_metrics}

    return loss_fn


def _accumulated_grads(grad_fn: GradFn, params: dict, tokens: jax.Array, key: jax.Array, accum: int,
                       constrain) -> tuple[Any, Metrics]:
    """Returns (grads, metrics) averaged over `accum` micro-batches; micro-batch i routes
    with `fold_in(key, i)`, so no two micro-batches draw the same routing noise."""
    if accum == 1:
        (loss, metrics), grads = grad_fn(params, tokens, routing_key=key)
        return grads, {"loss": loss, **metrics}
    micro = to_microbatches(tokens, accum)  # [accum, batch/accum, width]

    def body(carry, inputs):
        index, micro_tokens = inputs
        (loss, metrics), grads = grad_fn(params, constrain(micro_tokens, (axes.BATCH, axes.LENGTH)),
                                         routing_key=jax.random.fold_in(key, index))
        summed = jax.tree.map(jnp.add, carry, (grads, {"loss": loss, **metrics}))
        return summed, None

    (loss_shape, metrics_shape), grads_shape = jax.eval_shape(
        functools.partial(grad_fn, routing_key=key), params, micro[0])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         (grads_shape, {"loss": loss_shape, **metrics_shape}))
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


def stack_runners(config: Config, mesh: Mesh, rules: Rules, backend: Backend) -> tuple[StackRunner, StackRunner]:
    """Returns how the layer stack runs forward (pipelined when `mesh.pipeline > 1`, else `layer_runner`'s) and
    how an MoE model's first dense layers run (`layer_runner`'s, before the pipeline: on every stage); every unit
    is rematerialised by the backend's remat policy, and a pipeline runs the backend's loop."""
    compiled = backend.compiled_here()
    policy = compiled.remat_policy()
    layers = layer_runner(config, policy)
    schedule = pipeline_schedule(config, mesh)
    if schedule is None:
        return layers, layers
    # 1F1B's loop runs the backward pass too; a forward alone (evaluation) is GPipe's (circular's, interleaved)
    # over the same stages and layer groups
    forward = dataclasses.replace(schedule, one_f_one_b=False, zero_bubble=False)
    return pipeline_runner(forward, mesh, rules, ACTIVATION_AXES, policy, compiled.pipeline_loop), layers


def make_grad_fn(config: Config, layout: StateLayout, mesh: Mesh, rules: Rules,
                 backend: Backend | None = None) -> GradFn:
    """Returns grad_fn(params, tokens, routing_key=None, expert_bias=None) -> ((loss, metrics), grads) of the
    model's loss:
    jax's autodiff of the forward, or, for a schedule that runs the backward pass inside its loop
    (1F1B, interleaved or not, and zero-bubble), that schedule's own gradients. `backend` defaults to
    `backend_for(config, mesh)`."""
    backend = backend or backend_for(config, mesh)
    document_mask = masks_documents(config, config.data.source)
    schedule = pipeline_schedule(config, mesh)
    if schedule is None or not schedule.one_f_one_b:
        stack_runner, dense_runner = stack_runners(config, mesh, rules, backend)
        loss_fn = make_loss_fn(layout, mesh, rules, backend, stack_runner, config.moe, document_mask, dense_runner)
        return jax.value_and_grad(loss_fn, has_aux=True)
    policy = backend.compiled_here().remat_policy()
    value_and_grad = one_f_one_b(schedule, mesh, rules, ACTIVATION_AXES, policy)
    dense_runner = layer_runner(config, policy)
    context = model_context(backend, mesh, rules)
    moe = config.moe

    def grad_fn(params: dict, tokens: jax.Array, routing_key: jax.Array | None = None,
                expert_bias: dict | None = None):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        segment_ids = document_ids(inputs) if document_mask else None
        rest = {name: value for name, value in params.items() if name != "blocks"}  # embedding, dense layers, head

        def model(rest: dict):  # the blocks' gradients come from the schedule's stages, the rest's from embed and head
            return nnx.merge(layout.graphdef, expert_bias or {}, {**rest, "blocks": params["blocks"]})

        def embed(rest: dict, micro_inputs: dict) -> jax.Array:  # at the first stage: embedding, first dense layers
            tokens = micro_inputs["tokens"]
            return model(rest).stack_input(tokens, segment_ids=document_ids(tokens) if document_mask else None,
                                           dense_runner=dense_runner)

        def head(rest: dict, y: jax.Array, micro_inputs: dict) -> tuple[jax.Array, Metrics]:
            return lm_loss(model(rest).logits(y), micro_inputs["targets"]), {}

        with context():
            layer_fn, stacked = model(rest).units(routing_key=routing_key)
            (loss, _, stats), (stacked_grads, rest_grads) = value_and_grad(
                layer_fn, embed, head, stacked, rest, {"tokens": inputs, "targets": targets}, segment_ids,
                lambda stats: moe_loss_and_metrics(stats, moe)[0])
        block_grads = stacked_grads[0] if isinstance(stacked, tuple) else stacked_grads  # (params, routing keys)
        moe_loss, moe_metrics = moe_loss_and_metrics(stats, moe)
        # the units carry the expert bias beside their weights; it is not trained, so its gradient is dropped
        return (loss + moe_loss, {"lm_loss": loss, **moe_metrics}), {**rest_grads,
                                                                     "blocks": like(block_grads, params["blocks"])}

    return grad_fn


def make_train_step(config: Config, layout: StateLayout, mesh: Mesh, rules: Rules, backend: Backend | None = None):
    """Returns the jitted step(state, tokens) -> (state, metrics), state donated.

    Gradients come from `make_grad_fn(config, layout, mesh, rules, backend)`.
    """
    grad_fn = make_grad_fn(config, layout, mesh, rules, backend)
    schedule = learning_rate(config)
    constrain = activation_constrainer(mesh, rules)
    accum = config.train.grad_accum

    def step(state: dict, tokens: jax.Array) -> tuple[dict, Metrics]:
        params = state["params"]
        key = routing_key(config.run.seed, state["step"])
        grads, metrics = _accumulated_grads(functools.partial(grad_fn, expert_bias=state.get("expert_bias")), params,
                                            tokens, key, accum, constrain)
        # under optimizer.shard_update each replica of the batch updates its share only (ZeRO stage 1); the
        # norms are taken on the shares, and out_shardings gathers the new parameters back to their layout
        grads, params = layout.update_shares(grads), layout.update_shares(params)
        updates, opt_state = layout.optimizer.update(grads, state["opt_state"], params)
        params = layout.update_shares(optax.apply_updates(params, updates))
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "param_norm": optax.tree.norm(params),
                   "lr": schedule(state["step"])}
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        if "expert_bias" in state:  # auxiliary-loss-free balancing: outside the optimizer
            new_state["expert_bias"] = balanced_expert_bias(state["expert_bias"], metrics[EXPERT_LOAD],
                                                            config.moe.bias_update_rate)
            metrics[EXPERT_BIAS] = jax.tree.leaves(new_state["expert_bias"])[0]
        return new_state, metrics

    return jax.jit(step, in_shardings=(layout.shardings, batch_sharding(mesh, rules)),
                   out_shardings=(layout.shardings, NamedSharding(mesh, PartitionSpec())),
                   donate_argnums=0)  # metrics replicated: every process can read them
