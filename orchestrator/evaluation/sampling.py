"""Decoding from a trained model with a KV cache: prefill the prompt once, then one position per token.

The whole generation is one jitted program: the prompt goes through
`Transformer.decode` at position 0, filling the cache [layers, batch, max_len,
kv_heads, head_dim] (laid out like the keys: batch over the data axes, heads
over tensor), and a `scan` feeds each chosen token back at the next position.
A token is chosen greedily (temperature 0) or drawn from the softmax of
logits / temperature, restricted to the `top_k` likeliest when top_k > 0.
MoE layers route without a capacity limit when sampling (a token decoded
alone never overflows an expert, so the prompt is not cut either): the result
is what the full forward gives on the whole prefix.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nestor.models import axes, ops
from nestor.models.axes import activation_sharding
from nestor.models.transformer import Transformer, TransformerConfig
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.specs.lm import lm_config
from nestor.parallel.rules import Rules, activation_constrainer, partition_spec


def sampling_model_config(config: Config) -> TransformerConfig:
    """Returns the model config for decoding: MoE routing groups of one sequence and an eval capacity of
    every token (capacity factor num_experts / top_k), so no routed token is ever dropped."""
    model = lm_config(config)
    if not model.moe.enabled:
        return model
    dropless = model.moe.num_experts / model.moe.top_k
    return dataclasses.replace(model, moe=dataclasses.replace(model.moe, group_size=0, eval_capacity_factor=dropless))


def sampling_graphdef(config: Config):
    """Returns the structure of the decoding model, to merge with a checkpoint's parameters."""
    model_cfg = sampling_model_config(config)
    return nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(params=0))))[0]


def batch_rows(mesh: Mesh, rules: Rules) -> int:
    """Returns how many devices split the batch dimension (its rows must be a multiple of it)."""
    entry = partition_spec((axes.BATCH,), rules)[0]
    mesh_axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[axis] for axis in mesh_axes)


def choose(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
    """Returns the next token of each row, int32 [batch], from float32 `logits` [batch, vocab]: the argmax at
    temperature 0, else a draw from softmax(logits / temperature) over the `top_k` likeliest (0 = all)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth_largest = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [batch, 1]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def make_generate(graphdef, mesh: Mesh, rules: Rules, model_ops: ops.Ops, max_new_tokens: int,
                  temperature: float = 0.0, top_k: int = 0):
    """Returns the jitted generate(params, prompts int32 [batch, prompt_len], key, expert_bias=None) -> int32
    [batch, max_new_tokens] (replicated): the tokens that follow each prompt (`expert_bias`: the train state's,
    with auxiliary-loss-free balancing), the layers running `model_ops` (the backend's). Compiles once per
    prompt length."""
    constrainer = activation_constrainer(mesh, rules)

    def generate(params: dict, prompts: jax.Array, key: jax.Array, expert_bias: dict | None = None) -> jax.Array:
        model = nnx.merge(graphdef, expert_bias or {}, params)
        batch, prompt_len = prompts.shape
        with activation_sharding(constrainer), ops.installed(model_ops):
            cache = model.init_cache(batch, prompt_len + max_new_tokens)
            logits, cache = model.decode(prompts, cache, jnp.int32(0))
            first = choose(logits[:, -1], jax.random.fold_in(key, 0), temperature, top_k)

            def step(carry, index):
                token, cache = carry
                logits, cache = model.decode(token[:, None], cache, prompt_len + index)
                following = choose(logits[:, -1], jax.random.fold_in(key, index + 1), temperature, top_k)
                return (following, cache), token

            (last, _), tokens = jax.lax.scan(step, (first, cache), jnp.arange(max_new_tokens - 1, dtype=jnp.int32))
        return jnp.concatenate([tokens.T, last[:, None]], axis=1)  # [batch, max_new_tokens]

    return jax.jit(generate, out_shardings=NamedSharding(mesh, PartitionSpec()))
