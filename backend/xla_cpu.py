"""XLA:CPU's ops for bfloat16: every product from float32 sums rounded once (models.ops' interface).

XLA:CPU runs a bfloat16 x bfloat16 -> bfloat16 dot as a float32 dot of upcast
operands, while bfloat16 in, float32 out runs on its bfloat16 kernels; and it
runs a chain of bfloat16 elementwise operations as float32 ones rounded between
each. So for bfloat16 on CPU the backend installs these (docs/benchmarks.md has
the measurements):

- `einsum`: models.ops.einsum_from_float32_sums for every weight matmul.
- `attention`: jax.nn.dot_product_attention's xla arithmetic (float32
  scores and softmax, grouped-query heads as they are) with every product summed
  in float32 from operands in the inputs' dtype; the backward pass recomputes
  the probabilities from the queries and keys (flash attention's backward,
  arXiv 2205.14135, in one block) and takes sum_s p dp as the context's dot
  product with its gradient (flash attention's D). Its products run on
  head-major copies ([batch, kv_heads, group, length, head_dim]), so XLA:CPU
  writes the scores in the order the softmax reads them.
- `swiglu`: silu(gate) * up computed in float32 and rounded once.

GPUs and TPUs sum in float32 inside a bfloat16 dot already: they keep models.ops' plain ops.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from nestor.models import ops, remat_names


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Returns silu(gate) * up computed in float32 and rounded once to gate's dtype."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def ops_from_float32_sums() -> ops.Ops:
    """Returns the ops of bfloat16 on XLA:CPU: matmuls, attention and SwiGLU from float32 sums."""
    return ops.Ops(einsum=ops.einsum_from_float32_sums, attention=attention, swiglu=swiglu,
                   names={"einsum": "einsum from float32 sums", "attention": "attention (float32 sums)",
                          "swiglu": "silu(gate) * up in float32", "grouped_matmul": "jax.lax.ragged_dot"})


def attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None,
              causal: bool = True) -> jax.Array:
    """Returns `jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=causal)` [batch, length,
    heads, head_dim] with every product (forward and backward) summed in float32 from operands in the
    inputs' dtype, each result rounded once to it.

    query [batch, length, heads, head_dim]; key, value [batch, length, kv_heads, head_dim], query head h
    reading key/value head h // (heads / kv_heads); mask None or boolean [batch or 1, 1, length, length],
    True where query t may see key s (on top of the causal mask, if causal). A row that sees no key gets the mean of
    the values and no gradient to its query or the keys, as in jax.
    """
    if mask is not None and (mask.ndim != 4 or mask.shape[1] != 1):
        raise ValueError(f"mask of shape {mask.shape}: give [batch or 1, 1, length, length]")
    return _attention(query, key, value, mask, causal)


def _head_major(x: jax.Array, kv_heads: int) -> jax.Array:
    """Returns x [batch, length, heads, head_dim] as [batch, kv_heads, heads / kv_heads, length, head_dim]."""
    batch, length, heads, head_dim = x.shape
    return x.reshape(batch, length, kv_heads, heads // kv_heads, head_dim).transpose(0, 2, 3, 1, 4)


def _swap_length_and_heads(x: jax.Array) -> jax.Array:
    """Returns keys or values [batch, length, kv_heads, head_dim] as [batch, kv_heads, length, head_dim], and back."""
    return x.transpose(0, 2, 1, 3)


def _length_major(x: jax.Array) -> jax.Array:
    """Returns x [batch, kv_heads, group, length, head_dim] as [batch, length, kv_heads * group, head_dim]."""
    batch, kv_heads, group, length, head_dim = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(batch, length, kv_heads * group, head_dim)


def _probabilities(query: jax.Array, key: jax.Array, mask: jax.Array | None,
                   causal: bool) -> tuple[jax.Array, jax.Array]:
    """Returns (probabilities [batch, kv_heads, group, length, length] in float32, where query t sees key s)
    of `query` [batch, kv_heads, group, length, head_dim] and `key` [batch, kv_heads, length, head_dim],
    the scores masked and scaled as jax's xla path does."""
    length, head_dim = query.shape[-2:]
    scores = jnp.einsum("bgrtk,bgsk->bgrts", query, key, preferred_element_type=jnp.float32)
    scores = scores * jnp.array(1 / math.sqrt(head_dim), jnp.float32)
    visible = jnp.ones((length, key.shape[2]), bool)
    if causal:
        visible = jnp.tril(visible)
    if mask is not None:
        visible = jnp.logical_and(visible, jnp.asarray(mask)[:, :, None])  # [batch, 1, 1, length, length]
    scores = jnp.where(visible, scores, -0.7 * jnp.finfo(jnp.float32).max)  # jax's "large negative number"
    return jax.nn.softmax(scores, axis=-1), visible


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None, causal: bool) -> jax.Array:
    probabilities, _ = _probabilities(_head_major(query, key.shape[2]), _swap_length_and_heads(key), mask, causal)
    context = jnp.einsum("bgrts,bgsk->bgrtk", probabilities.astype(value.dtype), _swap_length_and_heads(value),
                         preferred_element_type=jnp.float32)
    return _length_major(context).astype(query.dtype)


def _attention_forward(query, key, value, mask, causal):
    # The context under both names, once: `dots` keeps the matmul sums, `minimal` may keep `attention_context`;
    # the output projection's backward pass and this rule's (flash attention's D) read the same kept array.
    context = checkpoint_name(checkpoint_name(_attention(query, key, value, mask, causal), remat_names.MATMUL_SUMS),
                              remat_names.ATTENTION_CONTEXT)
    return context, (query, key, value, mask, context)


def _attention_backward(causal: bool, saved, gradient: jax.Array):
    query, key, value, mask, context = saved
    dtype, scale, kv_heads = query.dtype, 1 / math.sqrt(query.shape[-1]), key.shape[2]
    query_hm = _head_major(query, kv_heads)
    key_hm, value_hm = _swap_length_and_heads(key), _swap_length_and_heads(value)
    probabilities, visible = _probabilities(query_hm, key_hm, mask, causal)
    gradient = _head_major(gradient.astype(dtype), kv_heads)
    # sum_s p dp is the context's dot product with its gradient (flash attention's D, arXiv 2205.14135): a sum
    # over head_dim instead of over the keys
    row_sum = jnp.sum(_head_major(context, kv_heads).astype(jnp.float32) * gradient.astype(jnp.float32), axis=-1,
                      keepdims=True)
    value_gradient = jnp.einsum("bgrts,bgrtk->bgsk", probabilities.astype(dtype), gradient,
                                preferred_element_type=jnp.float32)
    probability_gradient = jnp.einsum("bgrtk,bgsk->bgrts", gradient, value_hm, preferred_element_type=jnp.float32)
    # The softmax's backward pass, in float32: p * (dp - sum_s p dp), scaled as the scores were. Nothing flows
    # to a hidden score: p is 0 there, and a row that sees no key (uniform, as jax's `where`) sends no gradient
    # to its query or the keys (its values still get theirs).
    score_gradient = probabilities * (probability_gradient - row_sum) * jnp.array(scale, jnp.float32)
    if mask is not None:
        score_gradient = score_gradient * jnp.any(visible, axis=-1, keepdims=True)
    score_gradient = score_gradient.astype(dtype)
    query_gradient = jnp.einsum("bgrts,bgsk->bgrtk", score_gradient, key_hm, preferred_element_type=jnp.float32)
    key_gradient = jnp.einsum("bgrts,bgrtk->bgsk", score_gradient, query_hm, preferred_element_type=jnp.float32)
    return (_length_major(query_gradient).astype(dtype), _swap_length_and_heads(key_gradient).astype(key.dtype),
            _swap_length_and_heads(value_gradient).astype(value.dtype), None)


_attention.defvjp(_attention_forward, _attention_backward)
