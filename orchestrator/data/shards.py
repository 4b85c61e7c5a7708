"""Prepared token shards on disk: flat token files, document indexes, metadata; read by random access.

A directory written by `nestor data prepare` holds, per split (`train`,
`eval`) and shard number:
- `<split>-NNNNN.tokens`: the token ids of the shard's documents end to end,
  each document followed by DOCUMENT_SEPARATOR, as raw `uint16` (vocabularies
  up to 65,536) or `uint32`;
- `<split>-NNNNN.documents`: int64 [documents + 1], where each document starts
  in the token file (the last entry is the file's length in tokens);
- `metadata.json`: the tokenizer (kind, fingerprint, vocabulary size), the
  token dtype, and per split the token and document counts of every shard.

The token files are the packed stream itself, so a window of seq_len + 1
tokens is one slice of a memory map (two at a shard boundary): no parsing,
no decompression, any window in O(1). That is why the format is flat files
rather than Grain's ArrayRecord (docs/data.md has the measurement).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path

import numpy as np

from nestor.orchestrator.errors import ConfigError

FORMAT = "nestor-tokens-1"
METADATA = "metadata.json"
SPLITS = ("train", "eval")
# Packed documents are separated by token 0: NUL never occurs in text files, and a separator stops the
# model from learning to continue one document into the next; the loss derives segment ids from it.
DOCUMENT_SEPARATOR = 0
VOCAB_MULTIPLE = 128  # a vocabulary any mesh splits: prepared tokenizers' ids are rounded up to a multiple of it
TEXT_PROBE_BYTES = 8192  # as much of each file as is read to tell text from binary, like git does


def token_dtype(vocab_size: int) -> np.dtype:
    """Returns the narrowest unsigned dtype that holds every id of a `vocab_size` vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def shard_name(split: str, index: int) -> str:
    """Returns the file stem of shard `index` of `split`, e.g. `train-00003`."""
    return f"{split}-{index:05d}"


def write_atomically(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file renamed over it: a reader never sees half a file."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    temporary.replace(path)


def write_shard(directory: Path, name: str, documents: list[np.ndarray], dtype: np.dtype) -> tuple[int, int]:
    """Writes `documents` (token id arrays) as shard `name`; returns (tokens with separators, documents)."""
    lengths = np.array([len(d) + 1 for d in documents], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.full(int(starts[-1]), DOCUMENT_SEPARATOR, dtype)
    for start, document in zip(starts[:-1], documents):
        tokens[start:start + len(document)] = document
    write_atomically(directory / f"{name}.tokens", tokens.tobytes())
    write_atomically(directory / f"{name}.documents", starts.tobytes())
    return int(starts[-1]), len(documents)


def read_metadata(directory: Path, key: str) -> dict:
    """Returns a prepared directory's metadata; raises ConfigError naming `key` when it is not one."""
    file = directory / METADATA
    if not file.is_file():
        why = "no such directory" if not directory.is_dir() else f"no {METADATA}"
        raise ConfigError([(key, f"{directory}: {why}; give a directory `nestor data prepare --out` finished "
                                 "(an interrupted prepare resumes when run again)")])
    metadata = json.loads(file.read_text())
    if metadata.get("format") != FORMAT:
        raise ConfigError([(key, f"{file} is format {metadata.get('format')!r}, not {FORMAT!r}; prepare it again")])
    return metadata


def documents_of(directory: Path, name: str) -> np.ndarray:
    """Returns the document starts of shard `name`, int64 [documents + 1]."""
    return np.fromfile(directory / f"{name}.documents", np.int64)


class TokenStream:
    """The shards of one split of prepared directories as one stream of tokens, read by random access.

    Every shard's file is memory-mapped on first use; `read` copies out only
    the slices asked for, and counts them (`windows_read`, `tokens_read`) so a
    test can show that a process reads only its own rows.
    """

    def __init__(self, directories: list[Path], split: str, key: str):
        self.files: list[Path] = []
        sizes = []
        for directory in directories:
            metadata = read_metadata(directory, key)
            self.dtype = np.dtype(metadata["dtype"])
            for shard in metadata["splits"][split]["shards"]:
                file = directory / f"{shard['name']}.tokens"
                expected = shard["tokens"] * self.dtype.itemsize
                if not file.is_file() or file.stat().st_size != expected:
                    found = "missing" if not file.is_file() else f"{file.stat().st_size} bytes, not {expected}"
                    raise ConfigError([(key, f"shard {file} is {found}; prepare {directory} again")])
                if shard["tokens"]:
                    self.files.append(file)
                    sizes.append(shard["tokens"])
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self._maps: dict[int, np.memmap] = {}
        self.windows_read = 0
        self.tokens_read = 0

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    def _map(self, shard: int) -> np.memmap:
        if shard not in self._maps:
            self._maps[shard] = np.memmap(self.files[shard], self.dtype, mode="r")
        return self._maps[shard]

    def read(self, begin: int, end: int) -> np.ndarray:
        """Returns tokens [begin, end) of the stream as int32 (crossing shard boundaries as needed)."""
        pieces, position = [], begin
        shard = bisect.bisect_right(self.starts, begin) - 1
        while position < end:
            offset = position - int(self.starts[shard])
            stop = min(end, int(self.starts[shard + 1])) - int(self.starts[shard])
            pieces.append(self._map(shard)[offset:stop])
            position = int(self.starts[shard]) + stop
            shard += 1
        self.windows_read += 1
        self.tokens_read += end - begin
        return np.concatenate(pieces).astype(np.int32)


def directories_fingerprint(directories: list[Path], key: str) -> str:
    """Returns a hash of the directories' metadata files: it changes when any shard is prepared anew."""
    digest = hashlib.sha256()
    for directory in directories:
        read_metadata(directory, key)
        digest.update((directory / METADATA).read_bytes())
    return digest.hexdigest()[:16]
