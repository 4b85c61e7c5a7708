"""Matmuls of activations by weights, and attention, from float32 sums rounded once.

`einsum(equation, x, weight)` is `jnp.einsum` in the operands' dtype, unless
`float32_outputs`: then the matmul returns its float32 sums
(`preferred_element_type`), rounded once to the activations' dtype (or to
`out_dtype`), and the backward pass does the same for its two matmuls, on
the gradient in the compute dtype.

Why: XLA:CPU of jax 0.10 runs a bfloat16 x bfloat16 -> bfloat16 dot as a
float32 dot of upcast operands (a 1024^3 matmul 5.4-5.7 ms against 2.3-2.6
ms with float32 outputs, docs/benchmarks.md), while bfloat16 in, float32 out
runs on its bfloat16 kernels; jax 0.11's XLA runs both in 2.3-2.8 ms. GPUs
and TPUs sum in float32 inside a bfloat16 dot already, and float32 outputs
there would add memory traffic no one has measured, so the model asks for
them in bfloat16 on CPU only (`TransformerConfig.float32_matmul_outputs`),
and for the float32 logits everywhere. Autodiff of a float32-output einsum
would hand its float32 cotangent to the backward matmuls, which then run at
float32 rates, hence the custom backward pass. The forward output is tagged
`remat_names.MATMUL_SUMS`: the custom rule hides its dot from
`dots_saveable`, and the name lets `dots` keep it in the compute dtype.

`causal_attention(query, key, value, mask)` is jax.nn.dot_product_attention's
xla implementation (float32 scores and softmax, grouped-query heads as they
are) for the same reason: there the probabilities x values product is a
bfloat16 -> bfloat16 dot and the backward products take the float32
gradient of the scores, 5 of its 6 dots upcast on jax 0.10's XLA:CPU. Here
all of them take bfloat16 operands and sum in float32; the backward pass
recomputes the probabilities from the queries and keys (flash attention's
backward, arXiv 2205.14135, in one block) instead of keeping the
[batch, heads, length, length] scores, and `dots` keeps the context by name.
Its products run on head-major copies of the queries, keys and values
([batch, kv_heads, group, length, head_dim]): XLA:CPU then writes the scores
in the order the softmax reads them, where from the [batch, length, heads,
head_dim] operands it transposed every [length, length] block after the dot
(the forward pass 2.1-2.7x faster at issue 12's CPU shapes, batch 1 and 8).
The softmax's backward pass takes sum_s p dp as the context's dot product
with its gradient (flash attention's D): a sum over head_dim instead of over
the keys: that expression alone 3.9 against 0.48 ms there at batch 8.

`attention(..., float32_outputs=...)` picks it or jax.nn.dot_product_attention,
as `einsum` picks its sums: the model's layers (and bench.step's bare step)
ask for float32 outputs in bfloat16 on CPU; decoding (no backward pass) always
calls jax.nn.dot_product_attention.

`swiglu(gate, up, float32=...)` is SwiGLU's silu(gate) * up; with `float32`
(which the model's dense, expert and grouped SwiGLUs ask for where its
weight matmuls return float32 sums: bfloat16 on CPU) computed in float32
and rounded once: XLA:CPU, 0.10 and 0.11 alike, runs a chain of bfloat16 elementwise
operations as float32 ones rounded between each, 2.4-2.8x slower than the
float32 chain for a [2048, 1024] gate, and less accurate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from models import remat_names


def einsum(equation: str, x: jax.Array, weight: jax.Array, out_dtype: jnp.dtype | None = None, *,
           float32_outputs: bool) -> jax.Array:
    """Returns `jnp.einsum(equation, x, weight)`: with `float32_outputs`, from the matmul's float32 sums
    rounded once to `out_dtype` (default x's dtype); without, as jnp.einsum gives it.

    `equation` is "x,weight->out" with explicit output indices, every index of
    one operand found in the other or in the output (the backward pass is two
    einsums of the same kind). Raises ValueError for an equation of another
    form, or for an `out_dtype` without `float32_outputs`.
    """
    _operand_indices(equation)
    if float32_outputs:
        return _float32_sums(equation, x, weight, jnp.dtype(out_dtype or x.dtype))
    if out_dtype is not None:
        raise ValueError(f"out_dtype={out_dtype} needs float32_outputs: the plain einsum keeps its operands' dtype")
    return jnp.einsum(equation, x, weight)


def swiglu(gate: jax.Array, up: jax.Array, *, float32: bool) -> jax.Array:
    """Returns silu(gate) * up (SwiGLU's hidden activation); with `float32`, computed in float32 and rounded once."""
    if float32:
        return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)
    return jax.nn.silu(gate) * up


def weight_einsum(float32_outputs: bool) -> Callable[..., jax.Array]:
    """Returns `einsum` with `float32_outputs` fixed: what a layer calls for its weight matmuls."""
    return functools.partial(einsum, float32_outputs=float32_outputs)


def _operand_indices(equation: str) -> tuple[str, str, str]:
    """Returns the indices (x, weight, out) of "x,weight->out"; raises ValueError when one of x's or
    weight's is in neither of the other two."""
    inputs, arrow, out = equation.replace(" ", "").partition("->")
    x_indices, comma, weight_indices = inputs.partition(",")
    letters = lambda indices: set(indices.replace("...", ""))  # noqa: E731
    if not (arrow and comma) or letters(x_indices) - letters(weight_indices + out) \
            or letters(weight_indices) - letters(x_indices + out):
        raise ValueError(f"einsum {equation!r}: write 'x,weight->out' with every index of an operand in the "
                         "other operand or in the output")
    return x_indices, weight_indices, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _float32_sums(equation: str, x: jax.Array, weight: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    return jnp.einsum(equation, x, weight, preferred_element_type=jnp.float32).astype(out_dtype)


def _forward(equation: str, x: jax.Array, weight: jax.Array, out_dtype: jnp.dtype):
    return checkpoint_name(_float32_sums(equation, x, weight, out_dtype), remat_names.MATMUL_SUMS), (x, weight)


def _gradient_dtype(x: jax.Array, weight: jax.Array, out_dtype: jnp.dtype) -> jnp.dtype:
    """Returns the dtype of the backward matmuls' operands.

    bfloat16 operands keep their gradient in bfloat16 even when the output is
    float32 (the logits): bfloat16 has float32's range. float16 has not (a
    float32 output's small gradient terms, the softmax's, would underflow), so
    there only a float16 output's gradient stays float16; float32 stays float32.
    """
    if x.dtype == weight.dtype == jnp.bfloat16:
        return jnp.dtype(jnp.bfloat16)
    if x.dtype == weight.dtype == out_dtype:
        return x.dtype
    return jnp.dtype(jnp.float32)


def _backward(equation: str, out_dtype: jnp.dtype, saved: tuple[jax.Array, jax.Array], gradient: jax.Array):
    x, weight = saved
    x_indices, weight_indices, out = _operand_indices(equation)
    dtype = _gradient_dtype(x, weight, out_dtype)
    gradient, x_in, weight_in = (value.astype(dtype) for value in (gradient, x, weight))
    x_gradient = jnp.einsum(f"{out},{weight_indices}->{x_indices}", gradient, weight_in,
                            preferred_element_type=jnp.float32)
    weight_gradient = jnp.einsum(f"{x_indices},{out}->{weight_indices}", x_in, gradient,
                                 preferred_element_type=jnp.float32)
    return x_gradient.astype(x.dtype), weight_gradient.astype(weight.dtype)


_float32_sums.defvjp(_forward, _backward)


def attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None, *,
              float32_outputs: bool, implementation: str | None = None) -> jax.Array:
    """Returns causal attention [batch, length, heads, head_dim]: with `float32_outputs`,
    `causal_attention`'s; without, `jax.nn.dot_product_attention`'s with `implementation` (xla, cudnn)."""
    context = _chosen_attention(float32_outputs, implementation)[1](query, key, value, mask=mask)
    # causal_attention's rule names its output itself (its backward pass reads the same array)
    return context if float32_outputs else checkpoint_name(context, remat_names.ATTENTION_CONTEXT)


def attention_name(float32_outputs: bool, implementation: str | None) -> str:
    """Returns, for reports, what `attention(..., float32_outputs=, implementation=)` runs: the function's
    name, then in brackets what it runs with."""
    return _chosen_attention(float32_outputs, implementation)[0]


def _chosen_attention(float32_outputs: bool, implementation: str | None) -> tuple[str, Callable[..., jax.Array]]:
    """Returns (its name, f(query, key, value, mask=)): the one choice `attention` and `attention_name` share."""
    if float32_outputs:
        return "causal_attention (float32 sums)", causal_attention
    return (f"jax.nn.dot_product_attention ({implementation})",
            functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation))


def causal_attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Returns `jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=True)` [batch, length,
    heads, head_dim] with every product (forward and backward) summed in float32 from operands in the
    inputs' dtype, each result rounded once to it.

    query [batch, length, heads, head_dim]; key, value [batch, length, kv_heads, head_dim], query head h
    reading key/value head h // (heads / kv_heads); mask None or boolean [batch or 1, 1, length, length],
    True where query t may see key s (on top of the causal mask). A row that sees no key gets the mean of
    the values and no gradient to its query or the keys, as in jax.
    """
    if mask is not None and (mask.ndim != 4 or mask.shape[1] != 1):
        raise ValueError(f"mask of shape {mask.shape}: give [batch or 1, 1, length, length]")
    return _attention(query, key, value, mask)


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


def _probabilities(query: jax.Array, key: jax.Array,
                   mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Returns (probabilities [batch, kv_heads, group, length, length] in float32, where query t sees key s)
    of `query` [batch, kv_heads, group, length, head_dim] and `key` [batch, kv_heads, length, head_dim],
    the scores masked and scaled as jax's xla path does."""
    length, head_dim = query.shape[-2:]
    scores = jnp.einsum("bgrtk,bgsk->bgrts", query, key, preferred_element_type=jnp.float32)
    scores = scores * jnp.array(1 / math.sqrt(head_dim), jnp.float32)
    visible = jnp.tril(jnp.ones((length, key.shape[2]), bool))
    if mask is not None:
        visible = jnp.logical_and(visible, jnp.asarray(mask)[:, :, None])  # [batch, 1, 1, length, length]
    scores = jnp.where(visible, scores, -0.7 * jnp.finfo(jnp.float32).max)  # jax's "large negative number"
    return jax.nn.softmax(scores, axis=-1), visible


@jax.custom_vjp
def _attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None) -> jax.Array:
    probabilities, _ = _probabilities(_head_major(query, key.shape[2]), _swap_length_and_heads(key), mask)
    context = jnp.einsum("bgrts,bgsk->bgrtk", probabilities.astype(value.dtype), _swap_length_and_heads(value),
                         preferred_element_type=jnp.float32)
    return _length_major(context).astype(query.dtype)


def _attention_forward(query, key, value, mask):
    # The context under both names, once: `dots` keeps the matmul sums, `minimal` may keep `attention_context`;
    # the output projection's backward pass and this rule's (flash attention's D) read the same kept array.
    context = checkpoint_name(checkpoint_name(_attention(query, key, value, mask), remat_names.MATMUL_SUMS),
                              remat_names.ATTENTION_CONTEXT)
    return context, (query, key, value, mask, context)


def _attention_backward(saved, gradient: jax.Array):
    query, key, value, mask, context = saved
    dtype, scale, kv_heads = query.dtype, 1 / math.sqrt(query.shape[-1]), key.shape[2]
    query_hm = _head_major(query, kv_heads)
    key_hm, value_hm = _swap_length_and_heads(key), _swap_length_and_heads(value)
    probabilities, visible = _probabilities(query_hm, key_hm, mask)
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
