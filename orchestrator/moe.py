"""Wiring of the MoE layers into the training job: their config, routing key and losses.

The model reports each MoE unit's raw statistics (models.moe); here they
become loss terms and metrics. As in GShard (arXiv 2006.16668), the weighted
load-balancing loss of every MoE layer is added to the LM loss, and so is
ST-MoE's router z-loss (arXiv 2202.08906).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.moe import MoELayerConfig
from orchestrator.config import Config, MoEConfig

Metrics = dict[str, jax.Array]


def moe_layer_config(config: Config) -> MoELayerConfig:
    """Returns the model's MoE settings from the run config's `moe` section."""
    moe = config.moe
    return MoELayerConfig(
        num_experts=moe.num_experts, every=moe.every, top_k=moe.top_k, capacity_factor=moe.capacity_factor,
        eval_capacity_factor=moe.eval_capacity_factor, group_size=moe.group_size,
        second_expert_policy=moe.second_expert_policy, dispatch=moe.dispatch, router=moe.router,
        expert_mlp_dim=moe.expert_mlp_dim, shared_experts=moe.shared_experts,
    )


def routing_key(seed: int, step: jax.Array) -> jax.Array:
    """Returns the key of step `step`'s random routing: a function of (run.seed, step) only,
    so every mesh draws the same numbers (jax's threefry is partitionable)."""
    return jax.random.fold_in(jax.random.key(seed), step)


def moe_loss_and_metrics(stats: dict[str, jax.Array], moe: MoEConfig) -> tuple[jax.Array, Metrics]:
    """Returns (weighted aux + z losses summed over MoE layers, metrics) from stats stacked [units, ...].

    Metrics: `moe_aux_loss`, `moe_z_loss`, `moe_dropped_fraction` (unweighted
    means over MoE layers, so balanced routing reads aux 1.0) and
    `moe_expert_load` [moe layers, experts]: each expert's share of the
    layer's routed assignments (a row sums to 1; even routing is 1/experts).
    A share, not a count, because micro-batches (pipeline, accumulation)
    average their metrics. A dense model gives (0, {}).
    """
    if "moe_aux_loss" not in stats:
        return jnp.zeros((), jnp.float32), {}
    loss = moe.aux_loss_weight * jnp.sum(stats["moe_aux_loss"]) + moe.z_loss_weight * jnp.sum(stats["moe_z_loss"])
    metrics = {name: jnp.mean(stats[name]) for name in ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction")}
    counts = stats["moe_tokens_per_expert"].astype(jnp.float32)
    metrics["moe_expert_load"] = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
    return loss, metrics
