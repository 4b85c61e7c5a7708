"""Mixture-of-Experts feed-forward with GShard routing (arXiv 2006.16668).

Tokens are split into groups; within a group a float32 router (softmax, or
sigmoid as in DeepSeek-V3) picks each token's top-k experts, every expert
takes at most `expert_capacity` tokens per group (first choices are placed
before second choices, each in token order, by a cumulative sum), and tokens
past capacity are dropped: they leave the layer with zero output and travel
on through the residual only.

Routing decides each assignment's (expert, slot) once; three dispatches carry
it out with the same decisions. `einsum` is GShard's: one-hot tensors
`[groups, tokens, experts, capacity]` dispatch and combine by einsum, costing
2 x tokens x experts x capacity x embed FLOPs each. `sort` places tokens by
index: a per-group table of which token fills each of the experts x capacity
slots (the inverse of sorting the assignments by expert and slot) gathers the
expert inputs, and each token gathers back its k outputs, weighted by its
gates; no tensor has both a token and a slot dimension. Either way the layer
is static-shaped and the partitioner turns the change of sharded axis (groups
over the batch devices -> experts over the `expert` devices) into
all-to-alls, as in GShard. Dropless (`capacity_factor` 0, as MegaBlocks,
arXiv 2211.15841) gives every expert room for every token of its group, so
nothing drops: each token's k assignments are sorted by expert and run through
grouped matmuls (models.ops.grouped_matmul over the experts' group sizes) with no
padding slot; whoever runs the model may install, with `expert_parallelism`,
how the sorted tokens reach the experts' devices (parallel.experts). Besides
the output, the layer reports GShard's load-balancing loss, the router z-loss
of ST-MoE (arXiv 2202.08906), the fraction of routed slots dropped and the
tokens routed to each expert.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nestor.models import axes, ops, remat_names, task
from nestor.models.axes import constrain
from nestor.models.lora import Factored, InputDropout, LoraConfig, adapter, factored
from nestor.models.params import param


Stats = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class MoELayerConfig:
    """Routing and capacity of the MoE feed-forward layers; `num_experts=0` is a dense model."""

    num_experts: int = 0
    every: int = 0                    # nestor's LM: the last layer of every `every` layers is MoE
    top_k: int = 2
    capacity_factor: float = 1.25     # training; 0 = dropless (train and eval)
    eval_capacity_factor: float = 2.0
    group_size: int = 0               # tokens per routing group; 0 = one group per sequence
    second_expert_policy: str = "all"  # all | random
    dispatch: str = "sort"            # sort | einsum (GShard's reference)
    router: str = "softmax"           # softmax | sigmoid (scores for selection)
    normalize_gates: bool = True      # k > 1: the chosen experts' gates renormalised to sum to one
    expert_mlp_dim: int = 0           # hidden width of each expert; 0 = the model's mlp_dim
    shared_experts: int = 0           # nestor's LM: always-on experts, one SwiGLU of shared_experts x expert width
    first_dense_layers: int = 0       # nestor's LM: the first layers are dense (DeepSeek-V3); `every` counts the rest
    bias_update_rate: float = 0.0     # > 0: each layer has an `ExpertBias` (auxiliary-loss-free balancing)
    aux_loss_weight: float = 0.01     # of each layer's load-balancing loss in the model's loss
    z_loss_weight: float = 0.001      # of each layer's router z-loss in the model's loss

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0 and self.every > 0

    def expert_width(self, mlp_dim: int) -> int:
        """Returns each expert's hidden width: `expert_mlp_dim`, or the model's `mlp_dim` when it is 0."""
        return self.expert_mlp_dim or mlp_dim

    @property
    def dropless(self) -> bool:
        """True when no token is dropped: grouped matmuls over tokens sorted by expert, no capacity."""
        return self.capacity_factor == 0

    @property
    def needs_routing_key(self) -> bool:
        """True when routing draws random numbers (GShard's random second expert) in training."""
        return self.num_experts > 0 and self.second_expert_policy == "random" and self.top_k > 1


EXPERT_LOAD = "moe_expert_load"  # the metric auxiliary-loss-free balancing moves the expert biases by


def moe_losses(stats: Stats, cfg: MoELayerConfig) -> tuple[jax.Array, Stats]:
    """Returns (weighted aux + z losses summed over MoE layers, metrics) from stats stacked [layers, ...].

    As in GShard (arXiv 2006.16668), every MoE layer's weighted load-balancing
    loss joins the model's loss, and so does ST-MoE's router z-loss (arXiv
    2202.08906). Metrics: `moe_aux_loss`, `moe_z_loss`, `moe_dropped_fraction`
    (unweighted means over MoE layers, so balanced routing reads aux 1.0) and
    `moe_expert_load` [MoE layers, experts]: each expert's share of the layer's
    routed assignments (a row sums to 1), a share rather than a count because
    micro-batches average their metrics. Stats without MoE layers give (0, {}).
    """
    if "moe_aux_loss" not in stats:
        return jnp.zeros((), jnp.float32), {}
    loss = cfg.aux_loss_weight * jnp.sum(stats["moe_aux_loss"]) + cfg.z_loss_weight * jnp.sum(stats["moe_z_loss"])
    metrics = {name: jnp.mean(stats[name]) for name in ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction")}
    counts = stats["moe_tokens_per_expert"].astype(jnp.float32)
    metrics[EXPERT_LOAD] = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
    return loss, metrics


class ExpertBias(nnx.Variable):
    """A per-expert bias added to the router scores for the choice of experts only (never to the gates):
    auxiliary-loss-free load balancing (arXiv 2408.15664). Not a parameter: no gradient reaches it
    and the optimizer never sees it; the training job moves it after each step from the experts' load."""


def expert_capacity(tokens_per_group: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Returns the slots each expert has per group: ceil(k * capacity_factor * tokens_per_group / experts)."""
    return math.ceil(top_k * capacity_factor * tokens_per_group / num_experts)


class Assignment(NamedTuple):
    """Routing decisions, one entry per choice (first choices first), each [groups, tokens]."""
    experts: list[jax.Array]  # int32 expert of the choice
    slots: list[jax.Array]    # int32 slot in that expert's capacity; meaningless where dropped
    kept: list[jax.Array]     # float32 1 where the assignment got a slot, 0 where dropped (or not routed)
    gates: list[jax.Array]    # float32 gate of the choice
    stats: Stats


class Routing(NamedTuple):
    dispatch: jax.Array   # [groups, tokens, experts, capacity] 1 where a token fills a slot
    combine: jax.Array    # [groups, tokens, experts, capacity] the token's gate in that slot
    stats: Stats


def top_k_gates(probs: jax.Array, top_k: int, selection_bias: jax.Array | None = None,
                normalize: bool = True) -> tuple[list[jax.Array], list[jax.Array]]:
    """Returns (experts, gates): per choice, the chosen expert [g, s] (int32) and its gate [g, s].

    `probs` are router scores in [0, 1] (softmax probabilities or sigmoids).
    Choices come in order of score plus `selection_bias` [experts] (none: 0;
    equal scores: the lower expert first); the gates are the scores without
    it. With k > 1 and `normalize` the gates are renormalised
    to sum to one over the chosen experts (GShard's g1 / (g1 + g2), Mixtral's;
    Qwen3-MoE's `norm_topk_prob: false` keeps the scores); with k = 1
    the gate stays the router probability, as in the Switch Transformer (arXiv
    2101.03961), since a renormalised single gate would always be 1 and the
    router would get no gradient from the model's output.
    """
    num_experts = probs.shape[-1]
    remaining = probs if selection_bias is None else probs + selection_bias
    expert_ids = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
    experts, gates = [], []
    for _ in range(top_k):
        # the first expert of the highest score: argmax by max and min, a third of argmax's arithmetic;
        # not jax.lax.top_k, which the partitioner gathers onto every device
        best = jnp.max(remaining, axis=-1, keepdims=True)
        expert = jnp.min(jnp.where(remaining == best, expert_ids, num_experts), axis=-1)  # [groups, tokens]
        experts.append(expert)
        gates.append(jnp.take_along_axis(probs, expert[..., None], axis=-1)[..., 0])
        remaining = jnp.where(expert_ids == expert[..., None], -jnp.inf, remaining)  # leaves the next choices
    if top_k > 1 and normalize:
        total = sum(gates)
        gates = [gate / total for gate in gates]
    return experts, gates


def random_routing(gates: list[jax.Array], key: jax.Array) -> list[jax.Array]:
    """Returns per choice whether it is routed (float32 [g, s], 1 or 0), each later choice kept at random,
    as GShard does for the second expert.

    Choice i (0-based, i >= 1) is kept with probability (i + 1) * gate_i: for
    the second expert that is GShard's 2 * g2; a renormalised (i + 1)-th
    largest gate is at most 1 / (i + 1), so the product is a probability.
    """
    uniforms = jax.random.uniform(key, (len(gates) - 1, *gates[0].shape), jnp.float32)
    routed = [jnp.ones_like(gates[0])]
    for choice in range(1, len(gates)):
        routed.append((uniforms[choice - 1] < (choice + 1) * gates[choice]).astype(jnp.float32))
    return routed


def load_balancing_loss(probs: jax.Array, first_choice: jax.Array) -> jax.Array:
    """Returns GShard's auxiliary loss: mean over experts of (share of tokens whose first
    choice is e) x (mean router probability of e), times experts^2 so uniform routing gives 1.

    Averaged over groups. Only the mean probability carries gradient (the
    shares are counts), which pushes the router towards balance.
    """
    num_experts = probs.shape[-1]
    token_share = jnp.mean(first_choice, axis=1)  # [groups, experts]
    mean_probability = jnp.mean(probs, axis=1)    # [groups, experts]
    return jnp.mean(token_share * mean_probability) * float(num_experts) ** 2  # a Python int overflows int32


def router_z_loss(logits: jax.Array) -> jax.Array:
    """Returns ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2 (keeps logits small)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


def router_scores(logits: jax.Array, router: str) -> tuple[jax.Array, jax.Array]:
    """Returns (scores that select and weigh experts, probabilities [.., experts] for the balancing loss).

    softmax: both are the softmax. sigmoid (DeepSeek-V3, arXiv 2412.19437):
    each expert's score is its own sigmoid, and the balancing loss sees the
    scores normalised to sum to one over the experts, as in its sequence-wise
    auxiliary loss.
    """
    if router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        return scores, scores / jnp.sum(scores, axis=-1, keepdims=True)
    probs = jax.nn.softmax(logits, axis=-1)
    return probs, probs


class Choices(NamedTuple):
    """The experts each token chose, one entry per choice (first choices first), before any capacity."""
    experts: list[jax.Array]  # int32 [groups, tokens] chosen expert
    routed: list[jax.Array]   # float32 [groups, tokens] 1, or 0 where random routing skipped the choice
    gates: list[jax.Array]    # float32 [groups, tokens] gate of the choice
    stats: Stats

    def masks(self, num_experts: int) -> list[jax.Array]:
        """Returns per choice the one-hot routed expert [groups, tokens, experts] (zeros where not routed)."""
        return [jax.nn.one_hot(expert, num_experts, dtype=jnp.float32) * routed[..., None]
                for expert, routed in zip(self.experts, self.routed)]


def choose(logits: jax.Array, *, top_k: int, routing_key: jax.Array | None = None, router: str = "softmax",
           selection_bias: jax.Array | None = None, normalize: bool = True) -> Choices:
    """Returns each token's top-k choices of experts for router `logits` [groups, tokens, experts]: the
    routing decision every dispatch shares, and its statistics (`assign` adds the drops).

    `routing_key` turns on random routing of the later choices (see
    `random_routing`); `router` picks the scores (see `router_scores`);
    `selection_bias` [experts] shifts which experts are chosen (see
    `top_k_gates`), `normalize` whether the gates are renormalised (see
    `top_k_gates`). Statistics: `moe_aux_loss`, `moe_z_loss`,
    `moe_dropped_fraction` (0: nothing is dropped yet) and
    `moe_tokens_per_expert` [experts] (assignments each expert was asked for).
    """
    logits = logits.astype(jnp.float32)
    num_experts = logits.shape[-1]
    scores, probs = router_scores(logits, router)  # [groups, tokens, experts]
    experts, gates = top_k_gates(scores, top_k, selection_bias, normalize)
    if routing_key is not None and top_k > 1:
        routed = random_routing(gates, routing_key)
    else:
        routed = [jnp.ones_like(gate) for gate in gates]
    def count(expert: jax.Array, flag: jax.Array) -> jax.Array:  # one group's [tokens] -> [experts]
        return jnp.zeros((num_experts,), jnp.float32).at[expert].add(flag)

    # counted per group, where the groups live, then summed: no device gathers another's choices
    tokens_per_expert = sum(jnp.sum(jax.vmap(count)(expert, flag), axis=0) for expert, flag in zip(experts, routed))
    stats = {
        "moe_aux_loss": load_balancing_loss(probs, jax.nn.one_hot(experts[0], num_experts, dtype=jnp.float32)),
        "moe_z_loss": router_z_loss(logits),
        "moe_dropped_fraction": jnp.zeros((), jnp.float32),
        "moe_tokens_per_expert": tokens_per_expert,
    }
    return Choices(experts, routed, gates, stats)


def assign(logits: jax.Array, *, top_k: int, capacity: int, routing_key: jax.Array | None = None,
           router: str = "softmax", selection_bias: jax.Array | None = None, normalize: bool = True) -> Assignment:
    """Returns each choice's expert, slot, kept flag and gate, and the statistics, of `choose`'s decisions
    for router `logits` [groups, tokens, experts] (the same keywords).

    Slots are filled choice by choice (every token's first choice before any
    second choice), each in token order; an assignment whose slot would be
    `capacity` or beyond is dropped. `moe_dropped_fraction` is dropped
    assignments / routed assignments (for k = 1 the share of tokens dropped).
    """
    choices = choose(logits, top_k=top_k, routing_key=routing_key, router=router, selection_bias=selection_bias,
                     normalize=normalize)
    gates, stats = choices.gates, choices.stats
    filled = jnp.zeros((logits.shape[0], logits.shape[2]), jnp.float32)  # [groups, experts] slots taken
    experts, slots, kept = [], [], []
    routed = kept_count = 0.0
    for expert, mask in zip(choices.experts, choices.masks(logits.shape[-1])):
        position = jnp.cumsum(mask, axis=1) - 1 + filled[:, None, :]  # [groups, tokens, experts]
        kept_mask = mask * (position < capacity)
        experts.append(expert)
        slots.append(jnp.sum(position * kept_mask, axis=-1).astype(jnp.int32))
        kept.append(jnp.sum(kept_mask, axis=-1))
        filled = filled + jnp.sum(kept_mask, axis=1)
        routed, kept_count = routed + jnp.sum(mask), kept_count + jnp.sum(kept_mask)
    stats = {**stats, "moe_dropped_fraction": 1.0 - kept_count / jnp.maximum(routed, 1.0)}
    return Assignment(experts, slots, kept, gates, stats)


def route(logits: jax.Array, *, top_k: int, capacity: int, routing_key: jax.Array | None = None,
          router: str = "softmax", selection_bias: jax.Array | None = None, normalize: bool = True) -> Routing:
    """Returns GShard's one-hot dispatch and combine tensors, and the statistics, of `assign`'s decisions."""
    assignment = assign(logits, top_k=top_k, capacity=capacity, routing_key=routing_key, router=router,
                        selection_bias=selection_bias, normalize=normalize)
    num_experts = logits.shape[-1]
    dispatch = combine = jnp.zeros((*logits.shape, capacity), jnp.float32)
    for expert, slot, kept, gate in zip(assignment.experts, assignment.slots, assignment.kept, assignment.gates):
        kept_mask = jax.nn.one_hot(expert, num_experts, dtype=jnp.float32) * kept[..., None]  # [g, s, e]
        slot_mask = jax.nn.one_hot(slot, capacity, dtype=jnp.float32)  # [g, s, c]
        choice_dispatch = kept_mask[..., None] * slot_mask[:, :, None, :]  # [groups, tokens, experts, capacity]
        dispatch = dispatch + choice_dispatch
        combine = combine + gate[..., None, None] * choice_dispatch
    return Routing(dispatch, combine, assignment.stats)


def flat_slots(assignment: Assignment, num_experts: int, capacity: int) -> jax.Array:
    """Returns [groups, choices, tokens] int32: each assignment's index into its group's slots flattened
    to [experts x capacity], and experts x capacity (one past the last slot) where it was dropped."""
    return jnp.stack([jnp.where(kept > 0, expert * capacity + slot, num_experts * capacity)
                      for expert, slot, kept in zip(assignment.experts, assignment.slots, assignment.kept)], axis=1)


@jax.custom_vjp
def take_rows(values: jax.Array, rows: jax.Array, readers: jax.Array) -> jax.Array:
    """Returns values[rows] ([len(rows), ...], zeros where a row index is out of range), with a
    backward pass that gathers too: `readers` [len(values), r] lists the output rows that read
    each value row (out of range where fewer than r do), so its gradient is their sum, gathered
    rather than scatter-added (jax's own transpose of a gather).
    """
    return values.at[rows].get(mode="fill", fill_value=0)


def _take_rows_forward(values, rows, readers):
    return take_rows(values, rows, readers), readers


def _take_rows_backward(readers, cotangent):
    return jnp.sum(cotangent.at[readers].get(mode="fill", fill_value=0), axis=1), None, None


take_rows.defvjp(_take_rows_forward, _take_rows_backward)


def slot_owners(slots: jax.Array, num_slots: int) -> jax.Array:
    """Returns [groups, num_slots] int32: the flattened [choices x tokens] assignment that fills each
    slot, choices x tokens where none does; `slots` [groups, choices, tokens] from `flat_slots`."""
    groups, choices, tokens = slots.shape
    assignments = jnp.broadcast_to(jnp.arange(choices * tokens, dtype=jnp.int32), (groups, choices * tokens))
    empty = jnp.full((groups, num_slots), choices * tokens, jnp.int32)
    # every kept assignment owns its slot alone; dropped ones point past the last slot and are left out
    return jax.vmap(lambda table, index, value: table.at[index].set(value, mode="drop"))(
        empty, slots.reshape(groups, -1), assignments)


def gather_into_slots(grouped: jax.Array, slots: jax.Array, owners: jax.Array) -> jax.Array:
    """Returns [groups, num_slots, embed]: the token of `grouped` [groups, tokens, embed] that fills
    each slot, zeros in empty slots; `slots` from `flat_slots`, `owners` from `slot_owners`."""
    _, choices, tokens = slots.shape
    token_of_slot = jnp.where(owners < choices * tokens, owners % tokens, tokens)
    # a token is read by the slots of its k choices
    return jax.vmap(take_rows)(grouped, token_of_slot, slots.transpose(0, 2, 1))


def combine_from_slots(outputs: jax.Array, slots: jax.Array, owners: jax.Array, gates: jax.Array) -> jax.Array:
    """Returns [groups, tokens, embed]: each token's k slot outputs of `outputs` [groups, slots, embed]
    summed with its `gates` [groups, choices, tokens]; a dropped assignment contributes zero."""
    groups, choices, tokens = slots.shape
    gathered = jax.vmap(take_rows)(outputs, slots.reshape(groups, -1), owners[..., None])  # [g, k x s, m]
    return jnp.einsum("gks,gksm->gsm", gates, gathered.reshape(groups, choices, tokens, -1))


def exchange(slots: jax.Array, *, to_experts: bool) -> jax.Array:
    """Returns expert slots [experts, groups, capacity, embed] moved between the layouts of routing
    (groups on the batch devices) and of the experts (experts on `expert`, groups on the rest).

    Pinning both layouts, one after the other, makes the partitioner move the
    slots with one all-to-all over `expert`, as in GShard; pinning only the
    experts' layout lets it gather every token onto every expert device instead.
    """
    routing_layout = (None, axes.GROUPS, None, axes.ACT_EMBED)
    expert_layout = (axes.ACT_EXPERT, axes.ACT_GROUP, None, axes.ACT_EMBED)
    source, target = (routing_layout, expert_layout) if to_experts else (expert_layout, routing_layout)
    return constrain(constrain(slots, source), target)


# an expert matrix: its weight [experts, in, out], or (weight, A [experts, in, rank], scale B [experts, rank, out])
# with its LoRA adapter (models.lora.factored)
ExpertMatrix = jax.Array | Factored
ExpertWeights = tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]  # gate, up [.., embed, mlp]; down [.., mlp, embed]
# each matrix's adapter input dropout, or None
ExpertDropouts = tuple[InputDropout | None, InputDropout | None, InputDropout | None]
# local_experts(tokens [T, embed], experts [T, k], gates [T, k], weights of experts first.. first + n - 1, first)
# -> [T, embed]: the gate-weighted sum of each token's assignments to those n experts
LocalExperts = Callable[[jax.Array, jax.Array, jax.Array, ExpertWeights, jax.Array | int], jax.Array]
# exchange(local_experts, tokens, experts, gates, weights) -> [T, embed]: every token's output, its
# assignments run by `local_experts` wherever their experts' weights live
ExpertExchange = Callable[[LocalExperts, jax.Array, jax.Array, jax.Array, ExpertWeights], jax.Array]

_exchange: contextvars.ContextVar[ExpertExchange | None] = contextvars.ContextVar("expert_exchange", default=None)


@contextlib.contextmanager
def expert_parallelism(exchange: ExpertExchange | None) -> Iterator[None]:
    """Installs how dropless MoE layers traced inside the block reach experts on other devices
    (None: every expert is local, as on one device)."""
    token = _exchange.set(exchange)
    try:
        yield
    finally:
        _exchange.reset(token)


def sort_by_expert(experts: jax.Array, first_expert: jax.Array | int, num_local: int) -> tuple[jax.Array, jax.Array]:
    """Returns (order [T x k], group_sizes [num_local]) for the assignments `experts` [T, k]: `order` lists
    the flattened assignments to experts first_expert .. first_expert + num_local - 1, grouped by expert
    in token order, then every other assignment; `group_sizes` counts each local expert's assignments."""
    local = experts.reshape(-1) - first_expert
    local = jnp.where((local >= 0) & (local < num_local), local, num_local)
    order = jnp.argsort(local, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(local, length=num_local + 1)[:num_local].astype(jnp.int32)
    return order, group_sizes


ExpertMatmul = Callable[[jax.Array, jax.Array], jax.Array]  # (x, one weight per expert) -> x W, per expert


def expert_product(matmul: ExpertMatmul, adapter_matmul: ExpertMatmul, x: jax.Array, matrix: ExpertMatrix,
                   dropout: InputDropout | None = None, dtype: jnp.dtype | None = None) -> jax.Array:
    """Returns x W by `matmul`, plus (x A) (scale B) by two `adapter_matmul`s where the matrix carries an
    adapter, its input dropped out by `dropout`: no matrix of W's size is formed, and a frozen W gets no
    weight gradient. Every factor is cast to `dtype` (default x's). `adapter_matmul` is the plain jax op, as
    a dense adapter's (models.lora): the backend's kernels and float8 are for the weights' matmuls."""
    dtype = dtype or x.dtype
    if not isinstance(matrix, tuple):
        return matmul(x, matrix.astype(dtype))
    weight, a, scaled_b = matrix
    low = adapter_matmul(x if dropout is None else dropout(x), a.astype(dtype))  # [..., rank]
    return matmul(x, weight.astype(dtype)) + adapter_matmul(low, scaled_b.astype(dtype))


def expert_count(weights: ExpertWeights) -> int:
    """Returns how many experts `weights` hold (the leading dimension of each)."""
    return jax.tree.leaves(weights)[0].shape[0]


def grouped_swiglu(rows: jax.Array, group_sizes: jax.Array, weights: ExpertWeights,
                   dropouts: ExpertDropouts = (None, None, None)) -> jax.Array:
    """Returns each of `rows` [N, embed] (sorted by expert, `group_sizes` [experts] rows each) through its
    expert's SwiGLU, [N, embed], by the installed grouped matmuls (models.ops), adapters by `ragged_dot`
    (`expert_product`); rows past the last group come out as zeros."""
    product = functools.partial(expert_product, functools.partial(ops.grouped_matmul, group_sizes=group_sizes),
                                functools.partial(ops.ragged_dot, group_sizes=group_sizes))
    (gate_weight, up_weight, down_weight), (gate_dropout, up_dropout, down_dropout) = weights, dropouts
    gate = checkpoint_name(product(rows, gate_weight, gate_dropout), remat_names.MLP_GATE)
    up = checkpoint_name(product(rows, up_weight, up_dropout), remat_names.MLP_UP)
    hidden = checkpoint_name(ops.swiglu(gate, up), remat_names.MLP_HIDDEN)
    return product(hidden, down_weight, down_dropout)


def dropless_expert_outputs(tokens: jax.Array, experts: jax.Array, gates: jax.Array, weights: ExpertWeights,
                            first_expert: jax.Array | int = 0, *,
                            dropouts: ExpertDropouts = (None, None, None)) -> jax.Array:
    """Returns [T, embed]: each of `tokens` [T, embed] through those of its assigned `experts` [T, k]
    whose `weights` are given (experts first_expert ..), summed with its `gates` [T, k]; `dropouts` drop
    the adapters' inputs (`grouped_swiglu`).

    The T x k assignments are sorted by expert into one buffer of T x k rows
    (static: the most a device can be asked for), grouped matmuls run over the
    experts' group sizes, and each assignment gathers its row back (both
    gathers gather in the backward pass too, see `take_rows`).
    """
    num_tokens, top_k = experts.shape
    num_local = expert_count(weights)
    order, group_sizes = sort_by_expert(experts, first_expert, num_local)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=jnp.int32))  # sorted row of each
    rows = take_rows(tokens, order // top_k, position.reshape(num_tokens, top_k))  # [T x k, embed]
    outputs = grouped_swiglu(rows, group_sizes, weights, dropouts)
    outputs = take_rows(outputs, position, order[:, None])  # [T x k, embed]
    routed = position < jnp.sum(group_sizes)  # [T x k] the assignments to a local expert
    outputs = jnp.where(routed[:, None], outputs, 0).reshape(num_tokens, top_k, -1)
    return jnp.einsum("tk,tkm->tm", gates, outputs)


class MoEFeedForward(nnx.Module):
    """SwiGLU experts behind a GShard router: x [batch, length, embed] -> (y, stats); a layer any model may use.

    `moe` says how tokens are routed (top-k, capacity or dropless, dispatch,
    router, expert width via `expert_mlp_dim` else `mlp_dim`, auxiliary-loss-
    free balancing); the stats it returns become the model's auxiliary losses
    and metrics through `moe_losses(stats, moe)`. Expert weights are
    `[expert, embed, mlp]` named ("expert", "embed", "mlp"), split over
    `mesh.expert` by nestor's rules; the router `[embed, experts]` leaves its
    expert dimension unsharded, since every device routes its own tokens to
    all experts. `shared_experts`, a dense feed-forward the caller builds
    (x -> (y, stats)), sees every token and is added to the routed output, as
    DeepSeekMoE's shared experts (arXiv 2401.06066). Weights are float32
    normals of stddev `init_std` (`out_std` for the output projection, default
    `init_std`); matmuls run in `dtype`. `lora` gives the experts' matrices it
    targets adapters [expert, in, rank] and [expert, rank, out], multiplied
    beside each expert's weight (`expert_product`).
    """

    def __init__(self, embed_dim: int, mlp_dim: int, moe: MoELayerConfig, rngs: nnx.Rngs, *,
                 dtype: str = "float32", init_std: float = 0.02, out_std: float | None = None,
                 shared_experts: nnx.Module | None = None, lora: LoraConfig = LoraConfig()):
        d, m, e = embed_dim, moe.expert_width(mlp_dim), moe.num_experts
        self.router = param(rngs, (d, e), (axes.EMBED, None), init_std)
        self.gate = param(rngs, (e, d, m), (axes.EXPERT, axes.EMBED, axes.MLP), init_std)
        self.up = param(rngs, (e, d, m), (axes.EXPERT, axes.EMBED, axes.MLP), init_std)
        self.down = param(rngs, (e, m, d), (axes.EXPERT, axes.MLP, axes.EMBED), init_std if out_std is None else out_std)
        experts, embed, hidden = ((e, axes.EXPERT),), ((d, axes.EMBED),), ((m, axes.MLP),)
        self.gate_lora = adapter(lora, rngs, "expert_gate", embed, hidden, experts)
        self.up_lora = adapter(lora, rngs, "expert_up", embed, hidden, experts)
        self.down_lora = adapter(lora, rngs, "expert_down", hidden, embed, experts)
        self.shared_experts = shared_experts
        self.selection_bias = (ExpertBias(jnp.zeros((e,), jnp.float32), logical_axes=(None,),
                                          update_rate=moe.bias_update_rate) if moe.bias_update_rate else None)
        self.moe = moe
        self.dtype = jnp.dtype(dtype)

    def bias(self) -> jax.Array | None:
        """Returns the selection bias [experts] of auxiliary-loss-free balancing, or None without it."""
        return None if self.selection_bias is None else self.selection_bias[...]

    def expert_weights(self) -> ExpertWeights:
        """Returns the experts' (gate, up, down) matrices, float32: each weight, with its adapter's factors
        where it has one (models.lora.factored)."""
        return (factored(self.gate[...], self.gate_lora), factored(self.up[...], self.up_lora),
                factored(self.down[...], self.down_lora))

    def adapter_dropouts(self) -> ExpertDropouts:
        """Returns the input dropout of each matrix's adapter (gate, up, down), None where it has none."""
        return tuple(None if low_rank is None else low_rank.input_dropout
                     for low_rank in (self.gate_lora, self.up_lora, self.down_lora))

    def experts(self, expert_inputs: jax.Array) -> jax.Array:
        """Returns every expert's SwiGLU output for its slots: [experts, groups, capacity, embed] both ways."""
        equation = "egci,eio->egco"
        product = functools.partial(expert_product, functools.partial(ops.einsum, equation),
                                    functools.partial(jnp.einsum, equation), dtype=self.dtype)
        (gate_weight, up_weight, down_weight), (gate_dropout, up_dropout, down_dropout) = (
            self.expert_weights(), self.adapter_dropouts())
        gate = checkpoint_name(product(expert_inputs, gate_weight, gate_dropout), remat_names.MLP_GATE)
        up = checkpoint_name(product(expert_inputs, up_weight, up_dropout), remat_names.MLP_UP)
        hidden = checkpoint_name(ops.swiglu(gate, up), remat_names.MLP_HIDDEN)
        hidden = constrain(hidden, (axes.ACT_EXPERT, axes.ACT_GROUP, None, axes.ACT_MLP))
        return product(hidden, down_weight, down_dropout)

    def __call__(self, x: jax.Array, *, train: bool | None = None,
                 routing_key: jax.Array | None = None) -> tuple[jax.Array, Stats]:
        """Returns (output [batch, length, embed], routing stats). `train` (default: the step's,
        models.task.training) picks the capacity factor and random routing, which draws from `routing_key`
        (default: the step's key, models.task.step_key)."""
        if train is None:
            train = task.training()
        if routing_key is None and train and self.moe.needs_routing_key:
            routing_key = task.step_key()
            if routing_key is None:
                raise ValueError("moe.second_expert_policy=random needs a routing key in training: call the "
                                 "layer inside a nestor step (models.task.step_key) or pass routing_key")
        batch, length, dim = x.shape
        tokens_per_group = self.moe.group_size or length
        groups = batch * length // tokens_per_group

        # groups stay on the batch devices (expert included) and a row's context devices until dispatch
        whole_rows = groups == batch
        group_axes = (axes.BATCH, axes.LENGTH, axes.ACT_EMBED) if whole_rows else (axes.GROUPS, None, axes.ACT_EMBED)
        grouped = constrain(x.reshape(groups, tokens_per_group, dim), group_axes)
        logits = jnp.einsum("gsm,me->gse", grouped.astype(jnp.float32), self.router[...])
        key = routing_key if train else None
        if self.moe.dropless:
            output, stats = self.dropless_dispatch(grouped, logits, key)
        else:
            factor = self.moe.capacity_factor if train else self.moe.eval_capacity_factor
            capacity = expert_capacity(tokens_per_group, self.moe.num_experts, self.moe.top_k, factor)
            dispatch = self.einsum_dispatch if self.moe.dispatch == "einsum" else self.sort_dispatch
            output, stats = dispatch(grouped, logits, capacity, key)
        output = constrain(output, group_axes).reshape(batch, length, dim)
        if self.shared_experts is not None:
            output = output + self.shared_experts(x, train=train)[0]
        return output, stats

    def einsum_dispatch(self, grouped: jax.Array, logits: jax.Array, capacity: int,
                        routing_key: jax.Array | None) -> tuple[jax.Array, Stats]:
        """Returns (output [groups, tokens, embed], stats) through GShard's one-hot dispatch and combine einsums."""
        routing = route(logits, top_k=self.moe.top_k, capacity=capacity, routing_key=routing_key,
                        router=self.moe.router, selection_bias=self.bias(), normalize=self.moe.normalize_gates)
        expert_inputs = jnp.einsum("gsec,gsm->egcm", routing.dispatch.astype(grouped.dtype), grouped)
        expert_outputs = self.experts_across_devices(expert_inputs)
        return jnp.einsum("gsec,egcm->gsm", routing.combine.astype(grouped.dtype), expert_outputs), routing.stats

    def sort_dispatch(self, grouped: jax.Array, logits: jax.Array, capacity: int,
                      routing_key: jax.Array | None) -> tuple[jax.Array, Stats]:
        """Returns (output [groups, tokens, embed], stats) with tokens placed in and taken from slots by index."""
        groups, _, dim = grouped.shape
        experts = self.moe.num_experts
        assignment = assign(logits, top_k=self.moe.top_k, capacity=capacity, routing_key=routing_key,
                            router=self.moe.router, selection_bias=self.bias(), normalize=self.moe.normalize_gates)
        slots = flat_slots(assignment, experts, capacity)  # [groups, choices, tokens]
        owners = slot_owners(slots, experts * capacity)  # [groups, experts x capacity]
        slot_inputs = gather_into_slots(grouped, slots, owners)  # [groups, experts x capacity, embed]
        expert_inputs = slot_inputs.reshape(groups, experts, capacity, dim).transpose(1, 0, 2, 3)
        expert_outputs = self.experts_across_devices(expert_inputs).transpose(1, 0, 2, 3)
        gates = jnp.stack(assignment.gates, axis=1).astype(grouped.dtype)  # [groups, choices, tokens]
        output = combine_from_slots(expert_outputs.reshape(groups, experts * capacity, dim), slots, owners, gates)
        return output, assignment.stats

    def dropless_dispatch(self, grouped: jax.Array, logits: jax.Array,
                          routing_key: jax.Array | None) -> tuple[jax.Array, Stats]:
        """Returns (output [groups, tokens, embed], stats) with no token dropped: every assignment runs
        through its expert's grouped matmul, across devices by the installed `expert_parallelism`."""
        groups, tokens_per_group, dim = grouped.shape
        top_k = self.moe.top_k
        choices = choose(logits, top_k=top_k, routing_key=routing_key, router=self.moe.router,
                         selection_bias=self.bias(), normalize=self.moe.normalize_gates)
        routed = jnp.stack(choices.routed, axis=-1).reshape(-1, top_k)
        experts = jnp.where(routed > 0, jnp.stack(choices.experts, axis=-1).reshape(-1, top_k),
                            self.moe.num_experts)  # [groups x tokens, k]; not routed: no expert
        gates = (jnp.stack(choices.gates, axis=-1).reshape(-1, top_k) * routed).astype(grouped.dtype)
        weights = self.expert_weights()
        tokens = grouped.reshape(groups * tokens_per_group, dim)
        local_experts = functools.partial(dropless_expert_outputs, dropouts=self.adapter_dropouts())
        exchange = _exchange.get()
        if exchange is None:
            output = local_experts(tokens, experts, gates, weights)
        else:
            output = exchange(local_experts, tokens, experts, gates, weights)
        return output.reshape(groups, tokens_per_group, dim), choices.stats

    def experts_across_devices(self, expert_inputs: jax.Array) -> jax.Array:
        """Returns the experts' outputs for `expert_inputs` [experts, groups, capacity, embed] (routing
        layout), moved to the experts' devices and back by all-to-all."""
        expert_inputs = checkpoint_name(exchange(expert_inputs, to_experts=True), remat_names.EXPERT_INPUTS)
        return exchange(self.experts(expert_inputs), to_experts=False)
