"""Whole documents packed into rows: how chat and instruction shards (tokens with loss weights) are read.

A window of the packed stream would cut conversations at arbitrary places, so
weighted shards are read as rows instead: the documents, in a seeded
permutation, are laid greedily into rows of seq_len + 1 tokens, each row
opening with the separator and every document followed by its own, as
`data.document_mask` segments them: each conversation sees the separator
before it and its own tokens, wherever it lies in a row (as it would alone
at the start of one). A document that does not fit the rest of a row starts
the next; one longer than a row fills a row alone, truncated (`truncated`
counts them). What is left of a row is separators of weight 0. Rows are
packed once; each epoch visits them in a permutation of its own, like windows.
"""

from __future__ import annotations

import numpy as np

from nestor.orchestrator.data.shards import TokenStream
from nestor.orchestrator.errors import ConfigError


def pack(lengths: np.ndarray, width: int, seed) -> tuple[list[np.ndarray], int]:
    """Returns (rows as arrays of document indices, documents truncated): documents of `lengths` tokens (their
    separator included) in a permutation by `seed`, laid greedily into rows of `width` tokens that open with
    one separator."""
    rows, current, used, truncated = [], [], 1, 0
    for document in np.random.default_rng(seed).permutation(len(lengths)):
        length = int(lengths[document])
        if current and used + length > width:
            rows.append(np.asarray(current))
            current, used = [], 1
        current.append(document)
        used += length
        if used >= width:
            truncated += used > width
            rows.append(np.asarray(current))
            current, used = [], 1
    return rows + ([np.asarray(current)] if current else []), truncated


class PackedRows:
    """The rows of whole documents of one weighted token stream (see the module doc)."""

    def __init__(self, stream: TokenStream, width: int, seed):
        self.stream, self.width = stream, width
        self.starts = stream.document_starts()
        self.rows, self.truncated = pack(np.diff(self.starts), width, seed)
        if not self.rows:
            raise ConfigError([(stream.key, "holds no conversation in this split; prepare more data (or a larger "
                                            "--eval-fraction for the held-out split)")])

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Returns row `index`: its tokens, int32 [width], and their loss weights, float32 [width]."""
        tokens = np.full(self.width, self.stream.separator, np.int32)
        weights = np.zeros(self.width, np.float32)
        position = 1
        for document in self.rows[index]:
            begin = int(self.starts[document])
            end = min(int(self.starts[document + 1]), begin + self.width - position)
            tokens[position:position + end - begin] = self.stream.read(begin, end)
            weights[position:position + end - begin] = self.stream.read_weights(begin, end)
            position += end - begin
        return tokens, weights
