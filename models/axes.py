"""Logical axis names, defined once, and the hook that constrains activations.

Parameters carry their names as `logical_axes` metadata on `nnx.Param`.
Activations are pinned at block boundaries with `constrain(x, names)`, which
calls whatever constrainer the training job installed with
`activation_sharding(...)` (identity by default), so this package never sees
a mesh.

A row's places need not hold the sequence in order: context parallelism
(parallel.context) lays each device's share out as an early and a late chunk.
A model reads the installed `sequence_layout()`: it `arrange`s its per-place
inputs and targets with it and takes RoPE positions and the causal order from
its `positions` (the natural order when nothing is installed).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

# parameter dimensions
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
NORM = "norm"
BIAS = "bias"  # a bias's own dimension (its heads, if any, are named apart): replicated, never weight-decayed
LAYERS = "layers"
DENSE_LAYERS = "dense_layers"  # the stack of an MoE model's first dense layers
EXPERT = "expert"
LORA_RANK = "lora_rank"  # a LoRA adapter's rank dimension (models.lora): replicated

# activation dimensions
BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_KV_HEADS = "act_kv_heads"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"
ACT_EXPERT = "act_expert"
ACT_GROUP = "act_group"
GROUPS = "groups"  # MoE routing groups [groups, tokens per group, ...] cut from rows [batch, length, ...]

Constrainer = Callable[..., object]


class SequenceLayout(Protocol):
    """Where a row's positions sit: `arrange(x, axis)` reorders places, `positions(length)` names each one's."""

    def arrange(self, x, axis: int = 1): ...

    def positions(self, length: int) -> np.ndarray: ...


class NaturalOrder:
    """Every place holds its own position."""

    def arrange(self, x, axis: int = 1):
        return x

    def positions(self, length: int) -> np.ndarray:
        return np.arange(length, dtype=np.int32)


_layout: contextvars.ContextVar[SequenceLayout] = contextvars.ContextVar("sequence_layout", default=NaturalOrder())


def sequence_layout() -> SequenceLayout:
    """Returns the installed layout of a row's positions (natural order by default)."""
    if (named := _named.get()) is not None:
        named.add(LAYOUT_READ)
    return _layout.get()

_constrainer: contextvars.ContextVar[Constrainer | None] = contextvars.ContextVar("constrainer", default=None)
_named: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("named", default=None)
LAYOUT_READ = "sequence_layout()"  # what `recording` notes where a model reads the layout


def constrain(x, logical_axes: tuple[str | None, ...]):
    """Returns `x` pinned to the layout of `logical_axes` under the installed constrainer."""
    if (named := _named.get()) is not None:
        named.update(name for name in logical_axes if name)
    constrainer = _constrainer.get()
    return x if constrainer is None else constrainer(x, logical_axes)


@contextlib.contextmanager
def collected(into: contextvars.ContextVar[set[str] | None]) -> Iterator[set[str]]:
    """Yields a set that `into` holds inside the block, for the code it runs to note names in."""
    names: set[str] = set()
    token = into.set(names)
    try:
        yield names
    finally:
        into.reset(token)


def recording() -> contextlib.AbstractContextManager[set[str]]:
    """Returns a block that yields the logical axes the activations of the models traced inside it name
    (`constrain`), and LAYOUT_READ where they read the `sequence_layout()`: whether a model's rows split."""
    return collected(_named)


@contextlib.contextmanager
def activation_sharding(constrainer: Constrainer | None, layout: SequenceLayout | None = None) -> Iterator[None]:
    """Installs `constrainer(x, logical_axes) -> x` and the sequence `layout` (default: natural order) for the
    models traced inside the block."""
    tokens = _constrainer.set(constrainer), _layout.set(layout or NaturalOrder())
    try:
        yield
    finally:
        _constrainer.reset(tokens[0])
        _layout.reset(tokens[1])
