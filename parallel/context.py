"""Context parallelism: the positions of a sequence split over the `context` mesh axis.

Layout. A row of L places is cut into 2C chunks of L / 2C; each of the C
context devices holds two. Balanced (the default), device d holds chunks d and
2C-1-d, one early and one late (the striping of MaxText and torchtitan), so
under the causal mask every device sees the same number of (query, key)
pairs; contiguous, it holds chunks 2d and 2d+1 and the last device does most
of the work. `SequenceLayout.arrange` puts a row in the layout's order and
`positions` says which position of the sequence each place holds: RoPE and the
causal mask read those, the loss (a mean over tokens) does not care.

Attention across shards runs inside `jax.shard_map`, blockwise with an online
softmax (flash attention, arXiv 2205.14135), each device's two query chunks
against every device's two key/value chunks:
- all_gather: the keys, values and their segment ids are gathered over the
  context axis once per layer (grouped-query attention: only the kv heads
  travel); their gradient returns by a reduce-scatter.
- ring (Ring Attention, arXiv 2310.01889): the key/value chunks travel
  around the ring by collective permutes, C steps of which the first C - 1
  send the pair on before computing with it, so the transfer can hide behind
  the compute.
A (query chunk, key chunk) pair is computed only where the key chunk does not
come after the query chunk; the diagonal pairs are masked causally. Segment
ids travel with the keys, so no token attends across a document separator.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nestor.parallel.rules import Rules, partition_spec, shard_map_here, split_degree

ALL_GATHER = "all_gather"
RING = "ring"
STRATEGIES = (ALL_GATHER, RING)
_MASKED = -1e30  # a score no query sees (finite: a row with nothing visible yet stays free of NaNs)
QUERY_BLOCK = 1024  # queries per block of a (query chunk, key chunk) pair: its scores are [b, block, heads, chunk]


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """How the places of a row sit on `context` devices: two chunks of length / 2C each, balanced or not."""

    context: int
    balanced: bool = True

    def device_chunks(self, device):
        """Returns the chunk indices (early, late) device `device` holds (ints, or traced int32 arrays)."""
        if self.balanced:
            return device, 2 * self.context - 1 - device
        return 2 * device, 2 * device + 1

    def arrange(self, x: jax.Array, axis: int = 1) -> jax.Array:
        """Returns `x` with its `axis` (a row's places, divisible by 2C) in the layout's order."""
        if not self.balanced or self.context == 1:
            return x
        xp = np if isinstance(x, np.ndarray) else jnp
        axis = axis % x.ndim
        length = x.shape[axis]
        chunk = length // (2 * self.context)
        halves = x.reshape(*x.shape[:axis], 2, self.context, chunk, *x.shape[axis + 1:])
        early = xp.take(halves, 0, axis=axis)
        late = xp.flip(xp.take(halves, 1, axis=axis), axis=axis)  # chunks 2C-1 .. C
        return xp.stack([early, late], axis=axis + 1).reshape(x.shape)

    def positions(self, length: int) -> np.ndarray:
        """Returns the position in the sequence of each of a row's `length` places [length] (int32)."""
        return self.arrange(np.arange(length, dtype=np.int32)[None])[0]

    def visible_pairs(self, device: int) -> int:
        """Returns how many (query chunk, key chunk) pairs device `device` computes (`computes`)."""
        return sum(int(computes(q, k)) for q in self.device_chunks(device)
                   for other in range(self.context) for k in self.device_chunks(other))


def computes(query_chunk, key_chunk):
    """Whether a (query chunk, key chunk) pair is computed: where the key chunk does not come after the query
    chunk (the causal mask hides every other pair whole). Ints, or traced int32 scalars."""
    return key_chunk <= query_chunk


@dataclasses.dataclass(frozen=True)
class AttentionAxes:
    """The logical names of attention's operands (models name them; parallel maps them)."""

    batch: str
    length: str
    heads: str
    kv_heads: str


def context_degree(mesh: Mesh, rules: Rules, axes: AttentionAxes) -> int:
    """Returns the number of devices a row's places are split over on `mesh`."""
    return split_degree(axes.length, rules, mesh.shape)


def context_attention(strategy: str, mesh: Mesh, rules: Rules, axes: AttentionAxes,
                      layout: SequenceLayout) -> Callable:
    """Returns attention(query [b, L, heads, k], key [b, L, kv_heads, k], value, segment_ids [b, L] | None,
    positions [L]) -> [b, L, heads, k]: causal attention within segments over a row laid out by `layout`
    on the context axes of `mesh`, by `strategy` (ALL_GATHER or RING). Raises ValueError when `positions`
    are not the layout's."""
    if strategy not in STRATEGIES:
        raise ValueError(f"context attention {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    names = tuple(rules.get(axes.length, ()))
    query_spec = partition_spec((axes.batch, axes.length, axes.heads, None), rules)
    kv_spec = partition_spec((axes.batch, axes.length, axes.kv_heads, None), rules)
    row_spec = partition_spec((axes.batch, axes.length), rules)

    def attention(query, key, value, segment_ids, positions):
        length = query.shape[1]
        if not np.array_equal(np.asarray(positions), layout.positions(length)):
            raise ValueError("context attention: the positions are not those of the installed sequence layout "
                             "(arrange the row with models.axes.sequence_layout())")
        if segment_ids is None:
            segment_ids = jnp.zeros(query.shape[:2], jnp.int32)
        on_device = _on_device(strategy, names, layout, length // (2 * layout.context))
        return shard_map_here(on_device, mesh, (query_spec, kv_spec, kv_spec, row_spec), query_spec)(
            query, key, value, segment_ids)

    return attention


def _on_device(strategy: str, names: tuple[str, ...], layout: SequenceLayout, chunk: int) -> Callable:
    """Returns one device's attention of its two query chunks against every device's key/value chunks."""
    count = layout.context

    def on_device(query, key, value, segment_ids):
        batch, _, heads, head_dim = query.shape
        kv_heads = key.shape[2]
        device = jax.lax.axis_index(names)
        # [b, 2 chunks, chunk, kv_heads, heads per kv head, k]: query head h reads kv head h // (heads / kv_heads)
        queries = query.reshape(batch, 2, chunk, kv_heads, heads // kv_heads, head_dim) / math.sqrt(head_dim)
        pair = (key.reshape(batch, 2, chunk, kv_heads, head_dim), value.reshape(batch, 2, chunk, kv_heads, head_dim),
                segment_ids.reshape(batch, 2, chunk))
        query_segments = pair[2]
        query_chunks = layout.device_chunks(device)
        shape = (batch, chunk, kv_heads, heads // kv_heads)
        start = tuple((jnp.zeros((*shape, head_dim), jnp.float32), jnp.full(shape, _MASKED, jnp.float32),
                       jnp.zeros(shape, jnp.float32)) for _ in range(2))
        gathered = jax.lax.all_gather(pair, names) if strategy == ALL_GATHER else None  # [C, ...] each

        def attend(sums, held, offset):  # this device's queries against the chunks of the device `offset` before
            source = (device - offset) % count
            if gathered is not None:
                held = jax.tree.map(lambda part: part[source], gathered)
            keys, values, key_segments = held
            key_chunks = layout.device_chunks(source)
            updated = []
            for q in range(2):
                state = sums[q]
                for k in range(2):
                    operands = (queries[:, q], query_chunks[q], query_segments[:, q],
                                keys[:, k], values[:, k], key_chunks[k], key_segments[:, k])
                    state = jax.lax.cond(computes(query_chunks[q], key_chunks[k]), _attend_chunk,
                                         lambda s, *_: s, state, *operands)
                updated.append(state)
            return tuple(updated)

        def ring_step(carry, offset):
            sums, held = carry
            # sent before the compute below, which does not need it: the permute can overlap it
            following = jax.lax.ppermute(held, names, [(i, (i + 1) % count) for i in range(count)])
            return (attend(sums, held, offset), following), None

        if strategy == RING:  # C - 1 steps that pass the chunks on, then the last without a send
            (sums, held), _ = jax.lax.scan(ring_step, (start, pair), jnp.arange(count - 1))
            sums = attend(sums, held, count - 1)
        else:
            sums, _ = jax.lax.scan(lambda sums, offset: (attend(sums, pair, offset), None), start, jnp.arange(count))
        outputs = [jnp.where(total[..., None] > 0, out / jnp.maximum(total, 1e-30)[..., None], 0.0)
                   for out, _, total in sums]
        return jnp.stack(outputs, axis=1).reshape(query.shape).astype(query.dtype)

    return on_device


def _attend_chunk(state, queries, query_chunk, query_segments, keys, values, key_chunk, key_segments):
    """Returns the online-softmax sums (output [b, c, g, r, k], running max, total [b, c, g, r]) of one query
    chunk of c places after it attends to one key/value chunk: causal by position, within segments. The
    queries go in blocks of at most QUERY_BLOCK, so a pair's scores never exceed [b, block, g, r, c]."""
    batch, chunk = queries.shape[:2]
    block = max(size for size in range(1, min(chunk, QUERY_BLOCK) + 1) if chunk % size == 0)
    blocks = chunk // block

    def in_blocks(x):  # [b, c, ...] -> [blocks, b, block, ...]
        return jnp.moveaxis(x.reshape(batch, blocks, block, *x.shape[2:]), 1, 0)

    def attend_block(inputs):
        index, block_state, block_queries, block_segments = inputs
        first = query_chunk * chunk + index * block  # the block's first position
        return _attend_block(block_state, block_queries, first, block_segments, keys, values,
                             key_chunk * chunk, key_segments)

    if blocks == 1:  # the whole chunk in one block: no loop to trace, lower and compile
        return attend_block((0, state, queries, query_segments))
    outputs = jax.lax.map(attend_block, (jnp.arange(blocks), jax.tree.map(in_blocks, state), in_blocks(queries),
                                         in_blocks(query_segments)))
    return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1).reshape(batch, chunk, *x.shape[3:]), outputs)


@jax.checkpoint  # the backward pass recomputes a block's scores rather than keep them (flash attention's trade)
def _attend_block(state, queries, first_query, query_segments, keys, values, first_key, key_segments):
    """Returns the online-softmax sums of a block of queries at positions first_query, ... after it attends
    to keys at positions first_key, ...: causal by position, within segments."""
    out, running_max, total = state
    scores = jnp.einsum("bqgrd,bkgd->bqgrk", queries, keys, preferred_element_type=jnp.float32)
    causal = (first_query + jnp.arange(queries.shape[1]))[:, None] >= (first_key + jnp.arange(keys.shape[1]))[None, :]
    visible = causal[None, :, None, None, :] & (query_segments[:, :, None] == key_segments[:, None, :]
                                                )[:, :, None, None, :]
    scores = jnp.where(visible, scores, _MASKED)
    new_max = jnp.maximum(running_max, scores.max(axis=-1))
    probabilities = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
    correction = jnp.exp(running_max - new_max)
    context = jnp.einsum("bqgrk,bkgd->bqgrd", probabilities.astype(values.dtype), values,
                         preferred_element_type=jnp.float32)
    return out * correction[..., None] + context, new_max, total * correction + probabilities.sum(axis=-1)


def exchange_bytes(layout: SequenceLayout, batch_per_device: int, length: int, kv_heads: int, head_dim: int,
                   itemsize: int) -> int:
    """Returns the bytes one device receives per attention layer in the forward pass: the other C - 1 devices'
    keys, values ([rows, L / C, kv heads on this device, k] each) and int32 segment ids (the same for both
    strategies: the all-gather brings them at once, the ring one device's worth in each of C - 1 steps)."""
    per_device = length // layout.context
    held = batch_per_device * per_device * (2 * kv_heads * head_dim * itemsize + 4)
    return (layout.context - 1) * held
