"""Direct Preference Optimization (DPO, arXiv 2305.18290): a policy trained to prefer the chosen answer
of each pair over the rejected one, measured against a frozen reference model, with no reward model.

For a pair (prompt + chosen, prompt + rejected), log p is the sum over the answer's tokens (its
completion weights) of log p(token | what precedes it); the loss is
    -log sigmoid(beta * ((log p_policy(chosen) - log p_ref(chosen)) - (log p_policy(rejected) - log p_ref(rejected))))
averaged over the pairs. With LoRA (models.lora) the reference is the policy with its adapters off, so no
second copy of the weights exists; without, it is a model of its own (the frozen start). Either is
computed in the same step and never differentiated.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from nestor.models import lora, task

# a preference batch: each side's tokens [pairs, length + 1] and its completion weights [pairs, length] (1 on
# the answer's targets)
SIDES = ("chosen", "rejected")
FIELDS = tuple(name for side in SIDES for name in (side, f"{side}_weights"))
Forward = Callable[[jax.Array], jax.Array]  # tokens [rows, length] -> float32 logits [rows, length, vocab]


def completion_logps(forward: Forward, tokens: jax.Array, weights: jax.Array) -> jax.Array:
    """Returns each row's summed log-probability [rows] of its weighted targets: tokens[:, 1:] under the
    logits `forward` gives for tokens[:, :-1], weighted by `weights` [rows, length]."""
    logits = forward(tokens[:, :-1]).astype(jnp.float32)
    token_logps = -optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(token_logps * weights, axis=1)


def preference_loss(forward: Forward, batch: task.Batch, beta: float,
                    reference_forward: Forward | None = None) -> tuple[jax.Array, task.Metrics]:
    """Returns (DPO's loss averaged over the batch's pairs, metrics: the rewards' margin, accuracy (the
    chosen answer's reward above the rejected one's), each side's mean reward and log-probability): the
    policy is `forward`, the reference `reference_forward` (default: `forward` with its adapters off)."""
    policy, reference = {}, {}
    for side in SIDES:
        tokens, weights = batch[side], batch[f"{side}_weights"].astype(jnp.float32)
        policy[side] = completion_logps(forward, tokens, weights)
        with lora.adapters_off():
            logps = completion_logps(reference_forward or forward, tokens, weights)
        reference[side] = jax.lax.stop_gradient(logps)
    rewards = {side: beta * (policy[side] - reference[side]) for side in SIDES}
    margins = rewards["chosen"] - rewards["rejected"]  # [pairs]
    loss = jnp.mean(-jax.nn.log_sigmoid(margins))
    return loss, {"dpo_loss": loss, "reward_margin": jnp.mean(margins),
                  "reward_accuracy": jnp.mean((margins > 0).astype(jnp.float32)),
                  "reward_chosen": jnp.mean(rewards["chosen"]), "reward_rejected": jnp.mean(rewards["rejected"]),
                  "logp_chosen": jnp.mean(policy["chosen"]), "logp_rejected": jnp.mean(policy["rejected"])}
