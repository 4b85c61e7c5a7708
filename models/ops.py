"""The array operations a layer asks for by what they compute, whoever supplies them.

A layer multiplies activations by weights with `einsum`, runs causal attention
with `attention`, SwiGLU's hidden activation with `swiglu`, and a dropless
MoE layer's grouped matmuls with `grouped_matmul`. Each calls the `Ops` that
the training job installed with `installed(...)` (as activation constraints
are installed, models.axes), or the plain jax ops below when none is: the
same math on every platform. Which kernel or numerical variant runs where is
the backend's decision (nestor.backend), never a layer's.

Every op tags the tensors a remat policy may keep by name (models.remat_names).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from nestor.models import remat_names
from nestor.models.axes import collected

# einsum(equation, x, weight, out_dtype=None) -> out: "x,weight->out" in x's dtype, or in out_dtype
Einsum = Callable[..., jax.Array]
# attention(query [b, t, heads, k], key [b, t, kv_heads, k], value, mask None | [b or 1, 1, t, t]) -> [b, t, heads, k]
Attention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None, bool], jax.Array]
# context_attention(query, key, value, segment_ids [b, t] | None, positions [t]) -> [b, t, heads, k]: causal
# attention within segments over rows whose places are split between devices (parallel.context)
ContextAttention = Callable[..., jax.Array]
Swiglu = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> silu(gate) * up
# grouped_matmul(rows [M, K] sorted by group, weights [G, K, N], group_sizes [G]) -> [M, N], rows past the groups 0
GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def operand_indices(equation: str) -> tuple[str, str, str]:
    """Returns the indices (x, weight, out) of "x,weight->out"; raises ValueError when one of x's or
    weight's is in neither of the other two (the backward pass would not be two einsums of the same kind)."""
    inputs, arrow, out = equation.replace(" ", "").partition("->")
    x_indices, comma, weight_indices = inputs.partition(",")
    letters = lambda indices: set(indices.replace("...", ""))  # noqa: E731
    if not (arrow and comma) or letters(x_indices) - letters(weight_indices + out) \
            or letters(weight_indices) - letters(x_indices + out):
        raise ValueError(f"einsum {equation!r}: write 'x,weight->out' with every index of an operand in the "
                         "other operand or in the output")
    return x_indices, weight_indices, out


def einsum_from_float32_sums(equation: str, x: jax.Array, weight: jax.Array,
                             out_dtype: jnp.dtype | None = None) -> jax.Array:
    """Returns `jnp.einsum(equation, x, weight)` from the matmul's float32 sums rounded once to `out_dtype`
    (default x's dtype); its backward pass runs its two matmuls on the gradient in the operands' dtype
    (see `_gradient_dtype`), where autodiff would hand them a float32 cotangent. The output is tagged
    `remat_names.MATMUL_SUMS` (jax's `dots_saveable` does not see a custom rule's dot). Raises
    ValueError for an equation not of the form "x,weight->out" (`operand_indices`)."""
    operand_indices(equation)
    return _float32_sums(equation, x, weight, jnp.dtype(out_dtype or x.dtype))


def plain_einsum(equation: str, x: jax.Array, weight: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """Returns `jnp.einsum(equation, x, weight)` in x's dtype; an `out_dtype` other than x's (the float32
    logits) comes from `einsum_from_float32_sums`."""
    if out_dtype is None or jnp.dtype(out_dtype) == x.dtype:
        operand_indices(equation)
        return jnp.einsum(equation, x, weight)
    return einsum_from_float32_sums(equation, x, weight, out_dtype)


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
    x_indices, weight_indices, out = operand_indices(equation)
    dtype = _gradient_dtype(x, weight, out_dtype)
    gradient, x_in, weight_in = (value.astype(dtype) for value in (gradient, x, weight))
    x_gradient = jnp.einsum(f"{out},{weight_indices}->{x_indices}", gradient, weight_in,
                            preferred_element_type=jnp.float32)
    weight_gradient = jnp.einsum(f"{x_indices},{out}->{weight_indices}", x_in, gradient,
                                 preferred_element_type=jnp.float32)
    return x_gradient.astype(x.dtype), weight_gradient.astype(weight.dtype)


_float32_sums.defvjp(_forward, _backward)


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None,
                          causal: bool = True, *, implementation: str | None = None) -> jax.Array:
    """Returns `jax.nn.dot_product_attention`'s attention, causal or not, with `implementation` (None: jax's
    choice), its context tagged `remat_names.ATTENTION_CONTEXT`."""
    context = jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=causal,
                                           implementation=implementation)
    return checkpoint_name(context, remat_names.ATTENTION_CONTEXT)


def plain_swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Returns silu(gate) * up in the operands' dtype."""
    return jax.nn.silu(gate) * up


def ragged_dot(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Returns `jax.lax.ragged_dot(rows, weights, group_sizes)` tagged `remat_names.MATMUL_SUMS` (jax's
    `dots_saveable` does not see ragged_dot; the name lets `dots` keep it as it keeps every matmul)."""
    return checkpoint_name(jax.lax.ragged_dot(rows, weights, group_sizes), remat_names.MATMUL_SUMS)


@dataclasses.dataclass(frozen=True)
class Ops:
    """The operations layers call; `name` says, for reports, what each runs."""

    einsum: Einsum = plain_einsum
    attention: Attention = dot_product_attention
    swiglu: Swiglu = plain_swiglu
    grouped_matmul: GroupedMatmul = ragged_dot
    context_attention: ContextAttention | None = None  # installed where a row's places span devices
    names: dict = dataclasses.field(default_factory=lambda: {
        "einsum": "jnp.einsum", "attention": "jax.nn.dot_product_attention (xla)",
        "swiglu": "silu(gate) * up", "grouped_matmul": "jax.lax.ragged_dot"})


PLAIN = Ops()
_ops: contextvars.ContextVar[Ops] = contextvars.ContextVar("ops", default=PLAIN)
_called: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("ops_called", default=None)


@contextlib.contextmanager
def installed(ops: Ops) -> Iterator[None]:
    """Installs `ops` for the layers traced inside the block. A custom gradient rule's backward pass is
    traced after the block: it must not call these functions, only its own ops (none does)."""
    token = _ops.set(ops)
    try:
        yield
    finally:
        _ops.reset(token)


def recording() -> contextlib.AbstractContextManager[set[str]]:
    """Returns a block that yields the names of the ops (einsum, attention, swiglu, grouped_matmul) the layers
    traced inside it call: which of the backend's choices apply to a model."""
    return collected(_called)


def _installed(name: str) -> Ops:
    """Returns the installed ops, noting that op `name` is called where a `recording` block is open."""
    if (called := _called.get()) is not None:
        called.add(name)
    return _ops.get()


def einsum(equation: str, x: jax.Array, weight: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """Returns the installed einsum of activations `x` by `weight`: "x,weight->out", every index of an
    operand in the other operand or in the output, in x's dtype or `out_dtype`."""
    return _installed("einsum").einsum(equation, x, weight, out_dtype)


def attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None, *,
              causal: bool = True, segment_ids: jax.Array | None = None,
              positions: np.ndarray | None = None) -> jax.Array:
    """Returns the installed attention [batch, length, heads, head_dim] (see `Attention`): causal, or every
    query seeing every key (`causal=False`), within `mask`; with `segment_ids` [batch, length] no query sees a
    key of another segment. `positions` [length] (default 0, 1, ...) give each place's position in the
    sequence (models.axes.sequence_layout), which the causal order follows. Causal self-attention given its
    `positions` and no `mask` runs as the installed context attention where one is (rows split between
    devices); its context is tagged `remat_names.ATTENTION_CONTEXT`."""
    installed = _installed("attention")
    if installed.context_attention is not None and causal and mask is None and positions is not None:
        context = installed.context_attention(query, key, value, segment_ids, positions)
        return checkpoint_name(context, remat_names.ATTENTION_CONTEXT)
    length = query.shape[1]
    if positions is None:
        positions = np.arange(length, dtype=np.int32)
    if segment_ids is not None:
        documents = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [b, 1, t, t]
        mask = documents if mask is None else mask & documents
    if causal and not np.array_equal(positions, np.arange(length)):
        order = jnp.asarray(positions[:, None] >= positions[None, :])[None, None]
        mask, causal = (order if mask is None else mask & order), False
    return installed.attention(query, key, value, mask, causal)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Returns the installed SwiGLU hidden activation silu(gate) * up."""
    return _installed("swiglu").swiglu(gate, up)


def grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Returns the installed grouped matmul [M, N] (see `GroupedMatmul`)."""
    return _installed("grouped_matmul").grouped_matmul(rows, weights, group_sizes)
