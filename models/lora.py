"""LoRA (arXiv 2106.09685): a frozen weight W [in..., out...] plus a trained low-rank update
scale * A [in..., rank] B [rank, out...], scale = alpha / rank.

The factors take the logical names of the weight's input and output dimensions and a rank dimension
(`axes.LORA_RANK`) that no rule splits, so every adapter is laid out as the weight it adapts, on any
mesh; inside a stack or beside stacked experts they stack the same way. Every adapted matrix runs the
update beside the weight (x W + scale (x A) B), so nothing of W's size is formed or differentiated:
dense projections here (`adapted`), routed experts in models.moe, whose matmuls take the factors of each
expert as they take its weight (`factored`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import zlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from nestor.models import axes, task

SUFFIX = "_lora"  # the adapter of weight `w` is the module attribute `w_lora`, its factors `a` and `b`


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapters of `rank` on the weights named in `targets` (0 = none), scaled by alpha / rank; `dropout`
    drops the adapter's inputs in training."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = ()
    dropout: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.rank > 0 and bool(self.targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapts(self, target: str) -> bool:
        """Returns whether the weight called `target` (models.lora_names.TARGETS) gets an adapter."""
        return self.enabled and target in self.targets


class Adapter(nnx.Param):
    """A LoRA factor: the only parameter a LoRA run trains; every other nnx.Param is its frozen base."""


class LowRank(nnx.Module):
    """The adapter of one weight [lead..., in..., out...] (`lead`: stacked experts): factors A [lead..., in...,
    rank] and B [lead..., rank, out...]. A starts as peft's (uniform within 1/sqrt(fan-in)) and B at zero,
    so the adapted model starts as its base."""

    def __init__(self, cfg: LoraConfig, rngs: nnx.Rngs, target: str, inputs: tuple[tuple[int, str], ...],
                 outputs: tuple[tuple[int, str], ...], lead: tuple[tuple[int, str], ...] = ()):
        (lead_shape, lead_axes), (in_shape, in_axes), (out_shape, out_axes) = (
            (tuple(size for size, _ in dims), tuple(name for _, name in dims)) for dims in (lead, inputs, outputs))
        bound = 1 / math.sqrt(math.prod(in_shape))
        self.salt = zlib.crc32(target.encode()) & 0x7FFFFFFF  # each target draws (and drops) on its own
        # drawn beside the params stream, not from it: the base initialises as it would without adapters
        stream = rngs.params
        key = jax.random.fold_in(jax.random.fold_in(stream.key[...], stream.count[...]), self.salt)
        self.a = Adapter(jax.random.uniform(key, (*lead_shape, *in_shape, cfg.rank), jnp.float32, -bound, bound),
                         logical_axes=(*lead_axes, *in_axes, axes.LORA_RANK))
        self.b = Adapter(jnp.zeros((*lead_shape, cfg.rank, *out_shape), jnp.float32),
                         logical_axes=(*lead_axes, axes.LORA_RANK, *out_axes))
        self.scale = cfg.scale
        self.input_dropout = InputDropout(cfg.dropout, self.salt)
        self.in_dims = len(in_shape)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Returns scale * (x A) B [..., out...] of `x` [..., in...], in x's dtype, x dropped out in training."""
        low = jnp.tensordot(self.input_dropout(x), self.a[...].astype(x.dtype), axes=self.in_dims)  # [..., rank]
        return jnp.tensordot(low, self.b[...].astype(x.dtype), axes=1) * jnp.asarray(self.scale, x.dtype)


@dataclasses.dataclass(frozen=True)
class InputDropout:
    """Drops an adapter's input with probability `rate` in training, drawing from the step's key
    (models.task.step_key) folded with the adapter's `salt`."""

    rate: float
    salt: int

    def __call__(self, x: jax.Array) -> jax.Array:
        """Returns `x` with each element zeroed with probability `rate` and the rest scaled by 1 / (1 - rate)
        in training (with a step key), else `x` itself."""
        key = task.step_key()
        if not (self.rate and task.training() and key is not None):
            return x
        keep = jax.random.bernoulli(jax.random.fold_in(key, self.salt), 1 - self.rate, x.shape)
        return jnp.where(keep, x / (1 - self.rate), 0).astype(x.dtype)


def update(a: jax.Array, b: jax.Array, scale: float, lead: int) -> jax.Array:
    """Returns scale * A B [lead..., in..., out...] of factors A [lead..., in..., rank] and B [lead..., rank,
    out...] whose first `lead` dimensions (stacked layers, experts) pair up."""
    rank, lead_shape = a.shape[-1], a.shape[:lead]
    in_shape, out_shape = a.shape[lead:-1], b.shape[lead + 1:]
    flat = jnp.einsum("...ir,...ro->...io", a.reshape(*lead_shape, -1, rank), b.reshape(*lead_shape, rank, -1))
    return scale * flat.reshape(*lead_shape, *in_shape, *out_shape)


def merged_tree(params: dict, scale: float) -> dict:
    """Returns a params tree (nested dicts) with every adapter (`<weight>_lora`: {a, b}) merged into the
    weight beside it and dropped: the model that computes what the adapted one does, without adapters."""
    result = {}
    for name, value in params.items():
        if name.endswith(SUFFIX):
            continue
        low_rank = params.get(name + SUFFIX)
        if isinstance(value, dict):
            result[name] = merged_tree(value, scale)
        elif low_rank is None:
            result[name] = value
        else:
            a, b = low_rank["a"], low_rank["b"]
            result[name] = value + update(a, b, scale, a.ndim + b.ndim - 2 - value.ndim)
    return result


def adapter(cfg: LoraConfig, rngs: nnx.Rngs, target: str, inputs: tuple[tuple[int, str], ...],
            outputs: tuple[tuple[int, str], ...], lead: tuple[tuple[int, str], ...] = ()) -> LowRank | None:
    """Returns the adapter of the weight called `target` (dims as (size, logical name) pairs) when `cfg`
    targets it, else None."""
    return LowRank(cfg, rngs, target, inputs, outputs, lead) if cfg.adapts(target) else None


_off: contextvars.ContextVar[bool] = contextvars.ContextVar("adapters_off", default=False)


@contextlib.contextmanager
def adapters_off() -> Iterator[None]:
    """Runs the models traced inside the block as their base: every adapter left out (DPO's reference)."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


def adapted(x: jax.Array, base: jax.Array, low_rank: LowRank | None) -> jax.Array:
    """Returns the projection `base` (x W) plus the adapter's update of `x` when there is one (and adapters
    are on)."""
    return base if low_rank is None or _off.get() else base + low_rank(x).astype(base.dtype)


# W [lead..., in, out], A [lead..., in, rank] and scale * B [lead..., rank, out]
Factored = tuple[jax.Array, jax.Array, jax.Array]


def factored(weight: jax.Array, low_rank: LowRank | None) -> jax.Array | Factored:
    """Returns `weight` alone without an adapter (or with adapters off), else (weight, A, scale * B): the
    factors a matmul of its own multiplies by beside the weight's, float32."""
    if low_rank is None or _off.get():
        return weight
    return weight, low_rank.a[...], low_rank.scale * low_rank.b[...]
