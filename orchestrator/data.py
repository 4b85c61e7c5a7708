"""Deterministic global batches; each process builds only the rows it holds.

A batch is int32 tokens [global_batch, seq_len + 1] (inputs are [:, :-1],
targets [:, 1:]). Row r of step s depends only on (run.seed, s, r), never on
the mesh or the number of processes, so any two meshes see the same data.
"""

from __future__ import annotations

import numpy as np
import jax
from jax.sharding import NamedSharding

from orchestrator.config import Config


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> range:
    """Returns the rows of a batch that this process's devices hold (contiguous by construction)."""
    indices = sharding.addressable_devices_indices_map(global_shape).values()
    starts = [index[0].start or 0 for index in indices]
    stops = [global_shape[0] if index[0].stop is None else index[0].stop for index in indices]
    return range(min(starts), max(stops))


class SyntheticData:
    """Arithmetic progressions modulo the vocabulary: token_t = (start + stride * t) mod vocab.

    Each row draws its start and stride (1..7) from (seed, step, row), so a
    model can learn the rule from the first two tokens: the loss visibly falls.
    """

    def __init__(self, config: Config, sharding: NamedSharding):
        self.seed = config.run.seed
        self.vocab = config.model.vocab_size
        self.shape = (config.train.global_batch, config.train.seq_len + 1)
        self.sharding = sharding

    def rows(self, step: int, rows: range) -> np.ndarray:
        """Returns the tokens of `rows` of global batch `step`, int32 [len(rows), seq_len + 1]."""
        out = np.empty((len(rows), self.shape[1]), np.int32)
        positions = np.arange(self.shape[1], dtype=np.int64)
        for i, row in enumerate(rows):
            rng = np.random.default_rng((self.seed, step, row))
            start, stride = rng.integers(0, self.vocab), rng.integers(1, 8)
            out[i] = (start + stride * positions) % self.vocab
        return out

    def batch(self, step: int) -> jax.Array:
        """Returns global batch `step` as one array sharded by `self.sharding`."""
        rows = local_rows(self.sharding, self.shape)
        return jax.make_array_from_process_local_data(self.sharding, self.rows(step, rows), self.shape)
