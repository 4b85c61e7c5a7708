"""Wiring of context parallelism (parallel.context) into the training job: the sequence layout and attention
the model gets where `mesh.context` splits its rows, and explain's report of them."""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import Mesh

from nestor.backend import Backend
from nestor.models import axes
from nestor.models import ops as model_ops
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.config.degrees import microbatch_rows
from nestor.parallel.context import AttentionAxes, SequenceLayout, context_attention, context_degree, exchange_bytes
from nestor.parallel.rules import Rules, split_degree

# the logical names of attention's operands in models.transformer
ATTENTION_AXES = AttentionAxes(batch=axes.BATCH, length=axes.LENGTH, heads=axes.ACT_HEADS, kv_heads=axes.ACT_KV_HEADS)


def sequence_layout(backend: Backend, mesh: Mesh, rules: Rules) -> SequenceLayout | None:
    """Returns the layout of a row's places on `mesh`'s context devices, or None where rows are not split."""
    degree = context_degree(mesh, rules, ATTENTION_AXES)
    return SequenceLayout(degree, backend.context_balance) if degree > 1 else None


def whole_rows(rules: Rules) -> Rules:
    """Returns `rules` without the mesh axes that split a row's places, wherever they appear (places, MoE
    groups): for decoding and the logits of prompts of any length, where the context devices compute as
    replicas."""
    split = set(rules.get(axes.LENGTH, ()))
    return {name: tuple(axis for axis in mesh_axes if axis not in split) for name, mesh_axes in rules.items()}


def with_context_attention(ops: model_ops.Ops, backend: Backend, mesh: Mesh, rules: Rules,
                           layout: SequenceLayout | None) -> model_ops.Ops:
    """Returns `ops` with the backend's context attention over `layout` (unchanged without one)."""
    if layout is None:
        return ops
    attention = context_attention(backend.context_attention, mesh, rules, ATTENTION_AXES, layout)
    names = {**ops.names, "context_attention": f"{backend.context_attention} over {layout.context} devices"}
    return dataclasses.replace(ops, context_attention=attention, names=names)


def context_report(config: Config, backend: Backend, mesh: Mesh, rules: Rules) -> dict | None:
    """Returns explain's entry for context parallelism (None where rows are not split): the strategy, the
    layout, each device's positions of a row and the bytes of keys and values one device receives per
    attention layer in the forward pass."""
    layout = sequence_layout(backend, mesh, rules)
    if layout is None:
        return None
    m, length = config.model, config.train.seq_len
    degrees = dict(mesh.shape)
    batch_shards, kv_shards = (split_degree(name, rules, degrees) for name in (axes.BATCH, axes.ACT_KV_HEADS))
    rows = microbatch_rows(config, degrees) // batch_shards
    received = exchange_bytes(layout, rows, length, m.num_kv_heads // kv_shards,
                              m.head_dim, np.dtype(m.dtype).itemsize)
    return {"devices": layout.context, "attention": backend.context_attention,
            "layout": "balanced" if layout.balanced else "contiguous",
            "positions_per_device": length // layout.context,
            "pairs_per_device": [layout.visible_pairs(d) for d in range(layout.context)],
            "exchange_bytes_per_layer": received}
