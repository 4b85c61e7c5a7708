"""Prepared token shards on disk: flat token files, document indexes, metadata; read by random access.

A directory written by `nestor data prepare` holds, per split (`train`,
`eval`) and shard number:
- `<split>-NNNNN.tokens`: the token ids of the shard's documents end to end,
  each document followed by the separator (orchestrator.data.separator), as
  raw `uint16` (vocabularies up to 65,536) or `uint32`;
- `<split>-NNNNN.documents`: int64 [documents + 1], where each document starts
  in the token file (the last entry is the file's length in tokens);
- `<split>-NNNNN.weights` (chat and instruction data only): uint8, one per
  token, the token's loss weight as a target (1 on assistant or completion
  tokens, 0 elsewhere and on separators);
- `metadata.json`: the tokenizer (kind, fingerprint, vocabulary size), the
  token dtype, the separator (absent in shards of before it: 0), whether
  shards carry loss weights, and per split the token and document counts of
  every shard.

The token files are the packed stream itself, so a window of seq_len + 1
tokens is one slice of a memory map (two at a shard boundary): no parsing,
no decompression, any window in O(1). That is why the format is flat files
rather than Grain's ArrayRecord (docs/data.md has the measurement).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from pathlib import Path

import numpy as np

from nestor.orchestrator.errors import ConfigError

FORMAT = "nestor-tokens-1"
METADATA = "metadata.json"
SPLITS = ("train", "eval")
# Shards whose metadata names no separator were written with token 0 (byte-level NUL): a separator stops the
# model from learning to continue one document into the next; the loss derives segment ids from it.
LEGACY_SEPARATOR = 0
WEIGHTS_DTYPE = np.dtype(np.uint8)
VOCAB_MULTIPLE = 128  # a vocabulary any mesh splits: prepared tokenizers' ids are rounded up to a multiple of it
TEXT_PROBE_BYTES = 8192  # as much of each file as prepare reads to skip a binary input, like git does
SCAN_BYTES = 2**24  # a text file is read for NUL bytes this much at a time
CHECKED_DOCUMENTS = 1024  # documents of a shard whose ends are checked against its index when it is opened


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


def write_shard(directory: Path, name: str, documents: list[np.ndarray], dtype: np.dtype, separator: int,
                weights: list[np.ndarray] | None = None) -> tuple[int, int]:
    """Writes `documents` (token id arrays, each followed by `separator`) as shard `name`, with their
    per-token loss `weights` (0 on the separators) when given; returns (tokens with separators, documents)."""
    lengths = np.array([len(d) + 1 for d in documents], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.full(int(starts[-1]), separator, dtype)
    for start, document in zip(starts[:-1], documents):
        tokens[start:start + len(document)] = document
    write_atomically(directory / f"{name}.tokens", tokens.tobytes())
    if weights is not None:
        flat = np.zeros(int(starts[-1]), WEIGHTS_DTYPE)
        for start, weight in zip(starts[:-1], weights):
            flat[start:start + len(weight)] = weight
        write_atomically(directory / f"{name}.weights", flat.tobytes())
    write_atomically(directory / f"{name}.documents", starts.tobytes())
    return int(starts[-1]), len(documents)


def separator_of(metadata: dict) -> int:
    """Returns the separator a prepared directory's shards were written with (LEGACY_SEPARATOR when its
    metadata, of before `data.separator`, names none)."""
    return metadata.get("separator", LEGACY_SEPARATOR)


def has_weights(metadata: dict) -> bool:
    """Returns whether a prepared directory's shards carry per-token loss weights (chat, instruction data)."""
    return bool(metadata.get("loss_weights", False))


def read_metadata(directory: Path, key: str) -> dict:
    """Returns a prepared directory's metadata; raises ConfigError naming `key` when it is not one (no
    metadata.json, or one that is not JSON or lacks what `nestor data prepare` writes)."""
    file = directory / METADATA
    if not file.is_file():
        why = "no such directory" if not directory.is_dir() else f"no {METADATA}"
        raise ConfigError([(key, f"{directory}: {why}; give a directory `nestor data prepare --out` finished "
                                 "(an interrupted prepare resumes when run again)")])
    try:
        metadata = json.loads(file.read_text())
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError([(key, f"{file} is not JSON ({error}); prepare {directory} again")]) from None
    found = metadata.get("format") if isinstance(metadata, dict) else type(metadata).__name__
    if found != FORMAT:
        raise ConfigError([(key, f"{file} is format {found!r}, not {FORMAT!r}; prepare it again")])
    if problem := _metadata_problem(metadata):
        raise ConfigError([(key, f"{file} {problem}; prepare {directory} again")])
    return metadata


def _metadata_problem(metadata: dict) -> str | None:
    """Returns what a metadata.json of FORMAT lacks of what prepare writes, or None."""
    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    tokenizer = metadata.get("tokenizer")
    if not isinstance(tokenizer, dict) or not all(isinstance(tokenizer.get(name), str) for name in
                                                  ("path", "fingerprint")) or not count(tokenizer.get("vocab_size")) \
            or not tokenizer["vocab_size"]:
        return "has no tokenizer {path, fingerprint, vocab_size}"
    if not count(metadata.get("separator", LEGACY_SEPARATOR)) or metadata.get("separator", 0) >= \
            tokenizer["vocab_size"]:
        return f"names separator {metadata.get('separator')!r}, not an id of its {tokenizer['vocab_size']} tokens"
    if not isinstance(metadata.get("loss_weights", False), bool):
        return f"names loss_weights {metadata.get('loss_weights')!r}, not true or false"
    if metadata.get("dtype") != token_dtype(tokenizer["vocab_size"]).name:
        return (f"names token dtype {metadata.get('dtype')!r}, not {token_dtype(tokenizer['vocab_size']).name} "
                f"of a {tokenizer['vocab_size']}-token vocabulary")
    splits = metadata.get("splits")
    for split in SPLITS:
        shards = splits.get(split, {}).get("shards") if isinstance(splits, dict) and \
            isinstance(splits.get(split), dict) else None
        if not isinstance(shards, list) or not all(
                isinstance(shard, dict) and isinstance(shard.get("name"), str) and
                re.fullmatch(rf"{split}-\d{{5,}}", shard["name"]) and count(shard.get("tokens")) and
                count(shard.get("documents")) for shard in shards):
            return f"lists no {split} split of shards {{name: {shard_name(split, 0)}, tokens, documents}}"
    return None


def documents_of(directory: Path, name: str) -> np.ndarray:
    """Returns the document starts of shard `name`, int64 [documents + 1]."""
    return np.fromfile(directory / f"{name}.documents", np.int64)


def shard_problem(directory: Path, shard: dict, dtype: np.dtype, separator: int = LEGACY_SEPARATOR,
                  weights: bool = False) -> str | None:
    """Returns what is wrong with the files of a listed shard of `directory`, or None: a token (or, with
    `weights`, weights) file of another size than the metadata's, or a documents index that does not match
    the tokens (each document ends in `separator`: the last token of CHECKED_DOCUMENTS documents spread
    over the shard). Reads
    the index and those tokens, not the corpus (it may be terabytes): ids are checked against the vocabulary
    as they are read (`TokenStream.read`)."""
    file, index = directory / f"{shard['name']}.tokens", directory / f"{shard['name']}.documents"
    expected = shard["tokens"] * dtype.itemsize
    if not file.is_file() or file.stat().st_size != expected:
        return f"{file} is {'missing' if not file.is_file() else f'{file.stat().st_size} bytes, not {expected}'}"
    weights_file = directory / f"{shard['name']}.weights"
    if weights and (not weights_file.is_file() or weights_file.stat().st_size != shard["tokens"]):
        found = "missing" if not weights_file.is_file() else f"{weights_file.stat().st_size} bytes"
        return f"{weights_file} is {found}, not one loss weight per token ({shard['tokens']} bytes)"
    if not index.is_file() or index.stat().st_size != (shard["documents"] + 1) * 8:
        found = "missing" if not index.is_file() else f"{index.stat().st_size} bytes"
        return f"{index} is {found}, not the {shard['documents'] + 1} int64 document starts of {METADATA}"
    if not shard["tokens"]:
        return None
    tokens = np.memmap(file, dtype, mode="r")
    starts = documents_of(directory, shard["name"])
    ends = starts[1:][np.linspace(0, len(starts) - 2, min(len(starts) - 1, CHECKED_DOCUMENTS)).astype(np.int64)]
    if starts[0] != 0 or starts[-1] != len(tokens) or np.any(np.diff(starts) < 1) \
            or np.any(tokens[ends - 1] != separator):
        return f"{index} does not index the documents of {file.name} (each ends in token {separator})"
    return None


def first_nul(path: Path) -> int | None:
    """Returns the offset of the first NUL byte of a file, or None: NUL never occurs in text, and token 0 is
    byte-level text's document separator. Reads the whole file, wherever its first NUL lies."""
    offset = 0
    with path.open("rb") as file:
        while chunk := file.read(SCAN_BYTES):
            if (found := chunk.find(b"\0")) >= 0:
                return offset + found
            offset += len(chunk)
    return None


class TokenStream:
    """The shards of one split of prepared directories as one stream of tokens, read by random access.

    Every shard's file is memory-mapped on first use; `read` copies out only
    the slices asked for, checks their ids against the shard's vocabulary, and
    counts them (`windows_read`, `tokens_read`) so a test can show that a
    process reads only its own rows.
    """

    def __init__(self, directories: list[Path], split: str, key: str):
        self.key = key
        self.files: list[Path] = []
        self.vocab_sizes: list[int] = []
        sizes = []
        found = {}  # (separator, loss weights) -> the first directory written with them
        for directory in directories:
            metadata = read_metadata(directory, key)
            self.dtype = np.dtype(metadata["dtype"])
            self.separator, self.weighted = separator_of(metadata), has_weights(metadata)
            found.setdefault((self.separator, self.weighted), directory)
            for shard in metadata["splits"][split]["shards"]:
                if problem := shard_problem(directory, shard, self.dtype, self.separator, self.weighted):
                    raise ConfigError([(key, f"shard {problem}; prepare {directory} again")])
                if shard["tokens"]:
                    self.files.append(directory / f"{shard['name']}.tokens")
                    self.vocab_sizes.append(metadata["tokenizer"]["vocab_size"])
                    sizes.append(shard["tokens"])
        if len(found) > 1:
            shown = "; ".join(f"{directory}: separator {separator}, {'with' if weighted else 'no'} loss weights"
                              for (separator, weighted), directory in found.items())
            raise ConfigError([(key, f"the directories were prepared differently ({shown}); prepare them alike")])
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self._maps: dict[int, np.memmap] = {}
        self._weight_maps: dict[int, np.memmap] = {}
        self.windows_read = 0
        self.tokens_read = 0

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    def _map(self, shard: int) -> np.memmap:
        if shard not in self._maps:
            self._maps[shard] = np.memmap(self.files[shard], self.dtype, mode="r")
        return self._maps[shard]

    def document_starts(self) -> np.ndarray:
        """Returns where every document of the stream starts, int64 [documents + 1] (the last entry is the
        stream's length): each shard's index, shifted to the shard's place in the stream."""
        pieces = [np.fromfile(file.with_suffix(".documents"), np.int64)[:-1] + start
                  for file, start in zip(self.files, self.starts[:-1])]
        return np.concatenate([*pieces, self.starts[-1:]]).astype(np.int64)

    def _weight_map(self, shard: int) -> np.memmap:
        if shard not in self._weight_maps:
            self._weight_maps[shard] = np.memmap(self.files[shard].with_suffix(".weights"), WEIGHTS_DTYPE, mode="r")
        return self._weight_maps[shard]

    def _spans(self, begin: int, end: int) -> list[tuple[int, int, int]]:
        """Returns (shard, start, stop) within each shard of stream positions [begin, end), in order."""
        spans, position = [], begin
        shard = bisect.bisect_right(self.starts, begin) - 1
        while position < end:
            stop = min(end, int(self.starts[shard + 1]))
            spans.append((shard, position - int(self.starts[shard]), stop - int(self.starts[shard])))
            position, shard = stop, shard + 1
        return spans

    def read_weights(self, begin: int, end: int) -> np.ndarray:
        """Returns the loss weights of tokens [begin, end) of the stream as float32 (shards with weights)."""
        return np.concatenate([self._weight_map(shard)[start:stop]
                               for shard, start, stop in self._spans(begin, end)]).astype(np.float32)

    def read(self, begin: int, end: int) -> np.ndarray:
        """Returns tokens [begin, end) of the stream as int32 (crossing shard boundaries as needed).

        Raises ConfigError naming the shard when an id lies outside its tokenizer's vocabulary (a damaged or
        foreign file: it trained to NaN)."""
        pieces = []
        for shard, start, stop in self._spans(begin, end):
            pieces.append(self._map(shard)[start:stop])
            if (largest := int(pieces[-1].max())) >= self.vocab_sizes[shard]:
                raise ConfigError([(self.key, f"{self.files[shard]} holds token id {largest}, outside its "
                                              f"tokenizer's {self.vocab_sizes[shard]} ids (a damaged or foreign "
                                              f"file); prepare {self.files[shard].parent} again")])
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
