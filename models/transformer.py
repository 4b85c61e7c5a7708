"""A decoder-only language model in Flax NNX, readable top to bottom.

Token embedding -> N x [RMSNorm -> causal self-attention (RoPE, grouped-query
heads) -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> logits.
With `moe.every = k`, every k-th feed-forward is a Mixture of Experts
(models.moe) and the repeated unit is a `BlockGroup` of k layers whose last is MoE;
`moe.first_dense_layers = n` keeps the first n layers dense (DeepSeek-V3,
arXiv 2412.19437), a stack of their own that runs before the units.

The units are one module whose parameters are stacked `[layers, ...]`
(built with `nnx.vmap`), run as a stack (models.stack): a `scan` unless the
training job installs another runner (a pipeline, unrolled, rematerialised);
the tensors a remat policy can keep are tagged by name (models.remat_names).
`Transformer.loss` is the task contract (models.task) the training step calls.
Every parameter names its dimensions with logical axes (models.axes);
activations are constrained by logical name at block boundaries.

Packed sequences: `segment_ids` [batch, length] (equal ids = one document)
keep attention inside each document; the caller decides where documents start.

Decoding (`Transformer.decode`): the same layers read and extend a key/value
cache `KVCache` [layers, batch, max_len, kv_heads, head_dim], so each new
token costs one position of work; the prompt is the first call (prefill).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nestor.models import axes, lora, ops, remat_names, stack, task
from nestor.models.axes import constrain
from nestor.models.lora import LoraConfig
from nestor.models.moe import MoEFeedForward, MoELayerConfig, moe_losses
from nestor.models.params import bias, param
from nestor.models.stack import LayerFn, stacked

Stats = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling ("llama3"): wavelengths shorter than
    original_max_position_embeddings / high_freq_factor are kept, those longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, and those between are
    interpolated smoothly (as transformers' `_compute_llama3_parameters`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    embed_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False   # biases on the query, key and value projections (Qwen2)
    out_bias: bool = False   # a bias on the attention's output projection
    qk_norm: bool = False    # RMSNorm over each head of the queries and keys before RoPE (Qwen3)
    norm_eps: float = 1e-6
    init_std: float = 0.02
    dtype: str = "float32"
    moe: MoELayerConfig = MoELayerConfig()
    lora: LoraConfig = LoraConfig()

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def stacked_units(self) -> int:
        """Returns the length of the layer stack: num_layers, or for an MoE model (num_layers -
        moe.first_dense_layers) / moe.every units."""
        if not self.moe.enabled:
            return self.num_layers
        return (self.num_layers - self.moe.first_dense_layers) // self.moe.every

    @property
    def layers_per_unit(self) -> int:
        """Returns the layers of one stacked unit: moe.every for an MoE model, else 1."""
        return self.moe.every if self.moe.enabled else 1


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=(axes.NORM,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Returns RoPE's inverse frequencies [head_dim / 2] in float32, scaled by `scaling` when given."""
    inverse_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return inverse_freq
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inverse_freq
    scaled = jnp.where(wavelength > context / scaling.low_freq_factor, inverse_freq / scaling.factor, inverse_freq)
    smooth = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelength >= context / scaling.high_freq_factor) & (wavelength <= context / scaling.low_freq_factor)
    return jnp.where(medium, smoothed, scaled)


def rotary(x: jax.Array, theta: float, offset: int | jax.Array = 0, scaling: RopeScaling | None = None,
           positions: np.ndarray | None = None) -> jax.Array:
    """Returns x [batch, length, heads, head_dim] rotated by position (RoPE, arXiv 2104.09864, in the
    "rotate half" form that pairs dimension i with i + head_dim / 2): place p at `positions[p]` (default p)
    plus `offset` (a decoding step's place in the sequence)."""
    length, head_dim = x.shape[1], x.shape[-1]
    inverse_freq = rope_frequencies(head_dim, theta, scaling)
    positions = jnp.asarray(np.arange(length) if positions is None else positions, jnp.float32) + offset
    angles = positions[:, None] * inverse_freq[None, :]  # [length, head_dim/2]
    sin = jnp.sin(angles)[None, :, None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class KVCache(NamedTuple):
    """Keys and values of every attention layer for the positions decoded so far (the rest zeros)."""

    key: jax.Array    # [layers, batch, max_len, kv_heads, head_dim], rotated by position
    value: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]


# One layer's cache is laid out like the keys it holds: batch over the data axes, heads over tensor.
CACHE_LAYER_AXES = (axes.BATCH, axes.LENGTH, axes.ACT_KV_HEADS, None)


class Attention(nnx.Module):
    """Causal self-attention; `num_kv_heads` key/value heads shared by groups of query heads.

    `jax.nn.dot_product_attention` takes the key/value heads as they are
    (grouped-query attention without repeating them): query head h reads
    key/value head h // (num_heads / num_kv_heads).
    """

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
        d, h, g, k = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.query = param(rngs, (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), std)
        self.key = param(rngs, (d, g, k), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), std)
        self.value = param(rngs, (d, g, k), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), std)
        self.out = param(rngs, (h, k, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), out_std)
        embed, heads, kv_heads = (d, axes.EMBED), ((h, axes.HEADS), (k, axes.HEAD_DIM)), ((g, axes.KV_HEADS), (k, axes.HEAD_DIM))
        self.query_lora = lora.adapter(cfg.lora, rngs, "query", (embed,), heads)
        self.key_lora = lora.adapter(cfg.lora, rngs, "key", (embed,), kv_heads)
        self.value_lora = lora.adapter(cfg.lora, rngs, "value", (embed,), kv_heads)
        self.out_lora = lora.adapter(cfg.lora, rngs, "out", heads, (embed,))
        if cfg.qkv_bias:
            self.query_bias = bias((h, k), (axes.HEADS, axes.BIAS))
            self.key_bias = bias((g, k), (axes.KV_HEADS, axes.BIAS))
            self.value_bias = bias((g, k), (axes.KV_HEADS, axes.BIAS))
        if cfg.out_bias:
            self.out_bias = bias((d,), (axes.BIAS,))
        if cfg.qk_norm:
            self.query_norm = RMSNorm(k, cfg.norm_eps)
            self.key_norm = RMSNorm(k, cfg.norm_eps)
        self.cfg = cfg

    def project(self, x: jax.Array, offset: int | jax.Array = 0,
                positions: np.ndarray | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Returns (queries [b, t, heads, k], keys [b, t, kv_heads, k], values) of `x` [b, t, embed], queries
        and keys rotated as their `positions` [t] (default 0, 1, ...) plus `offset`."""
        cfg = self.cfg
        dtype = cfg.compute_dtype
        einsum = ops.einsum
        q = lora.adapted(x, einsum("btd,dhk->bthk", x, self.query[...].astype(dtype)), self.query_lora)
        k = lora.adapted(x, einsum("btd,dgk->btgk", x, self.key[...].astype(dtype)), self.key_lora)
        v = lora.adapted(x, einsum("btd,dgk->btgk", x, self.value[...].astype(dtype)), self.value_lora)
        if cfg.qkv_bias:
            q, k, v = (projection + b[...].astype(dtype)
                       for projection, b in zip((q, k, v), (self.query_bias, self.key_bias, self.value_bias)))
        q = checkpoint_name(q, remat_names.QUERY_PROJ)
        k = checkpoint_name(k, remat_names.KEY_PROJ)
        v = checkpoint_name(v, remat_names.VALUE_PROJ)
        if cfg.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)
        q = constrain(rotary(q, cfg.rope_theta, offset, cfg.rope_scaling, positions),
                      (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None))
        k = constrain(rotary(k, cfg.rope_theta, offset, cfg.rope_scaling, positions),
                      (axes.BATCH, axes.LENGTH, axes.ACT_KV_HEADS, None))
        v = constrain(v, (axes.BATCH, axes.LENGTH, axes.ACT_KV_HEADS, None))
        return q, k, v

    def output(self, context: jax.Array) -> jax.Array:
        """Returns the output projection [batch, length, embed] of `context` [batch, length, heads, head_dim]."""
        context = constrain(context, (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None))
        dtype = self.cfg.compute_dtype
        out = lora.adapted(context, ops.einsum("bthk,hkd->btd", context, self.out[...].astype(dtype)), self.out_lora)
        if self.cfg.out_bias:
            out = out + self.out_bias[...].astype(dtype)
        return checkpoint_name(out, remat_names.OUT_PROJ)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """Returns the attention output [batch, length, embed]; with `segment_ids` [batch, length]
        no token attends to a token of another segment. The places of a row hold the positions of the
        installed sequence layout (models.axes)."""
        positions = axes.sequence_layout().positions(x.shape[1])
        q, k, v = self.project(x, positions=positions)
        context = ops.attention(q, k, v, segment_ids=segment_ids, positions=positions)
        return self.output(context)

    def decode(self, x: jax.Array, cache: tuple[jax.Array, jax.Array],
               position: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Returns (attention output [batch, t, embed], the layer's cache with `x`'s keys and values written).

        `x` [batch, t, embed] holds positions position .. position + t - 1 of
        every row; `cache` is this layer's (keys, values) [batch, max_len,
        kv_heads, head_dim]. Each query sees the cached positions up to its own.
        """
        q, k, v = self.project(x, position)
        keys, values = (constrain(jax.lax.dynamic_update_slice(stored, new.astype(stored.dtype), (0, position, 0, 0)),
                                  CACHE_LAYER_AXES) for stored, new in zip(cache, (k, v)))
        query_positions = position + jnp.arange(x.shape[1])
        visible = jnp.arange(keys.shape[1])[None, :] <= query_positions[:, None]  # [t, max_len]
        # The xla implementation takes any mask; a cuDNN kernel for one query and a padded cache would not help.
        context = jax.nn.dot_product_attention(q, keys, values, mask=visible[None, None], implementation="xla")
        return self.output(context), (keys, values)


class MLP(nnx.Module):
    """SwiGLU feed-forward (arXiv 2002.05202): down(silu(gate(x)) * up(x)); hidden `width` (default mlp_dim)."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, width: int | None = None):
        d, m = cfg.embed_dim, width or cfg.mlp_dim
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.gate = param(rngs, (d, m), (axes.EMBED, axes.MLP), std)
        self.up = param(rngs, (d, m), (axes.EMBED, axes.MLP), std)
        self.down = param(rngs, (m, d), (axes.MLP, axes.EMBED), out_std)
        embed, hidden = ((d, axes.EMBED),), ((m, axes.MLP),)
        self.gate_lora = lora.adapter(cfg.lora, rngs, "gate", embed, hidden)
        self.up_lora = lora.adapter(cfg.lora, rngs, "up", embed, hidden)
        self.down_lora = lora.adapter(cfg.lora, rngs, "down", hidden, embed)
        self.dtype = cfg.compute_dtype

    def __call__(self, x: jax.Array, *, train: bool = True,
                 routing_key: jax.Array | None = None) -> tuple[jax.Array, Stats]:
        """Returns (output, no stats): the feed-forward interface MoEFeedForward shares."""
        del train, routing_key  # a dense feed-forward neither routes nor changes in eval
        einsum = ops.einsum
        gate = lora.adapted(x, einsum("...d,dm->...m", x, self.gate[...].astype(self.dtype)), self.gate_lora)
        up = lora.adapted(x, einsum("...d,dm->...m", x, self.up[...].astype(self.dtype)), self.up_lora)
        gate, up = checkpoint_name(gate, remat_names.MLP_GATE), checkpoint_name(up, remat_names.MLP_UP)
        hidden = checkpoint_name(ops.swiglu(gate, up), remat_names.MLP_HIDDEN)
        hidden = constrain(hidden, (axes.BATCH, axes.LENGTH, axes.ACT_MLP))
        return lora.adapted(hidden, einsum("...m,md->...d", hidden, self.down[...].astype(self.dtype)),
                            self.down_lora), {}


def shared_experts(cfg: TransformerConfig, rngs: nnx.Rngs) -> MLP | None:
    """Returns the MoE layer's always-on experts as one SwiGLU of `shared_experts` x expert width, or None."""
    if not cfg.moe.shared_experts:
        return None
    return MLP(cfg, rngs, width=cfg.moe.shared_experts * cfg.moe.expert_width(cfg.mlp_dim))


def moe_feed_forward(cfg: TransformerConfig, rngs: nnx.Rngs) -> MoEFeedForward:
    """Returns the LM's MoE feed-forward layer, with its shared experts when `moe.shared_experts` asks."""
    shared = shared_experts(cfg, rngs)
    return MoEFeedForward(cfg.embed_dim, cfg.mlp_dim, cfg.moe, rngs, dtype=cfg.dtype, init_std=cfg.init_std,
                          out_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), shared_experts=shared,
                          lora=cfg.lora)


class Block(nnx.Module):
    """One pre-norm transformer layer. Returns (x, stats); dense layers report no stats."""

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs, *, mixture_of_experts: bool = False):
        self.attention_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.attention = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.mlp = moe_feed_forward(cfg, rngs) if mixture_of_experts else MLP(cfg, rngs)

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None, train: bool = True,
                 routing_key: jax.Array | None = None) -> tuple[jax.Array, Stats]:
        x = x + self.attention(self.attention_norm(x), segment_ids)
        feed_forward, stats = self.mlp(self.mlp_norm(x), train=train, routing_key=routing_key)
        return constrain(x + feed_forward, (axes.BATCH, axes.LENGTH, axes.ACT_EMBED)), stats

    def decode(self, x: jax.Array, cache: tuple[jax.Array, jax.Array],
               position: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Returns (x, the layer's cache) for new positions of `x` (see `Attention.decode`), MoE at eval capacity."""
        attention, cache = self.attention.decode(self.attention_norm(x), cache, position)
        x = x + attention
        feed_forward, _ = self.mlp(self.mlp_norm(x), train=False)
        return constrain(x + feed_forward, (axes.BATCH, axes.LENGTH, axes.ACT_EMBED)), cache


class BlockGroup(nnx.Module):
    """`moe.every` layers whose last feed-forward is MoE: the stacked unit of an MoE model.

    The dense layers before it run unrolled inside the unit (there are
    `every - 1` of them); the units themselves are scanned or pipelined.
    """

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
        self.dense = nnx.List([Block(cfg, rngs) for _ in range(cfg.moe.every - 1)])
        self.expert_layer = Block(cfg, rngs, mixture_of_experts=True)

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None, train: bool = True,
                 routing_key: jax.Array | None = None) -> tuple[jax.Array, Stats]:
        for block in self.dense:
            x, _ = block(x, segment_ids=segment_ids)
        return self.expert_layer(x, segment_ids=segment_ids, train=train, routing_key=routing_key)

    def decode(self, x: jax.Array, cache: tuple[jax.Array, jax.Array],
               position: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Returns (x, the unit's cache) for new positions; `cache` holds [every, batch, max_len, ...] per layer."""
        updated = []
        for index, block in enumerate([*self.dense, self.expert_layer]):
            x, layer_cache = block.decode(x, (cache[0][index], cache[1][index]), position)
            updated.append(layer_cache)
        return x, tuple(jnp.stack(parts) for parts in zip(*updated))


STACK = "blocks"  # the stacked units' stack name (models.stack), the one a pipeline splits
DENSE_STACK = "dense"  # an MoE model's first dense layers


def next_token_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Returns the next-token cross-entropy in float32: the mean over every target, or with `weights` [batch,
    length] (models.task.LOSS_WEIGHTS, normalised by the step) the mean over rows of each row's weighted sum."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.mean(losses) if weights is None else jnp.sum(losses * weights) / losses.shape[0]


class Transformer(nnx.Module):
    """Decoder-only LM: tokens [batch, length] -> float32 logits [batch, length, vocab]."""

    token_cross_entropy = True  # its loss is the next tokens' mean cross-entropy: a perplexity (models.task)

    def __init__(self, cfg: TransformerConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = param(rngs, (cfg.vocab_size, cfg.embed_dim), (axes.VOCAB, axes.EMBED), cfg.init_std)
        first_dense = cfg.moe.first_dense_layers if cfg.moe.enabled else 0
        self.dense_blocks = stacked(lambda r: Block(cfg, r), first_dense, axes.DENSE_LAYERS, rngs) if first_dense else None
        unit = BlockGroup if cfg.moe.enabled else Block
        self.blocks = stacked(lambda r: unit(cfg, r), cfg.stacked_units, axes.LAYERS, rngs)
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.unembedding = param(rngs, (cfg.embed_dim, cfg.vocab_size), (axes.EMBED, axes.VOCAB), cfg.init_std)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None, train: bool = True,
                 routing_key: jax.Array | None = None) -> tuple[jax.Array, Stats]:
        """Returns (logits float32 [batch, length, vocab], per-unit stats stacked [units, ...]) of `tokens` whose
        places are in the installed sequence layout's order (models.axes; `places` arranges a batch).

        The first dense layers of an MoE model (`moe.first_dense_layers`) run
        as the stack "dense" before the units run as the stack "blocks", each
        by its installed runner (models.stack). `segment_ids` [batch, length]
        (None = one document per row) keep attention within each segment; they
        reach every unit as its row inputs. `train` and `routing_key` are as in
        `units`. Raises ValueError when the routing needs a key and none is given.
        """
        x = self.stack_input(tokens, segment_ids=segment_ids)
        layer_fn, units = self.units(train=train, routing_key=routing_key)
        x, stats = stack.run(STACK, layer_fn, units, x, segment_ids)
        return self.logits(x), stats

    def loss(self, batch: task.Batch) -> tuple[jax.Array, task.Metrics]:
        """The task contract (models.task): batch {"tokens" int32 [b, t + 1], optionally "segment_ids"
        [b, t] and "loss_weights" [b, t]} -> (next-token cross-entropy (weighted), in training plus the MoE layers' weighted aux and z losses;
        metrics)."""
        inputs, targets, segment_ids = self.places(batch)
        train = task.training()
        logits, stats = self(inputs, segment_ids=segment_ids, train=train, routing_key=task.step_key())
        loss = next_token_loss(logits, targets, self.target_weights(batch))
        moe_loss, moe_metrics = moe_losses(stats, self.cfg.moe)
        return (loss + moe_loss if train else loss), {"lm_loss": loss, **moe_metrics}

    def pipeline_input(self, batch: task.Batch) -> jax.Array:
        """The pipeline split (models.task): the blocks' input for a batch, as `loss` computes it."""
        inputs, _, segment_ids = self.places(batch)
        return self.stack_input(inputs, segment_ids=segment_ids)

    def pipeline_output(self, x: jax.Array, batch: task.Batch) -> tuple[jax.Array, task.Metrics]:
        """The pipeline split (models.task): the next-token loss of the blocks' output `x`."""
        loss = next_token_loss(self.logits(x), self.places(batch)[1], self.target_weights(batch))
        return loss, {"lm_loss": loss}

    def pipeline_rows(self, batch: task.Batch) -> jax.Array | None:
        """The pipeline split (models.task): the segment ids every block reads."""
        return self.places(batch)[2]

    @staticmethod
    def places(batch: task.Batch) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Returns (inputs, targets, segment ids or None) of `batch`, each [b, t], the row's places in the
        order of the installed sequence layout (models.axes)."""
        layout = axes.sequence_layout()
        tokens, segment_ids = batch["tokens"], batch.get("segment_ids")
        return (layout.arrange(tokens[:, :-1]), layout.arrange(tokens[:, 1:]),
                None if segment_ids is None else layout.arrange(segment_ids))

    @staticmethod
    def target_weights(batch: task.Batch) -> jax.Array | None:
        """Returns the batch's loss weights [b, t] (models.task.LOSS_WEIGHTS) in the places' order, or None."""
        weights = batch.get(task.LOSS_WEIGHTS)
        return None if weights is None else axes.sequence_layout().arrange(weights)

    def pipeline_stats_loss(self, stats: Stats) -> tuple[jax.Array, task.Metrics]:
        """The pipeline split (models.task): the MoE layers' weighted losses and metrics."""
        return moe_losses(stats, self.cfg.moe)

    def pipeline_units(self, name: str) -> tuple[tuple[str, ...], LayerFn, Any]:
        """The pipeline split (models.task): the blocks' parameters' path, their layer function and stacked
        inputs, for the step's training flag and key (models.task)."""
        if name != STACK:
            raise ValueError(f"nestor's LM pipelines its {STACK!r} stack, not {name!r}")
        return (STACK,), *self.units(train=task.training(), routing_key=task.step_key())

    def stack_input(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None) -> jax.Array:
        """Returns the input of the stacked units [batch, length, embed]: the embedded tokens, through an MoE
        model's first dense layers (`moe.first_dense_layers`, the stack "dense") when it has them."""
        x = self.embed(tokens)
        if self.dense_blocks is None:
            return x
        dense_def, dense_stack = nnx.split(self.dense_blocks)

        def dense_fn(params: Any, h: jax.Array, unit_segment_ids: jax.Array | None) -> tuple[jax.Array, Stats]:
            return nnx.merge(dense_def, params)(h, segment_ids=unit_segment_ids)

        return stack.run(DENSE_STACK, dense_fn, dense_stack, x, segment_ids)[0]

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Returns the embedded tokens [batch, length, embed] in the compute dtype."""
        # The lookup reads the whole table (gathered once per step, as fsdp gathers every weight):
        # a gather from a vocab-sharded table cannot be partitioned without replicating it anyway.
        table = constrain(self.embedding[...], (None, None))
        x = jnp.take(table, tokens, axis=0).astype(self.cfg.compute_dtype)
        return constrain(x, (axes.BATCH, axes.LENGTH, axes.ACT_EMBED))

    def units(self, *, train: bool = True, routing_key: jax.Array | None = None) -> tuple[LayerFn, Any]:
        """Returns (layer_fn, stacked): the stacked units as a function of one unit's inputs and those inputs
        stacked [units, ...] (a plain dict of parameters, or `(parameters, keys)` with random routing).

        `train` picks the MoE capacity factor (training or eval) and enables
        random routing; `routing_key` seeds that routing, split into one key per
        stacked unit. Raises ValueError when the routing needs a key and none is given.
        """
        cfg = self.cfg
        block_def, block_state = nnx.split(self.blocks)
        stacked = nnx.to_pure_dict(block_state)
        random_routing = train and cfg.moe.enabled and cfg.moe.needs_routing_key
        if random_routing and routing_key is None:
            raise ValueError("moe.second_expert_policy=random needs a routing_key in training")
        # each unit draws its routing noise and its adapters' dropout (models.lora) from a key of its own
        unit_keys = random_routing or (train and cfg.lora.dropout > 0 and routing_key is not None)
        if unit_keys:
            stacked = (stacked, jax.random.split(routing_key, cfg.stacked_units))

        def layer_fn(unit_inputs: Any, h: jax.Array, unit_segment_ids: jax.Array | None) -> tuple[jax.Array, Stats]:
            params, key = unit_inputs if unit_keys else (unit_inputs, None)
            with task.step_info(train, key if unit_keys else task.step_key()):
                return nnx.merge(block_def, params)(h, segment_ids=unit_segment_ids, train=train,
                                                    routing_key=key if random_routing else None)

        return layer_fn, stacked

    def logits(self, x: jax.Array) -> jax.Array:
        """Returns the float32 logits [batch, length, vocab] of the stack's output `x` [batch, length, embed]."""
        x = self.final_norm(x)
        unembedding = self.embedding[...].T if self.cfg.tie_embeddings else self.unembedding[...]
        logits = ops.einsum("btd,dv->btv", x, unembedding.astype(self.cfg.compute_dtype), jnp.float32)
        return constrain(logits, (axes.BATCH, axes.LENGTH, axes.ACT_VOCAB))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Returns an empty (zero) cache for `batch` rows of up to `max_len` positions, in the compute dtype."""
        cfg = self.cfg
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        zeros = constrain(jnp.zeros(shape, cfg.compute_dtype), (None, *CACHE_LAYER_AXES))
        return KVCache(zeros, zeros)

    def decode(self, tokens: jax.Array, cache: KVCache, position: jax.Array) -> tuple[jax.Array, KVCache]:
        """Returns (float32 logits [batch, t, vocab], the cache extended) for `tokens` [batch, t] at positions
        position .. position + t - 1 of every row, attending to the cache's earlier positions.

        The prompt is one call at position 0 (prefill), each generated token one
        more; the result equals `__call__` on the whole prefix (no document mask,
        MoE at the eval capacity factor, routed per token when nothing is dropped).
        """
        cfg = self.cfg
        block_def, stacked = nnx.split(self.blocks)
        units, per_unit = cfg.stacked_units, cfg.layers_per_unit
        first_dense = cfg.num_layers - units * per_unit  # moe.first_dense_layers: the cache's first layers
        x = self.embed(tokens)
        dense_cache = tuple(part[:first_dense] for part in cache)
        if self.dense_blocks is not None:
            dense_def, dense_stack = nnx.split(self.dense_blocks)

            def dense_fn(x: jax.Array, inputs: tuple[Any, tuple[jax.Array, jax.Array]]):
                params, layer_cache = inputs
                return nnx.merge(dense_def, params).decode(x, layer_cache, position)

            x, dense_cache = jax.lax.scan(dense_fn, x, (dense_stack, dense_cache))
        # [layers, ...] -> [units, layers per unit, ...]: layer l is unit l // per_unit's (l % per_unit)-th
        unit_caches = tuple(part[first_dense:].reshape(units, per_unit, *part.shape[1:]) for part in cache)

        def unit_fn(x: jax.Array, inputs: tuple[Any, tuple[jax.Array, jax.Array]]):
            params, unit_cache = inputs
            unit = nnx.merge(block_def, params)
            if cfg.moe.enabled:
                return unit.decode(x, unit_cache, position)
            x, layer_cache = unit.decode(x, (unit_cache[0][0], unit_cache[1][0]), position)
            return x, tuple(part[None] for part in layer_cache)

        x, unit_caches = jax.lax.scan(unit_fn, x, (stacked, unit_caches))
        cache = KVCache(*(jnp.concatenate([dense, part.reshape(units * per_unit, *part.shape[2:])])
                          for dense, part in zip(dense_cache, unit_caches)))
        return self.logits(x), cache
