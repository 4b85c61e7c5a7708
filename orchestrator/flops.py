"""Analytic model FLOPs per training step (the numerator of MFU).

Counted as in the PaLM paper's appendix B (arXiv 2204.02311): a training step
costs 3x the forward pass (forward, then two matmuls per weight backward);
the forward pass costs 2 FLOPs per multiply-accumulate of every matmul weight
a token passes through (the unembedding included, the embedding lookup not:
it is a gather), plus attention's score and value products, of which causal
masking leaves half.
"""

from __future__ import annotations

from orchestrator.config import Config


def matmul_params_per_token(config: Config) -> int:
    """Returns the weights one token multiplies through in one forward pass.

    An MoE layer counts only the active experts: its router plus the top_k
    expert feed-forwards a token is routed to (dropped tokens are counted as
    routed: capacity is a budget, not the model).
    """
    m, moe = config.model, config.moe
    attention = m.embed_dim * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    mlp = 3 * m.embed_dim * m.mlp_dim
    moe_layers = m.num_layers // moe.every if moe.num_experts and moe.every else 0
    moe_feed_forward = moe.top_k * mlp + m.embed_dim * moe.num_experts
    dense_layers = m.num_layers - moe_layers
    return (m.num_layers * attention + dense_layers * mlp + moe_layers * moe_feed_forward
            + m.embed_dim * m.vocab_size)


def attention_flops_per_token(config: Config) -> float:
    """Returns forward FLOPs of q.k and p.v per token, causal: a token attends to half the sequence on average."""
    m, t = config.model, config.train
    full = 2 * 2 * t.seq_len * m.num_heads * m.head_dim
    return m.num_layers * full / 2


def train_flops_per_step(config: Config) -> float:
    """Returns the model FLOPs of one optimizer step over the global batch."""
    tokens = config.train.global_batch * config.train.seq_len
    forward = 2 * matmul_params_per_token(config) + attention_flops_per_token(config)
    return 3 * forward * tokens
