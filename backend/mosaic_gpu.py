"""Grouped matmuls of dropless MoE layers on Hopper GPUs: jax's Pallas Mosaic GPU kernels.

`grouped_matmul_op(implementation)` gives models.ops' grouped matmul: rows
[M, K] sorted by group times their group's weights [G, K, N], rows past the
groups zeros. `xla` is `jax.lax.ragged_dot`, which XLA:GPU compiles as a
product of every row with every group's weights (G times the FLOPs);
`mosaic_gpu` runs jax's Mosaic GPU grouped-GEMM kernels
(`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, the grouped GEMM of
MegaBlocks, arXiv 2211.15841) with the gradient written out: d_rows is the same
kernel against the transposed weights, d_weights `transposed_ragged_dot_mgpu`.
The kernels leave rows past the groups unwritten (both row outputs are masked),
take one dtype (bfloat16 or float16) summing in float32, and need K and N
multiples of 128. Outputs are tagged `remat_names.MATMUL_SUMS` (no
`dot_general` for `dots_saveable` to see).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from nestor.models import ops, remat_names

IMPLEMENTATIONS = ("xla", "mosaic_gpu", "mosaic_gpu_or_xla")
TILE = 128  # the kernels' block along K and N; both must be multiples of it
# Blocks tuned on an H100 with bench.grouped (docs/benchmarks.md): the forward kernel walks 4 column blocks of
# a row block per SM (grid_block_n, kept to a divisor of the column blocks), the weight-gradient kernel 1.
_BLOCKS = dict(block_m=128, block_n=TILE, block_k=64, max_concurrent_steps=4)
_FORWARD_GRID_BLOCK_N = 4


def tiles(in_dim: int, out_dim: int) -> bool:
    """True when a [G, in_dim, out_dim] weight's grouped matmul tiles for the Mosaic GPU kernels."""
    return in_dim % TILE == 0 and out_dim % TILE == 0


def grouped_matmul_op(implementation: str) -> ops.GroupedMatmul:
    """Returns grouped_matmul(rows, weights, group_sizes) of `implementation` (one of IMPLEMENTATIONS):
    `xla` is models.ops.ragged_dot; `mosaic_gpu_or_xla` runs the kernels where they take the dtypes and
    shapes (those of one device, under shard_map), else ragged_dot; `mosaic_gpu` always runs the kernels
    and its op raises ValueError on dtypes or shapes they do not take. Raises ValueError for an unknown
    `implementation`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"grouped matmul implementation {implementation!r}: one of {', '.join(IMPLEMENTATIONS)}")
    if implementation == "xla":
        return ops.ragged_dot

    def grouped_matmul(rows: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
        problem = kernel_problem(rows, weights)
        if problem and implementation == "mosaic_gpu":
            raise ValueError(f"the Mosaic GPU grouped matmul {problem}; use moe.grouped_matmul=xla")
        if problem:
            return ops.ragged_dot(rows, weights, group_sizes)
        return checkpoint_name(kernel_grouped_matmul(mosaic_kernels(), rows, weights, group_sizes),
                               remat_names.MATMUL_SUMS)

    return grouped_matmul


def kernel_problem(rows: jax.Array, weights: jax.Array) -> str | None:
    """Returns why the Mosaic GPU kernels cannot multiply `rows` by `weights`, or None when they can."""
    if rows.dtype != weights.dtype or rows.dtype not in (jnp.bfloat16, jnp.float16):
        return f"takes bfloat16 or float16 rows and weights of one dtype, got {rows.dtype} and {weights.dtype}"
    if not tiles(*weights.shape[1:]):
        return f"needs weights [G, K, N] with K and N multiples of {TILE} on each device, got {weights.shape}"
    return None


def _rows_in_groups(output: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Returns `output` [M, N] with the rows past the last group set to zero."""
    row = jax.lax.broadcasted_iota(jnp.int32, (output.shape[0], 1), 0)
    return jnp.where(row < jnp.sum(group_sizes), output, jnp.zeros((), output.dtype))


# (ragged_dot, transposed_ragged_dot) with the interfaces of jax's Mosaic GPU kernels
Kernels = tuple[Callable[..., jax.Array], Callable[..., jax.Array]]


def mosaic_kernels() -> Kernels:
    """Returns jax's Mosaic GPU (ragged_dot, transposed_ragged_dot), imported when first asked for."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def _rows_times_weights(kernels: Kernels, rows: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                        transpose_weights: bool) -> jax.Array:
    """Returns rows [M, K] x weights [G, K, N] (or x weights [G, N, K] transposed) per group, masked."""
    columns = weights.shape[1] if transpose_weights else weights.shape[2]
    grid_block_n = math.gcd(_FORWARD_GRID_BLOCK_N, columns // TILE)
    output = kernels[0](rows, weights, group_sizes=group_sizes.astype(jnp.int32), transpose_rhs=transpose_weights,
                        grid_block_n=grid_block_n, **_BLOCKS)
    return _rows_in_groups(output, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def kernel_grouped_matmul(kernels: Kernels, rows: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Returns `grouped_matmul(rows, weights, group_sizes)` through `kernels`, differentiable: the gradient
    is the forward kernel against the transposed weights (d_rows) and the transposed kernel (d_weights)."""
    return _rows_times_weights(kernels, rows, weights, group_sizes, False)


def _forward(kernels, rows, weights, group_sizes):
    return _rows_times_weights(kernels, rows, weights, group_sizes, False), (rows, weights, group_sizes)


def _backward(kernels, saved, gradient):
    rows, weights, group_sizes = saved
    d_rows = _rows_times_weights(kernels, gradient, weights, group_sizes, True)  # [M, N] x [G, K, N]^T
    d_weights = kernels[1](rows, gradient, group_sizes=group_sizes.astype(jnp.int32),
                           grid_block_n=1, **_BLOCKS)  # [G, K, N]: each group's rows^T x its gradient rows
    return d_rows, d_weights, None


kernel_grouped_matmul.defvjp(_forward, _backward)
