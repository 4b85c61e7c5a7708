"""The contract between a model and the training step (docs/models.md).

A model is a Flax NNX module with a method `loss(batch) -> (loss, metrics)`:
`batch` is a dict of arrays whose leading dimension is the rows of one
(micro-)batch, `loss` a scalar to minimise (a mean over the rows) and
`metrics` a dict of arrays, averaged over micro-batches and logged. Whatever
the model does not decide itself, the step installs for the length of a
call, the way activation constraints and ops are installed: whether it trains
(`training()`) and the micro-batch's random key (`step_key()`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
LOSS_METHOD = "loss"  # the method the step calls: loss(batch) -> (loss, metrics)
# An optional batch field [rows, targets]: each target's weight in the loss (chat data: 1 on the answers). The
# step scales it by `normalized_weights` over the global batch, so that a model whose loss is the mean over
# rows of each row's weighted sum of per-target losses trains on the mean over every weighted target of the
# global batch, however its rows are split (micro-batches, pipeline micro-batches, devices).
LOSS_WEIGHTS = "loss_weights"
# An optional class attribute: True where the loss outside training is a mean cross-entropy over tokens (nestor's
# LM), so that its exponential is a perplexity, which evaluation then reports as eval_perplexity beside eval_loss.
TOKEN_CROSS_ENTROPY = "token_cross_entropy"
# A model that a schedule running the backward pass inside its loop (1F1B and its kin) pipelines also splits
# its loss around the pipelined stack (docs/models.md), so that on a micro-batch
#   loss(batch) == pipeline_output(stack(pipeline_input(batch), pipeline_rows(batch)), batch)
#                  + pipeline_stats_loss(stack stats)
# pipeline_input(batch) -> x: everything before the stack (the first stage runs it);
# pipeline_output(x, batch) -> (loss, metrics): everything after it (the last stage runs it);
# optional: pipeline_rows(batch) -> per-row tensors every block reads unchanged, or None;
# optional: pipeline_stats_loss(stats) -> (loss, metrics), linear in the stack's stats (e.g. moe_losses);
# optional: pipeline_units(name) -> (path of the stack's parameters, layer_fn, stacked inputs), for a model
# whose stack is not a models.stack.Stack.
# optional: pipeline_stack, the name of the stack the split wraps (a config error where pipeline.stack differs).
PIPELINE_METHODS = ("pipeline_input", "pipeline_output")
PIPELINE_STACK = "pipeline_stack"


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What one call of a model's loss is for: training (else evaluation) and its random key."""

    train: bool = True
    key: jax.Array | None = None


_info: contextvars.ContextVar[StepInfo] = contextvars.ContextVar("step_info", default=StepInfo())


@contextlib.contextmanager
def step_info(train: bool, key: jax.Array | None = None) -> Iterator[None]:
    """Installs what the model traced inside the block reads through `training()` and `step_key()`."""
    token = _info.set(StepInfo(train, key))
    try:
        yield
    finally:
        _info.reset(token)


def training() -> bool:
    """Returns whether the model is traced for a training step (False: evaluation, decoding)."""
    return _info.get().train


def step_key() -> jax.Array | None:
    """Returns the random key of this micro-batch (a function of the run's seed, the step and the
    micro-batch), or None where nothing random runs; split or fold it in per use."""
    return _info.get().key


def token_cross_entropy(model: object) -> bool:
    """Returns whether `model` declares its loss a mean cross-entropy over tokens (TOKEN_CROSS_ENTROPY)."""
    return getattr(model, TOKEN_CROSS_ENTROPY, False) is True


def normalized_weights(batch: Batch) -> Batch:
    """Returns `batch` with its LOSS_WEIGHTS (if any) scaled to sum to its row count (all zeros stay zeros):
    the mean over rows of weighted sums is then the weighted mean over targets of the whole batch."""
    if LOSS_WEIGHTS not in batch:
        return batch
    weights = batch[LOSS_WEIGHTS].astype(jax.numpy.float32)
    total = jax.numpy.sum(weights)
    scale = jax.numpy.where(total > 0, weights.shape[0] / jax.numpy.where(total > 0, total, 1.0), 0.0)
    return {**batch, LOSS_WEIGHTS: weights * scale}
