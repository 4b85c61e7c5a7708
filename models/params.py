"""Parameter creation shared by every layer: float32 values named by logical axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape: tuple[int, ...], logical_axes: tuple[str | None, ...], std: float) -> nnx.Param:
    """Returns a float32 normal-initialised parameter named by `logical_axes` (None = never sharded)."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, logical_axes=logical_axes)
