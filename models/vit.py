"""A Vision Transformer image classifier (Dosovitskiy et al. 2020, arXiv 2010.11929) in Flax NNX, trained
through the same interface as any model of a user's (docs/models.md): `model.class: nestor.models.vit:ViT`.

Images [batch, height, width, channels] are cut into patch_size x patch_size patches, each projected to
embed_dim; a learned class token leads the sequence and learned positions are added; `num_layers`
pre-norm encoder blocks (bidirectional multi-head attention, a GELU MLP) run as one stack, "blocks", which
a pipeline splits into stages; the class token's final state, normalised, gives the logits. The loss is
split around the stack (`pipeline_input`, `pipeline_output`) so that every pipeline schedule runs it.
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
from nestor.models.params import param
from nestor.models.stack import Stack

CLASSES = "classes"  # the logits' dimension: a name the rules table does not know, so replicated
ACTIVATIONS = (axes.BATCH, axes.LENGTH, axes.ACT_EMBED)


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    image_size: int = 8
    channels: int = 1
    patch_size: int = 2
    num_classes: int = 10
    embed_dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    mlp_dim: int = 128
    dtype: str = "float32"
    init_std: float = 0.02
    norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=(axes.NORM,))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32), logical_axes=(axes.NORM,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(jnp.var(x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...] + self.bias[...]).astype(x.dtype)


class EncoderBlock(nnx.Module):
    """x + attention(norm(x)), then + mlp(norm(x)): every patch attends to every patch."""

    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        d, h, k, m = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.attention_norm = LayerNorm(d, cfg.norm_eps)
        self.query = param(rngs, (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), std)
        self.key = param(rngs, (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), std)
        self.value = param(rngs, (d, h, k), (axes.EMBED, axes.HEADS, axes.HEAD_DIM), std)
        self.out = param(rngs, (h, k, d), (axes.HEADS, axes.HEAD_DIM, axes.EMBED), out_std)
        self.mlp_norm = LayerNorm(d, cfg.norm_eps)
        self.up = param(rngs, (d, m), (axes.EMBED, axes.MLP), std)
        self.down = param(rngs, (m, d), (axes.MLP, axes.EMBED), out_std)
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype, einsum = self.dtype, ops.einsum
        h = self.attention_norm(x)
        q, k, v = (constrain(einsum("btd,dhk->bthk", h, w[...].astype(dtype)), (axes.BATCH, axes.LENGTH,
                                                                                axes.ACT_HEADS, None))
                   for w in (self.query, self.key, self.value))
        context = constrain(ops.attention(q, k, v, causal=False), (axes.BATCH, axes.LENGTH, axes.ACT_HEADS, None))
        x = x + einsum("bthk,hkd->btd", context, self.out[...].astype(dtype))
        hidden = jax.nn.gelu(einsum("btd,dm->btm", self.mlp_norm(x), self.up[...].astype(dtype)))
        hidden = constrain(hidden, (axes.BATCH, axes.LENGTH, axes.ACT_MLP))
        return constrain(x + einsum("btm,md->btd", hidden, self.down[...].astype(dtype)), ACTIVATIONS)


class ViT(nnx.Module):
    """Images -> logits; batch {"image" float [b, height, width, channels], "label" int [b]}."""

    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs):
        if cfg.image_size % cfg.patch_size or cfg.embed_dim % cfg.num_heads:
            raise ValueError(f"patch_size {cfg.patch_size} must divide image_size {cfg.image_size} and num_heads "
                             f"{cfg.num_heads} embed_dim {cfg.embed_dim}")
        self.cfg = cfg
        patch_pixels = cfg.patch_size ** 2 * cfg.channels
        self.patch_embedding = param(rngs, (patch_pixels, cfg.embed_dim), (None, axes.EMBED),
                                     1 / math.sqrt(patch_pixels))
        self.class_token = param(rngs, (cfg.embed_dim,), (axes.EMBED,), cfg.init_std)
        self.positions = param(rngs, (cfg.num_patches + 1, cfg.embed_dim), (None, axes.EMBED), cfg.init_std)
        self.blocks = Stack(lambda r: EncoderBlock(cfg, r), cfg.num_layers, rngs=rngs, name="blocks")
        self.final_norm = LayerNorm(cfg.embed_dim, cfg.norm_eps)
        self.head = param(rngs, (cfg.embed_dim, cfg.num_classes), (axes.EMBED, CLASSES), cfg.init_std)

    def patches(self, images: jax.Array) -> jax.Array:
        """Returns images [b, H, W, C] as patches [b, (H/p)(W/p), p*p*C], row by row."""
        b, height, width, channels = images.shape
        p = self.cfg.patch_size
        grid = images.reshape(b, height // p, p, width // p, p, channels).transpose(0, 1, 3, 2, 4, 5)
        return grid.reshape(b, (height // p) * (width // p), p * p * channels)

    def pipeline_input(self, batch: task.Batch) -> jax.Array:
        """Returns the blocks' input [b, 1 + patches, embed]: the class token, then the projected patches,
        each plus its position."""
        dtype = jnp.dtype(self.cfg.dtype)
        x = ops.einsum("bnp,pd->bnd", self.patches(batch["image"].astype(dtype)),
                       self.patch_embedding[...].astype(dtype))
        cls = jnp.broadcast_to(self.class_token[...].astype(dtype), (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.positions[...].astype(dtype)
        return constrain(x, ACTIVATIONS)

    def pipeline_output(self, x: jax.Array, batch: task.Batch) -> tuple[jax.Array, task.Metrics]:
        """Returns (mean cross-entropy of the class token's logits, {accuracy})."""
        logits = ops.einsum("bd,dc->bc", self.final_norm(x[:, 0]), self.head[...].astype(x.dtype), jnp.float32)
        labels = batch["label"]
        loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
        return loss, {"accuracy": jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))}

    def loss(self, batch: task.Batch) -> tuple[jax.Array, task.Metrics]:
        """The task contract (models.task): the classifier's loss and accuracy on a batch of images."""
        x, _ = self.blocks(self.pipeline_input(batch))
        return self.pipeline_output(x, batch)
