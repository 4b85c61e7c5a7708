"""Held-out evaluation: the model's evaluation loss and its exponential over a fixed set of batches.

The eval batches are batches 0 .. eval.steps - 1 of the eval source
(`eval.source`), each a pure function of (run.seed, index, row) like a
training batch, read through a source of their own: every evaluation, on any
mesh and after any resume, reads the same tokens, and training's stream never
moves. The eval step is the train step's forward loss (the same stack runner,
shardings, micro-batches and document mask) without gradients, its MoE layers
at `moe.eval_capacity_factor` with deterministic routing, jitted once. The
loss is what the model's loss returns outside training (models.task): for the
LM, the mean next-token cross-entropy over every eval token (no auxiliary
loss), or on chat data over every answer token of the eval batches;
perplexity is its exponential.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nestor.backend import Backend
from nestor.models import task
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.arrays import ArraySource
from nestor.orchestrator.data.batches import DataPipeline, Field, batch_fields, make_source, shardings
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.state import REFERENCE, StateLayout
from nestor.orchestrator.job.step import (backend_for, constrain_batch, make_loss_fn, micro_batches, objective_of,
                                          stack_runners)
from nestor.orchestrator.loader.validation import eval_problems
from nestor.parallel.rules import Rules, activation_constrainer


def eval_key(config: Config) -> str:
    """Returns the config key that names the eval data: eval.source for the held-out split, else eval.paths."""
    return "eval.source" if config.eval.source == "heldout" else "eval.paths"


def eval_source(config: Config):
    """Returns the source of the eval batches: the `eval` split of the training shards (`heldout`), or
    `eval.source` reading `eval.paths` (prepared directories: their `train` split).

    Raises ConfigError naming eval.source or eval.paths when the source cannot be read or holds fewer
    tokens than one batch (train.global_batch x (train.seq_len + 1)).
    """
    if problems := eval_problems(config):
        raise ConfigError(problems)
    key = eval_key(config)
    try:
        if config.eval.source == "heldout":
            source = make_source(config, split="eval")
        else:
            data = dataclasses.replace(config.data, source=config.eval.source, paths=config.eval.paths, mixture=())
            source = make_source(dataclasses.replace(config, data=data))
    except ConfigError as error:
        raise ConfigError([(key, message) for _, message in error.problems]) from None
    batch_tokens = config.train.global_batch * (config.train.seq_len + 1)
    # rows of whole conversations (weighted shards) repeat as an epoch does: one conversation is enough
    if source.num_tokens is not None and source.num_tokens < batch_tokens and not getattr(source, "weighted", False):
        raise ConfigError([(key, f"the eval data holds {source.num_tokens} tokens, fewer than one batch of "
                                 f"train.global_batch x (train.seq_len + 1) = {batch_tokens}; give more eval data "
                                 "(a larger --eval-fraction, more eval.paths)")])
    return source


def eval_fields(config: Config) -> dict[str, Field]:
    """Returns the fields of the eval batches (those of `eval.source`'s data; heldout is the training data's)."""
    if config.eval.source == "heldout":
        return batch_fields(config, config.data.source)
    return batch_fields(config, config.eval.source, config.eval.paths, "eval.paths")


def check_eval_fields(config: Config, train_fields: dict[str, Field]) -> None:
    """Raises ConfigError (eval.paths, data.factory) where the eval batches of named arrays (eval.paths, or a
    factory's eval split) would hold other fields, or rows of another shape or dtype, than the training
    batches `train_fields`: before anything compiles, not at the first evaluation."""
    if not config.eval.every:
        return
    if config.eval.source == "arrays":
        key, where = "eval.paths", ", ".join(config.eval.paths)
        rows = {name: (field.shape[1:], field.dtype) for name, field in eval_fields(config).items()}
    elif config.eval.source == "heldout" and config.data.source == "python":
        key, where = "data.factory", f"{config.data.factory}(split='eval')"
        rows = ArraySource.from_factory(config, "eval").example_shapes()
    else:
        return
    wanted = {name: (field.shape[1:], field.dtype) for name, field in train_fields.items()}
    if sorted(rows) != sorted(wanted):
        raise ConfigError([(key, f"{where} holds the fields {sorted(rows)}, the training data {sorted(wanted)}: "
                                 "the model reads the same fields in both")])
    for name, (shape, dtype) in rows.items():
        if (shape, dtype) != wanted[name]:
            raise ConfigError([(key, f"field {name} of {where} has rows of {shape} {dtype}, the training "
                                     f"data's of {wanted[name][0]} {wanted[name][1]}")])


def make_eval_step(config: Config, layout: StateLayout, mesh: Mesh, rules: Rules, backend: Backend | None = None):
    """Returns the jitted eval_step(params, expert_bias, reference, batch) -> (the batch's mean evaluation
    loss, the means of the model's scalar metrics, the batch's weight among batches: its weighted targets'
    count for chat data, else 1), float32 and replicated (`expert_bias`: the state's, or None without
    bias balancing; `reference`: DPO's reference params, or None); with train.grad_accum > 1 the batch runs in that many micro-batches, as in training.
    `backend` defaults to `backend_for(config, mesh)`."""
    backend = backend or backend_for(config, mesh)
    loss_fn = make_loss_fn(layout, mesh, rules, backend, stack_runners(config, mesh, rules, backend), train=False,
                           objective=objective_of(config))
    constrain = activation_constrainer(mesh, rules)
    fields = eval_fields(config)
    accum = config.train.grad_accum

    def micro_loss(params: dict, expert_bias: dict | None, reference: dict | None,
                   batch: dict) -> tuple[jax.Array, dict]:
        loss, metrics = loss_fn(params, constrain_batch(batch, fields, constrain), expert_bias=expert_bias,
                                reference=reference)
        return loss, {name: value for name, value in metrics.items() if jnp.ndim(value) == 0}

    def eval_step(params: dict, expert_bias: dict | None, reference: dict | None,
                  batch: dict) -> tuple[jax.Array, dict, jax.Array]:
        # chat data: the mean over the batch's weighted targets, and their count, which weighs it among batches
        weight = jnp.sum(batch[task.LOSS_WEIGHTS]) if task.LOSS_WEIGHTS in batch else jnp.ones((), jnp.float32)
        batch = task.normalized_weights(batch)
        if accum == 1:
            return (*micro_loss(params, expert_bias, reference, batch), weight)
        per_micro = jax.lax.map(lambda micro: micro_loss(params, expert_bias, reference, micro),
                                micro_batches(batch, accum))
        return (*jax.tree.map(jnp.mean, per_micro), weight)

    return jax.jit(eval_step, in_shardings=(layout.shardings["params"], layout.shardings.get("expert_bias"),
                                            layout.shardings.get(REFERENCE), shardings(fields, mesh, rules)),
                   out_shardings=NamedSharding(mesh, PartitionSpec()))


class Evaluator:
    """Evaluates a train state on the fixed eval batches: `evaluator(state)` -> eval_loss, eval_perplexity
    (where the loss is a token cross-entropy: `StateLayout.perplexity`) and the model's scalar metrics as
    eval_<name>."""

    def __init__(self, config: Config, layout: StateLayout, mesh: Mesh, rules: Rules, backend: Backend | None = None):
        self.config = config
        self.data = DataPipeline(config, mesh, rules, eval_source(config), eval_fields(config))
        self.step_fn = make_eval_step(config, layout, mesh, rules, backend)
        self.perplexity = layout.perplexity

    def due(self, step: int) -> bool:
        """Returns whether training evaluates after `step`: every eval.every-th step and the last."""
        every = self.config.eval.every
        return bool(every) and (step % every == 0 or step == self.config.train.steps)

    def __call__(self, state: dict) -> dict[str, jax.Array]:
        """Returns {eval_loss, eval_perplexity (a token cross-entropy's only), eval_<metric> for each scalar
        metric of the model} (device scalars) of `state`'s parameters (and expert bias) over the eval.steps
        batches."""
        results = [self.step_fn(state["params"], state.get("expert_bias"), state.get(REFERENCE), self.data.batch(index))
                   for index in range(self.config.eval.steps)]
        weights = jnp.stack([weight for *_, weight in results])
        share = weights / jnp.where(weights.sum() > 0, weights.sum(), 1.0)  # chat data: every answer token alike
        loss, metrics = jax.tree.map(lambda *values: jnp.sum(jnp.stack(values) * share),
                                     *[result[:2] for result in results])
        perplexity = {"eval_perplexity": jnp.exp(loss)} if self.perplexity else {}
        return {**{f"eval_{name}": value for name, value in metrics.items()},
                "eval_loss": loss, **perplexity}  # a metric of the model's never hides them
