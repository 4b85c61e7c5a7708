"""Which Hugging Face tensor holds each of nestor's LM parameters, and how its layout maps onto nestor's.

A nestor parameter is `[stack dims..., per-layer dims...]`: its leading dimensions (layers, experts) pick
a tensor by name, and each tensor `H` maps onto one per-layer block as `H.reshape(split).transpose(perm)`
(a projection's `[heads x head_dim, embed]` weight becomes `[embed, heads, head_dim]`). Boxes of a
nestor parameter become boxes of its tensors (`hf_box`), so a process reads and writes only its slices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np

from nestor.models.transformer import TransformerConfig
from nestor.orchestrator.hf.safetensors import Box

# tensors a checkpoint may hold beyond the model's parameters (buffers older transformers saved)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One nestor parameter: its path, stack dims and the tensor of each stack index (see the module)."""

    path: tuple[str, ...]
    stack: tuple[int, ...]
    name: Callable[..., str]
    groups: tuple[tuple[int, ...], ...]  # each tensor dimension's split into per-layer dimensions, outer first
    perm: tuple[int, ...]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(group) for group in self.groups)

    @property
    def split(self) -> tuple[int, ...]:
        return tuple(size for group in self.groups for size in group)

    def shape(self) -> tuple[int, ...]:
        """Returns the nestor parameter's whole shape."""
        return (*self.stack, *(self.split[axis] for axis in self.perm))

    def names(self) -> Iterator[tuple[tuple[int, ...], str]]:
        """Yields (stack index, tensor name) for every tensor of the parameter."""
        for index in np.ndindex(*self.stack):
            yield tuple(int(i) for i in index), self.name(*index)

    def hf_box(self, per_layer: Box, exact: bool) -> tuple[Box, tuple[slice, ...]]:
        """Returns (the tensor box covering nestor's per-layer box, the slices of the split tensor that then
        pick nestor's box). Within a tensor dimension split in several, the box covers the inner ones whole;
        `exact` raises ValueError where nestor's box does not (a write must cover its box exactly)."""
        split_box = [None] * len(self.split)
        for axis, extent in zip(self.perm, per_layer):
            split_box[axis] = extent
        box, picks, first = [], [], 0
        for group in self.groups:
            inner = math.prod(group[1:])
            start, stop = split_box[first]
            box.append((start * inner, stop * inner))
            picks.append(slice(0, stop - start))
            for offset, size in enumerate(group[1:], 1):
                lo, hi = split_box[first + offset]
                if exact and (lo, hi) != (0, size):
                    raise ValueError(f"{'.'.join(self.path)}: a box splitting a tensor's inner dimension")
                picks.append(slice(lo, hi))
            first += len(group)
        return tuple(box), tuple(picks)

    def to_nestor(self, block: np.ndarray, per_layer: Box) -> np.ndarray:
        """Returns nestor's per-layer box from the tensor `block` read at `hf_box(per_layer)`."""
        box, picks = self.hf_box(per_layer, exact=False)
        shape = []
        for group, (start, stop) in zip(self.groups, box):
            shape += [(stop - start) // math.prod(group[1:]), *group[1:]]
        return block.reshape(shape)[picks].transpose(self.perm)

    def to_hf(self, block: np.ndarray) -> np.ndarray:
        """Returns the tensor box (`hf_box(..., exact=True)`) holding nestor's per-layer `block`."""
        split = block.transpose(np.argsort(self.perm))
        shape, first = [], 0
        for group in self.groups:
            shape.append(math.prod(split.shape[first:first + len(group)]))
            first += len(group)
        return split.reshape(shape)


def entries(cfg: TransformerConfig, family: str) -> list[Entry]:
    """Returns the entries of every parameter of nestor's LM `cfg`, its experts named as `family`'s
    (mixtral: block_sparse_moe.experts.E.w1/w3/w2; else mlp.experts.E.gate_proj/up_proj/down_proj)."""
    d, m, v = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size
    result = [
        Entry(("embedding",), (), lambda: "model.embed_tokens.weight", ((v,), (d,)), (0, 1)),
        Entry(("final_norm", "scale"), (), lambda: "model.norm.weight", ((d,),), (0,)),
    ]
    if not cfg.tie_embeddings:
        result.append(Entry(("unembedding",), (), lambda: "lm_head.weight", ((v,), (d,)), (1, 0)))
    moe = cfg.moe
    if not moe.enabled:
        return result + _layer(cfg, ("blocks",), lambda u: u, cfg.num_layers, None, family)
    first, every, units = moe.first_dense_layers, moe.every, cfg.stacked_units
    if first:
        result += _layer(cfg, ("dense_blocks",), lambda u: u, first, None, family)
    for j in range(every - 1):
        result += _layer(cfg, ("blocks", "dense", str(j)), lambda u, j=j: first + u * every + j, units, None, family)
    return result + _layer(cfg, ("blocks", "expert_layer"), lambda u: first + u * every + every - 1, units,
                           moe.expert_width(m), family)


def _layer(cfg: TransformerConfig, prefix: tuple[str, ...], layer: Callable[[int], int], count: int,
           expert_width: int | None, family: str) -> list[Entry]:
    """Returns the entries of one stacked layer's parameters: `count` layers, stack index u being layer
    `layer(u)`; an MoE feed-forward with experts `expert_width` wide, or a dense one when None."""
    d, h, g, k, m = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim

    def at(suffix: str) -> Callable[[int], str]:
        return lambda u: f"model.layers.{layer(u)}.{suffix}"

    def entry(path: str, suffix: str, groups, perm) -> Entry:
        return Entry((*prefix, *path.split(".")), (count,), at(suffix), groups, perm)

    attention = "self_attn."
    result = [
        entry("attention_norm.scale", "input_layernorm.weight", ((d,),), (0,)),
        entry("mlp_norm.scale", "post_attention_layernorm.weight", ((d,),), (0,)),
        entry("attention.query", attention + "q_proj.weight", ((h, k), (d,)), (2, 0, 1)),
        entry("attention.key", attention + "k_proj.weight", ((g, k), (d,)), (2, 0, 1)),
        entry("attention.value", attention + "v_proj.weight", ((g, k), (d,)), (2, 0, 1)),
        entry("attention.out", attention + "o_proj.weight", ((d,), (h, k)), (1, 2, 0)),
    ]
    if cfg.qkv_bias:
        result += [entry("attention.query_bias", attention + "q_proj.bias", ((h, k),), (0, 1)),
                   entry("attention.key_bias", attention + "k_proj.bias", ((g, k),), (0, 1)),
                   entry("attention.value_bias", attention + "v_proj.bias", ((g, k),), (0, 1))]
    if cfg.out_bias:
        result.append(entry("attention.out_bias", attention + "o_proj.bias", ((d,),), (0,)))
    if cfg.qk_norm:
        result += [entry("attention.query_norm.scale", attention + "q_norm.weight", ((k,),), (0,)),
                   entry("attention.key_norm.scale", attention + "k_norm.weight", ((k,),), (0,))]
    if expert_width is None:
        return result + [entry("mlp.gate", "mlp.gate_proj.weight", ((m,), (d,)), (1, 0)),
                         entry("mlp.up", "mlp.up_proj.weight", ((m,), (d,)), (1, 0)),
                         entry("mlp.down", "mlp.down_proj.weight", ((d,), (m,)), (1, 0))]
    e, w = cfg.moe.num_experts, expert_width
    block, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral"
                               else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    result.append(entry("mlp.router", f"{block}.gate.weight", ((e,), (d,)), (1, 0)))
    for path, tensor, groups in (("mlp.gate", gate, ((w,), (d,))), ("mlp.up", up, ((w,), (d,))),
                                 ("mlp.down", down, ((d,), (w,)))):
        result.append(Entry((*prefix, *path.split(".")), (count, e),
                            lambda u, x, tensor=tensor: f"model.layers.{layer(u)}.{block}.experts.{x}.{tensor}.weight",
                            groups, (1, 0)))
    return result
