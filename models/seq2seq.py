"""GShard's model (Lepikhin et al. 2020, arXiv 2006.16668): an encoder-decoder Transformer for translation
whose every other feed-forward, in the encoder and the decoder, is a Mixture of Experts (top-2 gating, expert
capacity, GShard's random second expert, local groups, the load-balancing loss; models.moe). Trained
through the same interface as any model of a user's: `model.class: nestor.models.seq2seq:Seq2Seq`.

A batch holds byte tokens: "source" int32 [b, source_length] and "target" int32 [b, target_length + 1],
the target opening with BOS; PAD (0) fills both. The encoder's units (a dense layer, then an MoE layer) run
as the stack "encoder", the decoder's as the stack "decoder"; a pipeline splits the encoder
(`pipeline.stack: encoder`), the decoder then running after it on the last stage, so every schedule runs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nestor.models import axes, ops, task
from nestor.models.axes import constrain
from nestor.models.moe import MoEFeedForward, MoELayerConfig, moe_losses
from nestor.models.params import param
from nestor.models.stack import Stack
from nestor.models.transformer import RMSNorm

PAD, BOS = 0, 1  # byte b is token b + 2
ACTIVATIONS = (axes.BATCH, axes.LENGTH, axes.ACT_EMBED)
Stats = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Seq2SeqConfig:
    vocab_size: int = 258
    embed_dim: int = 64
    encoder_layers: int = 4  # even: each unit is a dense layer then an MoE layer
    decoder_layers: int = 4
    num_heads: int = 4
    mlp_dim: int = 128
    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 2.0
    eval_capacity_factor: float = 2.0
    second_expert_policy: str = "random"
    group_size: int = 0  # tokens per routing group ("local groups"); 0 = one per sequence
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0
    dtype: str = "float32"
    init_std: float = 0.02
    norm_eps: float = 1e-6

    @property
    def moe(self) -> MoELayerConfig:
        return MoELayerConfig(num_experts=self.num_experts, top_k=self.top_k, capacity_factor=self.capacity_factor,
                              eval_capacity_factor=self.eval_capacity_factor, group_size=self.group_size,
                              second_expert_policy=self.second_expert_policy, dispatch="einsum",
                              aux_loss_weight=self.aux_loss_weight, z_loss_weight=self.z_loss_weight)


class Attention(nnx.Module):
    """Multi-head attention of queries from `x` over keys and values from `memory` (itself when None)."""

    def __init__(self, cfg: Seq2SeqConfig, rngs: nnx.Rngs, *, causal: bool):
        d, h, k = cfg.embed_dim, cfg.num_heads, cfg.embed_dim // cfg.num_heads
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * (cfg.encoder_layers + cfg.decoder_layers))
        self.query = param(rngs, (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), std)
        self.key = param(rngs, (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), std)
        self.value = param(rngs, (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), std)
        self.out = param(rngs, (h, k, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), out_std)
        self.causal = causal
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x: jax.Array, mask: jax.Array, memory: jax.Array | None = None) -> jax.Array:
        dtype, einsum = self.dtype, ops.einsum
        memory = x if memory is None else memory
        heads = (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None)
        q = constrain(einsum("btd,dhk->bthk", x, self.query[...].astype(dtype)), heads)
        k, v = (constrain(einsum("bsd,dhk->bshk", memory, w[...].astype(dtype)), heads) for w in (self.key, self.value))
        context = constrain(ops.attention(q, k, v, mask, causal=self.causal), heads)
        return einsum("bthk,hkd->btd", context, self.out[...].astype(dtype))


class FeedForward(nnx.Module):
    """A dense GELU MLP, or GShard's MoE layer: (y, stats) either way."""

    def __init__(self, cfg: Seq2SeqConfig, rngs: nnx.Rngs, *, experts: bool):
        std = cfg.init_std
        self.moe = MoEFeedForward(cfg.embed_dim, cfg.mlp_dim, cfg.moe, rngs, dtype=cfg.dtype, init_std=std) \
            if experts else None
        if not experts:
            self.up = param(rngs, (cfg.embed_dim, cfg.mlp_dim), (axes.EMBED, axes.MLP), std)
            self.down = param(rngs, (cfg.mlp_dim, cfg.embed_dim), (axes.MLP, axes.EMBED), std)
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Stats]:
        if self.moe is not None:
            return self.moe(x)
        hidden = constrain(jax.nn.gelu(ops.einsum("btd,dm->btm", x, self.up[...].astype(self.dtype))),
                           (axes.BATCH, axes.LENGTH, axes.ACT_MLP))
        return ops.einsum("btm,md->btd", hidden, self.down[...].astype(self.dtype)), {}


class EncoderLayer(nnx.Module):
    def __init__(self, cfg: Seq2SeqConfig, rngs: nnx.Rngs, *, experts: bool):
        self.attention_norm, self.ffn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps), RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.attention = Attention(cfg, rngs, causal=False)
        self.ffn = FeedForward(cfg, rngs, experts=experts)

    def __call__(self, x: jax.Array, source_mask: jax.Array) -> tuple[jax.Array, Stats]:
        x = x + self.attention(self.attention_norm(x), source_mask[:, None, None, :])
        y, stats = self.ffn(self.ffn_norm(x))
        return constrain(x + y, ACTIVATIONS), stats


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Seq2SeqConfig, rngs: nnx.Rngs, *, experts: bool):
        self.self_norm, self.cross_norm, self.ffn_norm = (RMSNorm(cfg.embed_dim, cfg.norm_eps) for _ in range(3))
        self.self_attention = Attention(cfg, rngs, causal=True)
        self.cross_attention = Attention(cfg, rngs, causal=False)
        self.ffn = FeedForward(cfg, rngs, experts=experts)

    def __call__(self, x: jax.Array, rows: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, Stats]:
        encoded, source_mask = rows
        target_mask = jnp.ones((x.shape[0], 1, x.shape[1], x.shape[1]), bool)
        x = x + self.self_attention(self.self_norm(x), target_mask)
        x = x + self.cross_attention(self.cross_norm(x), source_mask[:, None, None, :], memory=encoded)
        y, stats = self.ffn(self.ffn_norm(x))
        return constrain(x + y, ACTIVATIONS), stats


class Unit(nnx.Module):
    """Two layers: a dense feed-forward, then an MoE one (GShard: every other feed-forward is MoE)."""

    def __init__(self, layer: type, cfg: Seq2SeqConfig, rngs: nnx.Rngs):
        self.dense = layer(cfg, rngs, experts=False)
        self.experts = layer(cfg, rngs, experts=True)

    def __call__(self, x: jax.Array, rows) -> tuple[jax.Array, Stats]:
        x, _ = self.dense(x, rows)
        return self.experts(x, rows)


class Seq2Seq(nnx.Module):
    """Source bytes -> target bytes; the loss is the target tokens' cross-entropy (PAD excluded; each row's
    mean, averaged over rows) plus the MoE layers' weighted load-balancing (and z) losses."""

    token_cross_entropy = True  # outside training, the target tokens' cross-entropy (models.task)
    pipeline_stack = "encoder"  # the stack its split wraps (models.task): the decoder pipelines with GPipe only

    def __init__(self, cfg: Seq2SeqConfig, rngs: nnx.Rngs):
        if cfg.encoder_layers % 2 or cfg.decoder_layers % 2 or cfg.embed_dim % cfg.num_heads:
            raise ValueError("encoder_layers and decoder_layers must be even (dense, MoE pairs), num_heads must "
                             f"divide embed_dim; got {cfg}")
        self.cfg = cfg
        self.embedding = param(rngs, (cfg.vocab_size, cfg.embed_dim), (axes.VOCAB, axes.EMBED), cfg.embed_dim ** -0.5)
        self.encoder = Stack(lambda r: Unit(EncoderLayer, cfg, r), cfg.encoder_layers // 2, rngs=rngs, name="encoder")
        self.encoder_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.decoder = Stack(lambda r: Unit(DecoderLayer, cfg, r), cfg.decoder_layers // 2, rngs=rngs, name="decoder")
        self.decoder_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)

    def embed(self, tokens: jax.Array) -> jax.Array:
        table = constrain(self.embedding[...], (None, None))
        scale = math.sqrt(self.cfg.embed_dim)
        return constrain(jnp.take(table, tokens, axis=0).astype(self.cfg.dtype) * scale, ACTIVATIONS)

    def pipeline_input(self, batch: task.Batch) -> jax.Array:
        """The embedded source: the encoder stack's input."""
        return self.embed(batch["source"])

    def pipeline_rows(self, batch: task.Batch) -> jax.Array:
        """The source's padding mask, which every encoder layer reads."""
        return batch["source"] != PAD

    def pipeline_stats_loss(self, stats: Stats) -> tuple[jax.Array, task.Metrics]:
        """The encoder's MoE losses and metrics."""
        loss, metrics = moe_losses(stats, self.cfg.moe)
        return loss, {f"encoder_{name}": value for name, value in metrics.items()}

    def pipeline_output(self, encoded: jax.Array, batch: task.Batch) -> tuple[jax.Array, task.Metrics]:
        """Decodes the target (teacher forcing) against the encoder's output: the cross-entropy of the target
        tokens plus the decoder's MoE losses."""
        source_mask = batch["source"] != PAD
        encoded = self.encoder_norm(encoded)
        inputs, labels = batch["target"][:, :-1], batch["target"][:, 1:]
        x, stats = self.decoder(self.embed(inputs), (encoded, source_mask))
        x = self.decoder_norm(x)
        logits = ops.einsum("btd,vd->btv", x, self.embedding[...].astype(x.dtype), jnp.float32)
        # each row's mean over its target tokens, then the mean over rows: every row weighs the same whatever
        # its length, so micro-batches (a pipeline's, accumulation's) average to the batch's loss exactly
        weights = (labels != PAD).astype(jnp.float32)
        per_token = jnp.sum(weights, axis=1)

        def row_mean(values: jax.Array) -> jax.Array:
            return jnp.mean(jnp.sum(values * weights, axis=1) / jnp.maximum(per_token, 1.0))

        cross_entropy = row_mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
        accuracy = row_mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
        moe_loss, moe_metrics = moe_losses(stats, self.cfg.moe)
        metrics = {"cross_entropy": cross_entropy, "token_accuracy": accuracy,
                   **{f"decoder_{name}": value for name, value in moe_metrics.items()}}
        return cross_entropy + (moe_loss if task.training() else 0.0), metrics

    def loss(self, batch: task.Batch) -> tuple[jax.Array, task.Metrics]:
        """The task contract (models.task): the translation loss, in training with every MoE layer's losses."""
        x, stats = self.encoder(self.pipeline_input(batch), self.pipeline_rows(batch))
        loss, metrics = self.pipeline_output(x, batch)
        encoder_loss, encoder_metrics = self.pipeline_stats_loss(stats)
        return loss + (encoder_loss if task.training() else 0.0), {**metrics, **encoder_metrics}
