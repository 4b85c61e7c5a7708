"""Wiring of the MoE layers into the training job: their routing key, exchange, explain's report
and the auxiliary-loss-free balancing of the expert biases between steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nestor.backend import Backend
from nestor.backend.mosaic_gpu import tiles
from nestor.models import axes
from nestor.orchestrator.config.degrees import moe_tokens_per_device
from nestor.parallel.experts import ExpertLayout, exchange_name, expert_exchange, worst_case_rows
from nestor.parallel.rules import Rules, split_degree

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config

EXPERT_BIAS = "moe_expert_bias"
# the logical names of a dropless MoE layer's tokens, expert weights and their adapters (models.moe, models.lora)
EXPERT_LAYOUT = ExpertLayout(batch=axes.GROUPS, expert=axes.EXPERT, hidden=axes.MLP, embed=axes.EMBED,
                             rank=axes.LORA_RANK)

Metrics = dict[str, jax.Array]


def routing_key(seed: int, step: jax.Array) -> jax.Array:
    """Returns the key of step `step`'s random routing: a function of (run.seed, step) only,
    so every mesh draws the same numbers (jax's threefry is partitionable)."""
    return jax.random.fold_in(jax.random.key(seed), step)


def dropless_exchange(backend: Backend, mesh: Mesh, rules: Rules):
    """Returns the installed exchange of dropless layers (models.moe.expert_parallelism) on `mesh`: the
    backend's."""
    return expert_exchange(backend.exchange, mesh, rules, EXPERT_LAYOUT)


def dropless_report(config: Config, backend: Backend, mesh: Mesh, rules: Rules) -> dict | None:
    """Returns explain's entry for dropless MoE layers (None for a dense model or capacity dispatch):
    the expert-parallel exchange the mesh gets, the grouped matmuls the backend's target runs, and
    the worst-case sorted buffer of one layer per device: its rows (every token of the expert devices,
    k times) and their bytes, counting the rows in and out ([rows, embed] each) and the SwiGLU's gate, up
    and hidden ([rows, expert width / mlp shards] each)."""
    moe = config.moe
    if not config.dropless_moe:
        return None
    degrees = dict(mesh.shape)
    rows = worst_case_rows(moe_tokens_per_device(config, degrees), moe.top_k, mesh, rules, EXPERT_LAYOUT)
    mlp_shards = split_degree(axes.MLP, rules, degrees)
    width = (moe.expert_mlp_dim or config.model.mlp_dim) // mlp_shards
    row_bytes = (2 * config.model.embed_dim + 3 * width) * np.dtype(config.model.dtype).itemsize
    matmuls = backend.grouped_matmul
    if matmuls == "mosaic_gpu_or_xla":
        matmuls = "mosaic_gpu" if tiles(config.model.embed_dim, width) else "xla"
    return {"exchange": exchange_name(backend.exchange, mesh, rules, EXPERT_LAYOUT),
            "grouped_matmul": matmuls, "buffer_rows": rows, "buffer_bytes_per_device": rows * row_bytes}


def balanced_expert_bias(expert_bias: dict, expert_load: jax.Array, rate: float) -> dict:
    """Returns the selection biases after one step of auxiliary-loss-free balancing (arXiv 2408.15664):
    each expert's bias moves by `rate` towards balance, b += rate x sign(mean load - load), so an
    overloaded expert is chosen less. `expert_bias` holds one leaf [MoE layers, experts], as
    `expert_load` (each expert's share of its layer's assignments)."""
    step = rate * jnp.sign(jnp.mean(expert_load, axis=-1, keepdims=True) - expert_load)
    return jax.tree.map(lambda bias: bias + step, expert_bias)
