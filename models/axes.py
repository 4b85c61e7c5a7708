"""Logical axis names, defined once, and the hook that constrains activations.

Parameters carry their names as `logical_axes` metadata on `nnx.Param`.
Activations are pinned at block boundaries with `constrain(x, names)`, which
calls whatever constrainer the training job installed with
`activation_sharding(...)` (identity by default), so this package never sees
a mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

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

Constrainer = Callable[..., object]

_constrainer: contextvars.ContextVar[Constrainer | None] = contextvars.ContextVar("constrainer", default=None)


def constrain(x, logical_axes: tuple[str | None, ...]):
    """Returns `x` pinned to the layout of `logical_axes` under the installed constrainer."""
    constrainer = _constrainer.get()
    return x if constrainer is None else constrainer(x, logical_axes)


@contextlib.contextmanager
def activation_sharding(constrainer: Constrainer | None) -> Iterator[None]:
    """Installs `constrainer(x, logical_axes) -> x` for the models traced inside the block."""
    token = _constrainer.set(constrainer)
    try:
        yield
    finally:
        _constrainer.reset(token)
