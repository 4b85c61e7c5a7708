"""`data.source: tokens`: prepared token shards, one directory set or a weighted mixture of several.

Each source is the packed stream of its directories' shards (one split),
read in windows of seq_len + 1 tokens through its own seeded permutation
(`WindowOrder`), exactly like the text source. With `data.mixture`, the
source of the row at global position p = step * global_batch + row is
picked by a Weyl sequence, u_p = frac(offset + p / golden ratio) (offset
drawn from run.seed), compared with the cumulative weights: a pure function
of (seed, step, row) whose shares match the weights to within about
log(N) / N over any N consecutive rows (low discrepancy; random draws would
err by 1 / sqrt(N)). The chosen source reads window `order(p)` of its own
permutation, so each source is sampled evenly whatever its weight.

Chat and instruction shards (with loss weights) are read as rows of whole
conversations instead of windows (orchestrator.data.packing), and their rows
carry "loss_weights" [rows, seq_len]: each target token's weight.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import numpy as np

from nestor.models.task import LOSS_WEIGHTS
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.order import WindowOrder, windows_of
from nestor.orchestrator.data.packing import PackedRows
from nestor.orchestrator.data.shards import TokenStream, directories_fingerprint, read_metadata
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.data.tokenizer import open_tokenizer

INVERSE_GOLDEN_RATIO = (math.sqrt(5) - 1) / 2


@dataclasses.dataclass
class MixtureSource:
    """One entry of the mixture: its directories, weight, token stream and window order."""

    key: str  # the config key that names its directories, for errors
    directories: list[Path]
    weight: float
    stream: TokenStream | None = None
    order: WindowOrder | None = None
    packed: PackedRows | None = None  # weighted shards: rows of whole documents, not windows


def mixture_sources(config: Config) -> list[MixtureSource]:
    """Returns the sources `data.mixture` lists, or one of weight 1 over `data.paths`."""
    if not config.data.mixture:
        return [MixtureSource("data.paths", [Path(p) for p in config.data.paths], 1.0)]
    return [MixtureSource(f"data.mixture[{i}].paths", [Path(p) for p in entry["paths"]], float(entry["weight"]))
            for i, entry in enumerate(config.data.mixture)]


def check_tokenizers(config: Config, sources: list[MixtureSource]) -> None:
    """Raises ConfigError when the directories were prepared with different tokenizers, with another
    tokenizer than `data.tokenizer` (when set), or with a vocabulary larger than `model.vocab_size`."""
    expected = open_tokenizer(config.data.tokenizer).fingerprint if config.data.tokenizer else None
    first = None
    for source in sources:
        for directory in source.directories:
            tokenizer = read_metadata(directory, source.key)["tokenizer"]
            if expected is not None and tokenizer["fingerprint"] != expected:
                raise ConfigError([("data.tokenizer", f"{directory} was prepared with tokenizer "
                                                      f"{tokenizer['path']} (fingerprint {tokenizer['fingerprint']}), "
                                                      f"not {config.data.tokenizer} ({expected}); prepare it again")])
            first = first or (directory, tokenizer)
            if tokenizer["fingerprint"] != first[1]["fingerprint"]:
                raise ConfigError([(source.key, f"{directory} was prepared with another tokenizer "
                                                f"({tokenizer['fingerprint']}) than {first[0]} "
                                                f"({first[1]['fingerprint']}); use one tokenizer for all")])
            if tokenizer["vocab_size"] > config.model.vocab_size:
                raise ConfigError([("model.vocab_size", f"{directory} holds ids of a {tokenizer['vocab_size']}-token "
                                                        f"vocabulary; set model.vocab_size={tokenizer['vocab_size']} "
                                                        "or more")])


def shards_separator(config: Config, sources: list[MixtureSource]) -> int:
    """Returns the separator every source's shards were prepared with. Raises ConfigError when two differ,
    or when `data.separator` names another id."""
    first = sources[0]
    for source in sources[1:]:
        if source.stream.separator != first.stream.separator:
            raise ConfigError([(source.key, f"{source.directories[0]} separates documents with token "
                                            f"{source.stream.separator}, {first.directories[0]} with "
                                            f"{first.stream.separator}; prepare them with one separator")])
    wanted = config.data.separator
    if isinstance(wanted, int) and wanted != first.stream.separator:
        raise ConfigError([("data.separator", f"{wanted}, but {first.directories[0]} was prepared with separator "
                                              f"{first.stream.separator}; leave data.separator at eos or prepare "
                                              f"again with --separator {wanted}")])
    return first.stream.separator


def shards_weighted(sources: list[MixtureSource]) -> bool:
    """Returns whether the sources' shards carry loss weights; raises ConfigError when some do and some not."""
    weighted = {source.stream.weighted for source in sources}
    if len(weighted) > 1:
        shown = ", ".join(f"{source.key} {'has' if source.stream.weighted else 'has no'} loss weights"
                          for source in sources)
        raise ConfigError([("data.mixture", f"mixes chat data with plain text ({shown}); prepare the text as "
                                            "{prompt, completion} records, or train on one kind")])
    return weighted.pop()


class TokenSource:
    """Rows of prepared token shards, from one directory set or a weighted mixture (see the module doc)."""

    def __init__(self, config: Config, split: str = "train"):
        self.seed = config.run.seed
        self.width = config.train.seq_len + 1
        self.global_batch = config.train.global_batch
        self.sources = mixture_sources(config)
        check_tokenizers(config, self.sources)
        for index, source in enumerate(self.sources):
            source.stream = TokenStream(source.directories, split, source.key)
            if source.stream.weighted:
                source.packed = PackedRows(source.stream, self.width, (self.seed, index))
            rows = len(source.packed) if source.packed else windows_of(source.stream.num_tokens, self.width, source.key)
            source.order = WindowOrder((self.seed, index), rows)
        self.num_tokens = sum(source.stream.num_tokens for source in self.sources)
        self.separator = shards_separator(config, self.sources)
        self.weighted = shards_weighted(self.sources)
        self.truncated = sum(source.packed.truncated for source in self.sources if source.packed)
        if self.truncated:
            print(f"{self.truncated} {split} document(s) longer than train.seq_len + 1 = {self.width} tokens are "
                  "truncated to it")
        weights = np.array([source.weight for source in self.sources])
        self.cumulative = np.cumsum(weights / weights.sum())
        self.offset = float(np.random.default_rng((self.seed, len(self.sources))).random())
        listing = [(s.weight, directories_fingerprint(s.directories, s.key)) for s in self.sources]
        self.fingerprint = f"tokens:{split}:" + hashlib.sha256(repr(listing).encode()).hexdigest()[:16]

    @property
    def mixed(self) -> bool:
        return len(self.sources) > 1

    def source_of(self, positions: np.ndarray) -> np.ndarray:
        """Returns the mixture source index of each global row position (int64 array in, same shape out)."""
        fraction = np.mod(self.offset + positions.astype(np.float64) * INVERSE_GOLDEN_RATIO, 1.0)
        return np.minimum(np.searchsorted(self.cumulative, fraction, side="right"), len(self.sources) - 1)

    def rows(self, step: int, rows: range) -> np.ndarray | dict[str, np.ndarray]:
        """Returns the tokens of `rows` of global batch `step`, int32 [len(rows), seq_len + 1], and for weighted
        shards as {"tokens", "loss_weights" float32 [len(rows), seq_len]} (the targets'); reads only them."""
        positions = step * self.global_batch + np.arange(rows.start, rows.stop, dtype=np.int64)
        out = np.empty((len(rows), self.width), np.int32)
        weights = np.zeros((len(rows), self.width), np.float32) if self.weighted else None
        for i, (position, index) in enumerate(zip(positions, self.source_of(positions))):
            source = self.sources[index]
            window = source.order(int(position))
            if source.packed:
                out[i], weights[i] = source.packed.row(window)
            else:
                out[i] = source.stream.read(window * self.width, (window + 1) * self.width)
        return {"tokens": out, LOSS_WEIGHTS: weights[:, 1:]} if self.weighted else out

    def shares(self, step: int) -> dict[str, float]:
        """Returns the realised share of each mixture source in global batch `step`, as metrics
        `data_share_<i>` (nothing for a single source). Computed from positions alone: no data is read."""
        if not self.mixed:
            return {}
        chosen = self.source_of(step * self.global_batch + np.arange(self.global_batch, dtype=np.int64))
        counts = np.bincount(chosen, minlength=len(self.sources))
        return {f"data_share_{i}": float(count / self.global_batch) for i, count in enumerate(counts)}
