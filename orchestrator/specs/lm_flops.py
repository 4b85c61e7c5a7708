"""nestor's LM: its analytic FLOPs per training step (the numerator of MFU).

Counted as in the PaLM paper's appendix B (arXiv 2204.02311): a training step
costs 3x the forward pass (forward, then two matmuls per weight backward);
the forward pass costs 2 FLOPs per multiply-accumulate of every matmul weight
a token passes through (the unembedding included, the embedding lookup not:
it is a gather), plus attention's score and value products, of which causal
masking leaves half.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nestor.models.moe import expert_capacity

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config


def matmul_params_per_token(config: Config) -> int:
    """Returns the weights one token multiplies through in one forward pass.

    An MoE layer counts only the active experts: its router plus the top_k
    expert feed-forwards a token is routed to and the shared experts (dropped tokens are counted as
    routed: capacity is a budget, not the model).
    """
    m, moe = config.model, config.moe
    attention = m.embed_dim * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    mlp = 3 * m.embed_dim * m.mlp_dim
    expert_mlp = 3 * m.embed_dim * (moe.expert_mlp_dim or m.mlp_dim)
    moe_layers = config.moe_layers
    moe_feed_forward = (moe.top_k + moe.shared_experts) * expert_mlp + m.embed_dim * moe.num_experts
    dense_layers = m.num_layers - moe_layers
    return (m.num_layers * attention + dense_layers * mlp + moe_layers * moe_feed_forward
            + m.embed_dim * m.vocab_size)


def attention_flops_per_token(config: Config, causal: bool = True) -> float:
    """Returns forward FLOPs of q.k and p.v per token.

    Causal (the model's work): a token attends to half the sequence on
    average. `causal=False` counts the full T x T product, which is what XLA
    computes (and reports) before the mask throws half of it away.
    """
    m, t = config.model, config.train
    full = 2 * 2 * t.seq_len * m.num_heads * m.head_dim
    return m.num_layers * full / (2 if causal else 1)


def train_flops_per_step(config: Config, causal: bool = True) -> float:
    """Returns the model FLOPs of one optimizer step over the global batch (MoE: active experts only)."""
    tokens = config.train.global_batch * config.train.seq_len
    forward = 2 * matmul_params_per_token(config) + attention_flops_per_token(config, causal)
    return 3 * forward * tokens


def model_flops_per_step(config: Config) -> float:
    """Returns the FLOPs credited to the model per step (the MFU numerator): causal attention counted once."""
    return train_flops_per_step(config, causal=True)


def executed_flops_per_step(config: Config) -> float:
    """Returns the FLOPs the implementation executes per step, to compare with XLA's cost analysis.

    Beyond the model FLOPs: full (masked) T x T attention, and for MoE layers
    the dispatch and combine (GShard's one-hot einsums, [tokens, experts,
    capacity] x embed each, with `moe.dispatch=einsum`; the gate-weighted sum
    of each token's k outputs with `sort` and dropless) and expert FFNs over
    every capacity slot rather than only the routed tokens (dropless: only the
    routed tokens). This is cost, not useful work: MFU uses model_flops_per_step.
    """
    flops = train_flops_per_step(config, causal=False)
    m, moe, t = config.model, config.moe, config.train
    if not (moe.num_experts and moe.every):
        return flops
    tokens_per_group = moe.group_size or t.seq_len
    expert_mlp = 3 * m.embed_dim * (moe.expert_mlp_dim or m.mlp_dim)
    # sort and dropless move tokens by gathers; only the gate-weighted sum of a token's k outputs multiplies
    dispatch_and_combine = moe.top_k * m.embed_dim
    padding = 0.0  # dropless: grouped matmuls over the routed tokens only
    if moe.capacity_factor:
        capacity = expert_capacity(tokens_per_group, moe.num_experts, moe.top_k, moe.capacity_factor)
        padding = (moe.num_experts * capacity / tokens_per_group - moe.top_k) * expert_mlp
        if moe.dispatch == "einsum":  # each token meets every slot of its group in both one-hot einsums
            dispatch_and_combine = 2 * moe.num_experts * capacity * m.embed_dim
    moe_layers = config.moe_layers
    tokens = t.global_batch * t.seq_len
    return flops + 3 * 2 * moe_layers * (dispatch_and_combine + padding) * tokens
