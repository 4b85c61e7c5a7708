"""How dropless MoE tokens reach experts on other devices: the expert-parallel exchange.

A dropless layer (models.moe) hands over its tokens [T, embed], each token's
k experts and gates, the expert weights (each with its LoRA factors where it
has an adapter, laid out and gathered as the weight), and a function that runs
the assignments to a contiguous range of experts. Here that function runs
inside `jax.shard_map` on every device, for the experts whose weights the
device holds.

Two exchanges (the backend picks one for its target):

"all-gather + reduce-scatter" (MaxText's ring of experts), wherever XLA runs:
each device gathers the tokens of every device on the expert axes (with
their assignments), runs those assigned to its own experts through grouped
matmuls into a buffer of (gathered tokens x k) rows, the most it can be
asked for, so every shape is static, and a reduce-scatter over the expert
axes sums each token's outputs from every expert device and returns them to
the token's device. An expert's hidden dimension may be split too (over the
mesh axes of `mlp`): its partial sums join the same reduction. Weights enter
as they are stored and are gathered along the embedding inside (fsdp), so
their gradient leaves by a reduce-scatter, as a dense layer's does, not by an
all-reduce of every expert's whole gradient.

"ragged all-to-all", where XLA implements `jax.lax.ragged_all_to_all`:
each device sorts its tokens' assignments by expert and sends each expert
device only the rows routed to its experts; the receiver runs them through
its grouped matmuls and sends every row back to where it came from, with the
same call reversed. Only routed rows cross the links (tokens x k x embed each
way, the minimum), and the sizes and offsets the two calls need travel by
small all-to-alls of per-expert counts (`send_plan`, `receive_plan`). The
receive buffer still has room for the worst case (every expert device sends
all its rows here), the same rows as the all-gather exchange's buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from nestor.parallel.rules import Rules, partition_spec, shard_map_here

ALL_GATHER = "all-gather + reduce-scatter"
RAGGED_ALL_TO_ALL = "ragged all-to-all"


def _axes(entry) -> tuple[str, ...]:
    """Returns the mesh axes of one PartitionSpec entry as a tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """The logical names the exchange lays its inputs out by (models name them; parallel maps them)."""

    batch: str    # tokens' leading dimension
    expert: str   # the expert dimension of the expert weights
    hidden: str   # the hidden (mlp) dimension of the expert weights
    embed: str    # the embedding dimension of the expert weights
    rank: str     # the rank dimension of a LoRA adapter's factors (models.lora)


def exchange_name(kind: str, mesh: Mesh, rules: Rules, layout: ExpertLayout) -> str:
    """Returns the name of the exchange a dropless layer gets on `mesh`: `kind` (ALL_GATHER or RAGGED_ALL_TO_ALL),
    or "none" without expert devices."""
    expert_axes = _axes(partition_spec((layout.expert,), rules)[0])
    return kind if math.prod(mesh.shape[a] for a in expert_axes) > 1 else "none"


def expert_exchange(kind: str, mesh: Mesh, rules: Rules, layout: ExpertLayout) -> Callable:
    """Returns the exchange `kind` (ALL_GATHER or RAGGED_ALL_TO_ALL) on `mesh` (the ExpertExchange
    interface of models.moe)."""
    ragged = exchange_name(kind, mesh, rules, layout) == RAGGED_ALL_TO_ALL  # without expert devices: no exchange
    return (ragged_all_to_all_exchange if ragged else all_gather_exchange)(mesh, rules, layout)


def worst_case_rows(tokens_per_device: int, top_k: int, mesh: Mesh, rules: Rules, layout: ExpertLayout) -> int:
    """Returns the rows of the sorted buffer each device holds for one dropless layer: the tokens of every
    device on the expert axes, k rows each (all of them could be routed to this device's experts)."""
    expert_axes = _axes(partition_spec((layout.expert,), rules)[0])
    return tokens_per_device * math.prod(mesh.shape[a] for a in expert_axes) * top_k


def _matrix_names(matrix, inputs: str, outputs: str, layout: ExpertLayout):
    """Returns the logical names of an expert matrix's arrays: (expert, inputs, outputs) of a weight, and
    those of its LoRA factors A (expert, inputs, rank) and B (expert, rank, outputs) beside it where the
    matrix is (weight, A, B) (models.moe.ExpertMatrix)."""
    weight = (layout.expert, inputs, outputs)
    if not isinstance(matrix, tuple):
        return weight
    return weight, (layout.expert, inputs, layout.rank), (layout.expert, layout.rank, outputs)


def _shard_map_specs(mesh: Mesh, rules: Rules, layout: ExpertLayout,
                     weights: tuple) -> tuple[tuple, tuple[str, ...], tuple[str, ...], Callable]:
    """Returns (in_specs of (tokens, experts, gates, gate, up, down), the expert axes, the hidden axes,
    whole(weights, dtype) -> the weights gathered along the embedding inside the shard_map); the gate, up
    and down matrices of `weights` may each carry LoRA factors, laid out as their weight."""
    gate, up, down = weights
    names = (_matrix_names(gate, layout.embed, layout.hidden, layout),
             _matrix_names(up, layout.embed, layout.hidden, layout),
             _matrix_names(down, layout.hidden, layout.embed, layout))
    is_names = lambda node: isinstance(node, tuple) and all(isinstance(name, str) for name in node)  # noqa: E731
    token_spec = partition_spec((layout.batch, None), rules)
    specs = (token_spec, token_spec, token_spec, *jax.tree.map(lambda n: partition_spec(n, rules), names,
                                                               is_leaf=is_names))
    in_weight = partition_spec((layout.expert, layout.embed, layout.hidden), rules)
    embed_axes = tuple(axis for axis in _axes(in_weight[1]) if mesh.shape[axis] > 1)

    def gathered(array, array_names, dtype):
        if not embed_axes or layout.embed not in array_names:
            return array
        return _gathered(array, embed_axes, array_names.index(layout.embed), dtype, array.dtype)

    def whole(weights, dtype):
        return jax.tree.map(lambda array, n: gathered(array, n, dtype), tuple(weights), names)

    return specs, _axes(in_weight[0]), _axes(in_weight[2]), whole


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gathered(shard: jax.Array, axes: tuple[str, ...], axis: int, dtype, stored_dtype) -> jax.Array:
    """Returns the weight whose slice along `axis` this device stores, gathered over `axes` in `dtype` (the
    compute dtype: each device casts only its slice, and half the bytes travel); its gradient comes back
    to the slices by a reduce-scatter in `stored_dtype` (the shard's), so gradients are summed in float32 as a dense
    layer's are. Inside a shard_map."""
    return jax.lax.all_gather(shard.astype(dtype), axes, axis=axis, tiled=True)


def _gathered_forward(shard, axes, axis, dtype, stored_dtype):
    return _gathered(shard, axes, axis, dtype, stored_dtype), None


def _gathered_backward(axes, axis, dtype, stored_dtype, _, gradient):
    return (jax.lax.psum_scatter(gradient.astype(stored_dtype), axes, scatter_dimension=axis, tiled=True),)


_gathered.defvjp(_gathered_forward, _gathered_backward)


def all_gather_exchange(mesh: Mesh, rules: Rules, layout: ExpertLayout) -> Callable:
    """Returns exchange(local_experts, tokens [T, embed], experts [T, k], gates [T, k], (gate, up, down))
    -> [T, embed] (the models.moe.ExpertExchange interface) as a shard_map over every mesh axis (`shard_map_here`)."""
    def exchange(local_experts, tokens, experts, gates, weights):
        specs, expert_axes, hidden_axes, whole = _shard_map_specs(mesh, rules, layout, weights)

        def on_device(tokens, experts, gates, *weights):
            weights = whole(weights, tokens.dtype)
            first_expert = 0
            if expert_axes:
                tokens, experts, gates = (jax.lax.all_gather(x, expert_axes, axis=0, tiled=True)
                                          for x in (tokens, experts, gates))
                first_expert = jax.lax.axis_index(expert_axes) * _local_experts(weights)
            outputs = local_experts(tokens, experts, gates, weights, first_expert)  # [gathered T, embed]
            if expert_axes:
                outputs = jax.lax.psum_scatter(outputs, expert_axes, scatter_dimension=0, tiled=True)
            return jax.lax.psum(outputs, hidden_axes) if hidden_axes else outputs

        return shard_map_here(on_device, mesh, specs, specs[0])(tokens, experts, gates, *weights)

    return exchange


def _local_experts(weights) -> int:
    """Returns how many experts the weights on this device hold: the leading dimension of the first."""
    return jax.tree.leaves(weights)[0].shape[0]


def exclusive_cumsum(sizes: jax.Array) -> jax.Array:
    """Returns the offsets at which consecutive blocks of `sizes` (1-D) start: [0, s0, s0 + s1, ...]."""
    return jnp.cumsum(sizes) - sizes


def send_plan(expert_counts: jax.Array, devices: int) -> tuple[jax.Array, jax.Array]:
    """Returns (input_offsets [devices], send_sizes [devices]) of a device's rows sorted by expert, given
    its rows per expert `expert_counts` [experts]; experts lie in equal contiguous blocks, one per device
    (device d holds experts d x n .. d x n + n - 1), so device d's rows are one slice of the sorted rows."""
    send_sizes = jnp.sum(expert_counts.reshape(devices, -1), axis=1)
    return exclusive_cumsum(send_sizes), send_sizes


def receive_plan(received_counts: jax.Array, buffer_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (receive_offsets [sources], recv_sizes [sources], row_experts [buffer_rows]) of a device
    that gets `received_counts` [sources, local experts] rows from each source for each of its experts.

    Sources write one after the other from row 0, each its rows sorted by
    expert, so the buffer is the (source, expert) blocks in order; `row_experts`
    is each row's local expert, the number of local experts past the last
    received row.
    """
    local_experts = received_counts.shape[1]
    recv_sizes = jnp.sum(received_counts, axis=1)
    block_ends = jnp.cumsum(received_counts.reshape(-1))  # [sources x local experts]
    block = jnp.searchsorted(block_ends, jnp.arange(buffer_rows, dtype=block_ends.dtype), side="right")
    row_experts = jnp.where(block < block_ends.size, block % local_experts, local_experts).astype(jnp.int32)
    return exclusive_cumsum(recv_sizes), recv_sizes, row_experts


def ragged_all_to_all_exchange(mesh: Mesh, rules: Rules, layout: ExpertLayout) -> Callable:
    """Returns exchange(local_experts, tokens [T, embed], experts [T, k], gates [T, k], (gate, up, down))
    -> [T, embed] (the models.moe.ExpertExchange interface) as a shard_map over every mesh axis, moving
    only routed rows with `jax.lax.ragged_all_to_all` (where XLA implements it)."""
    def exchange(local_experts, tokens, experts, gates, weights):
        specs, expert_axes, hidden_axes, whole = _shard_map_specs(mesh, rules, layout, weights)
        devices = math.prod(mesh.shape[a] for a in expert_axes)

        def on_device(tokens, experts, gates, *weights):
            weights = whole(weights, tokens.dtype)
            num_tokens, top_k = experts.shape
            local = _local_experts(weights)
            assignments = experts.reshape(-1)  # [T x k] global expert; routed nowhere: experts x devices
            order = jnp.argsort(assignments, stable=True)
            position = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
            counts = jnp.bincount(assignments, length=local * devices).astype(jnp.int32)  # [experts]
            input_offsets, send_sizes = send_plan(counts, devices)
            # received_counts[source, e]: the rows source sends for this device's expert e
            received_counts = jax.lax.all_to_all(counts.reshape(devices, local), expert_axes, 0, 0, tiled=True)
            buffer_rows = num_tokens * top_k * devices
            receive_offsets, recv_sizes, row_experts = receive_plan(received_counts, buffer_rows)
            output_offsets = jax.lax.all_to_all(receive_offsets, expert_axes, 0, 0, tiled=True)
            rows = tokens[order // top_k]  # [T x k, embed] sorted by expert
            received = jax.lax.ragged_all_to_all(
                rows, jnp.zeros((buffer_rows, rows.shape[1]), rows.dtype), input_offsets, send_sizes,
                output_offsets, recv_sizes, axis_name=expert_axes)  # [buffer rows, embed]
            first_expert = jax.lax.axis_index(expert_axes) * local
            outputs = local_experts(received, (row_experts + first_expert)[:, None],
                                    jnp.ones((buffer_rows, 1), rows.dtype), weights, first_expert)
            returned = jax.lax.ragged_all_to_all(
                outputs, jnp.zeros_like(rows), receive_offsets, recv_sizes,
                jax.lax.all_to_all(input_offsets, expert_axes, 0, 0, tiled=True), send_sizes,
                axis_name=expert_axes)  # [T x k, embed] sorted by expert; rows routed nowhere stay zero
            outputs = jnp.einsum("tk,tkm->tm", gates, returned[position].reshape(num_tokens, top_k, -1))
            return jax.lax.psum(outputs, hidden_axes) if hidden_axes else outputs

        return shard_map_here(on_device, mesh, specs, specs[0])(tokens, experts, gates, *weights)

    return exchange
