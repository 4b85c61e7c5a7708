"""How dropless MoE tokens reach experts on other devices: the expert-parallel exchange.

A dropless layer (models.moe) hands over its tokens [T, embed], each token's
k experts and gates, the expert weights, and a function that runs the
assignments to a contiguous range of experts. Here that function runs inside
`jax.shard_map` on every device, for the experts whose weights the device
holds.

The exchange is "all-gather + reduce-scatter" (MaxText's ring of experts):
each device gathers the tokens of every device on the expert axes (with
their assignments), runs those assigned to its own experts through grouped
matmuls into a buffer of (gathered tokens x k) rows, the most it can be
asked for, so every shape is static, and a reduce-scatter over the expert
axes sums each token's outputs from every expert device and returns them to
the token's device. An expert's hidden dimension may be split too (over the
mesh axes of `mlp`): its partial sums join the same reduction. Weights enter
whole along the embedding (fsdp gathers them as for any layer).

Every collective here runs on every backend, CPU included. Exchanging only
the tokens each device needs (`jax.lax.ragged_all_to_all`, GPU and TPU only;
XLA:CPU lacks it) is not built: `exchange_name` says which exchange a mesh gets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from parallel.rules import Rules, partition_spec

ALL_GATHER = "all-gather + reduce-scatter"


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


def exchange_name(mesh: Mesh, rules: Rules, layout: ExpertLayout) -> str:
    """Returns the name of the exchange a dropless layer gets on `mesh` ("none" without expert devices)."""
    expert_axes = _axes(partition_spec((layout.expert,), rules)[0])
    return ALL_GATHER if math.prod(mesh.shape[a] for a in expert_axes) > 1 else "none"


def worst_case_rows(tokens_per_device: int, top_k: int, mesh: Mesh, rules: Rules, layout: ExpertLayout) -> int:
    """Returns the rows of the sorted buffer each device holds for one dropless layer: the tokens of every
    device on the expert axes, k rows each (all of them could be routed to this device's experts)."""
    expert_axes = _axes(partition_spec((layout.expert,), rules)[0])
    return tokens_per_device * math.prod(mesh.shape[a] for a in expert_axes) * top_k


def all_gather_exchange(mesh: Mesh, rules: Rules, layout: ExpertLayout) -> Callable:
    """Returns exchange(local_experts, tokens [T, embed], experts [T, k], gates [T, k], (gate, up, down))
    -> [T, embed] (the models.moe.ExpertExchange interface) as a shard_map over every mesh axis."""
    token_spec = partition_spec((layout.batch, None), rules)
    in_weight = partition_spec((layout.expert, None, layout.hidden), rules)  # gate, up [experts, embed, mlp]
    out_weight = partition_spec((layout.expert, layout.hidden, None), rules)  # down [experts, mlp, embed]
    expert_axes, hidden_axes = _axes(in_weight[0]), _axes(in_weight[2])

    def exchange(local_experts, tokens, experts, gates, weights):
        def on_device(tokens, experts, gates, gate, up, down):
            first_expert = 0
            if expert_axes:
                tokens, experts, gates = (jax.lax.all_gather(x, expert_axes, axis=0, tiled=True)
                                          for x in (tokens, experts, gates))
                first_expert = jax.lax.axis_index(expert_axes) * gate.shape[0]
            outputs = local_experts(tokens, experts, gates, (gate, up, down), first_expert)  # [gathered T, embed]
            if expert_axes:
                outputs = jax.lax.psum_scatter(outputs, expert_axes, scatter_dimension=0, tiled=True)
            return jax.lax.psum(outputs, hidden_axes) if hidden_axes else outputs

        specs = (token_spec, token_spec, token_spec, in_weight, in_weight, out_weight)
        return jax.shard_map(on_device, mesh=mesh, in_specs=specs, out_specs=token_spec, check_vma=False)(
            tokens, experts, gates, *weights)

    return exchange
