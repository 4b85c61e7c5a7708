"""Parameter creation shared by every layer: float32 values named by logical axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


UNNAMED = "unnamed"  # metadata of a variable whose only names are its stack's (models.stack)


def logical_axes_of(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """Returns the logical axis names of a variable's dimensions: nestor's `logical_axes` metadata or the
    names Flax's guides give (`nnx.with_partitioning(init, names)`, `sharding_names=`); None without."""
    metadata = variable.get_metadata()
    for name in ("logical_axes", "out_sharding", "sharding_names"):
        if metadata.get(name):
            return tuple(metadata[name])
    return None


def named_by_model(variable: nnx.Variable) -> bool:
    """Returns whether the model named the variable's dimensions (not only a stack its leading one)."""
    return logical_axes_of(variable) is not None and not variable.get_metadata().get(UNNAMED)


def param(rngs: nnx.Rngs, shape: tuple[int, ...], logical_axes: tuple[str | None, ...], std: float) -> nnx.Param:
    """Returns a float32 normal-initialised parameter named by `logical_axes` (None = never sharded)."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, logical_axes=logical_axes)


def bias(shape: tuple[int, ...], logical_axes: tuple[str | None, ...]) -> nnx.Param:
    """Returns a float32 zero-initialised bias named by `logical_axes`."""
    return nnx.Param(jnp.zeros(shape, jnp.float32), logical_axes=logical_axes)
