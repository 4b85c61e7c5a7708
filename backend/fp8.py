"""Float8 weight matmuls (`model.matmul_precision=fp8`), behind models.ops' einsum and grouped matmul.

Each weight matmul multiplies float8 operands and sums in float32: activations
and weights in e4m3 forward, the output's gradient in e5m2 backward (more
range, less precision), as in Micikevicius et al., "FP8 Formats for Deep
Learning" (arXiv 2209.05433). Scaling is per tensor and current: each operand is
divided by amax / (the format's largest value) as the matmul runs, so the
largest element maps to the format's largest. torchao (torchtitan's float8)
made current ("tensorwise dynamic") scaling its default and removed delayed
scaling, whose amax history costs train state, a warm-up and a checkpointed
state to restore. Nothing is kept between steps, so resuming and resharding
are those of a bfloat16 run. An einsum's amax is the whole tensor's (on a mesh,
a scalar all-reduce before each matmul); a grouped matmul runs inside the expert
exchange's shard_map, so there each device scales the rows and experts it holds.

Only the weight matmuls the model routes through models.ops at its compute
dtype run in float8: attention's softmax and its two products, the logits (a
float32 `out_dtype`), norms and the router stay as they are.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from nestor.models import ops, remat_names

FORWARD = jnp.float8_e4m3fn  # activations and weights
GRADIENT = jnp.float8_e5m2   # the output's gradient


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Returns (x / scale in `dtype`, scale): scale is a float32 scalar, amax(|x|) / dtype's largest value
    (1 for an all-zero x), so x ~ quantized * scale."""
    largest = jnp.array(jnp.finfo(dtype).max, jnp.float32)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / largest, jnp.array(1, jnp.float32))
    return jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype), scale


def ops_in_fp8(base: ops.Ops, grouped: bool = True) -> ops.Ops:
    """Returns `base` with its weight matmuls in float8: the einsum at the compute dtype (one asked for
    another output dtype, the float32 logits, keeps `base`'s), and with `grouped` the grouped matmul."""
    names = dict(base.names, einsum=f"float8 e4m3/e5m2 einsum, current per-tensor scaling (else {base.names['einsum']})")
    in_fp8 = dataclasses.replace(base, einsum=functools.partial(einsum, base.einsum), names=names)
    if not grouped:
        return in_fp8
    return dataclasses.replace(in_fp8, grouped_matmul=grouped_matmul, names=dict(
        names, grouped_matmul="float8 e4m3/e5m2 jax.lax.ragged_dot, current per-tensor scaling"))


def einsum(higher: ops.Einsum, equation: str, x: jax.Array, weight: jax.Array, out_dtype=None) -> jax.Array:
    """Returns `equation` ("x,weight->out", models.ops.operand_indices) of x by weight in float8, in x's dtype;
    with an `out_dtype` other than x's, `higher`'s einsum."""
    if out_dtype is not None and jnp.dtype(out_dtype) != x.dtype:
        return higher(equation, x, weight, out_dtype)
    ops.operand_indices(equation)
    return _einsum(equation, x.dtype, weight.dtype, x, weight)


def _rescaled(product: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Returns a float8 product's float32 sums times its operands' scales, in `dtype`."""
    return (product * scale).astype(dtype)


def _product(equation: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)


# the operands' dtypes are static arguments: the gradients come back in them
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum(equation: str, x_dtype, weight_dtype, x: jax.Array, weight: jax.Array) -> jax.Array:
    return _einsum_forward(equation, x_dtype, weight_dtype, x, weight)[0]


def _einsum_forward(equation, x_dtype, weight_dtype, x, weight):
    (x8, x_scale), (w8, w_scale) = quantize(x, FORWARD), quantize(weight, FORWARD)
    out = _rescaled(_product(equation, x8, w8), x_scale * w_scale, x_dtype)
    # tagged for the remat policies that keep matmul outputs by name
    return checkpoint_name(out, remat_names.MATMUL_SUMS), (x8, x_scale, w8, w_scale)


def _einsum_backward(equation, x_dtype, weight_dtype, saved, gradient):
    x8, x_scale, w8, w_scale = saved
    x_indices, weight_indices, out = ops.operand_indices(equation)
    g8, g_scale = quantize(gradient, GRADIENT)
    return (_rescaled(_product(f"{out},{weight_indices}->{x_indices}", g8, w8), g_scale * w_scale, x_dtype),
            _rescaled(_product(f"{x_indices},{out}->{weight_indices}", x8, g8), x_scale * g_scale, weight_dtype))


_einsum.defvjp(_einsum_forward, _einsum_backward)


def grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Returns jax.lax.ragged_dot(rows [M, K], weights [G, K, N], group_sizes [G]) from float8 operands, in
    rows' dtype (models.ops.GroupedMatmul): rows past the groups are 0."""
    return _grouped(rows.dtype, weights.dtype, rows, weights, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped(rows_dtype, weights_dtype, rows, weights, group_sizes):
    return _grouped_forward(rows_dtype, weights_dtype, rows, weights, group_sizes)[0]


def _grouped_forward(rows_dtype, weights_dtype, rows, weights, group_sizes):
    (r8, r_scale), (w8, w_scale) = quantize(rows, FORWARD), quantize(weights, FORWARD)
    out = _rescaled(jax.lax.ragged_dot(r8, w8, group_sizes, preferred_element_type=jnp.float32), r_scale * w_scale,
                    rows_dtype)
    return checkpoint_name(out, remat_names.MATMUL_SUMS), (r8, r_scale, w8, w_scale, group_sizes)


# the weights' gradient: per group, its rows' transpose times their gradient (rows ragged, no group dimension)
_WEIGHT_GRADIENT = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                                     lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def _grouped_backward(rows_dtype, weights_dtype, saved, gradient):
    r8, r_scale, w8, w_scale, group_sizes = saved
    g8, g_scale = quantize(gradient, GRADIENT)
    rows_gradient = jax.lax.ragged_dot(g8, jnp.swapaxes(w8, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    weights_gradient = jax.lax.ragged_dot_general(r8, g8, group_sizes, _WEIGHT_GRADIENT,
                                                  preferred_element_type=jnp.float32)
    return (_rescaled(rows_gradient, g_scale * w_scale, rows_dtype),
            _rescaled(weights_gradient, r_scale * g_scale, weights_dtype), None)


_grouped.defvjp(_grouped_forward, _grouped_backward)
