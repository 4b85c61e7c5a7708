"""Deterministic, checkpointable global batches; each process builds only the rows it holds.

A batch is a dict of named arrays whose first dimension is the global batch's
rows (models.task). A language model's: int32 "tokens" [global_batch,
seq_len + 1] (inputs are [:, :-1], targets [:, 1:]) and, where documents are
packed and masked, their int32 "segment_ids" [global_batch, seq_len]. Row r of step s depends only on (run.seed, s, r), never on
the mesh or the number of processes, so any two meshes (and any host count)
see the same data. Because a batch is a pure function of the step, the
iterator's whole state is the next step plus a fingerprint of its source:
that is what a checkpoint stores, and resuming at step s replays exactly.

Sources:
- `synthetic`: arithmetic progressions modulo the vocabulary (learnable).
- `text`: files matched by `data.paths` globs (default: the Python standard
  library's own `*.py`), sorted, tokenized (bytes, or a tokenizer file),
  packed end to end with a separator into windows of seq_len + 1 tokens;
  windows are visited in a seeded permutation, reshuffled every epoch. With
  `data.document_mask` (default) each batch carries segment ids derived from
  the separators (`document_ids`) so that no token attends across documents.
- `tokens`: shards written by `nestor data prepare` (orchestrator/data/tokens.py),
  packed and ordered the same way, optionally a weighted `data.mixture`.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import sysconfig
from pathlib import Path

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from nestor.models import axes
from nestor.models.task import LOSS_WEIGHTS

from nestor.orchestrator.config.keys import ARRAY_SOURCES
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.arrays import ArraySource, field_axes
from nestor.orchestrator.data.order import WindowOrder, windows_of
from nestor.orchestrator.data.chat import template_text
from nestor.orchestrator.data.separator import BYTES_SEPARATOR, resolve_separator
from nestor.orchestrator.data.shards import first_nul, has_weights, read_metadata, separator_of
from nestor.orchestrator.data.tokens import MixtureSource, TokenSource, mixture_sources
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.data.tokenizer import load_tokenizer
from nestor.parallel.rules import Rules, partition_spec


def document_ids(tokens, separator: int):
    """Returns int32 segment ids [batch, length] for packed `tokens`: the number of `separator` tokens up to
    and including each position.

    A separator opens the document after it (it plays the part of a beginning-of-
    document token): at its position the model predicts the next document's first
    token from the separator alone, and the last token of a document, which
    predicts the separator, still sees its whole document.
    """
    numpy = np if isinstance(tokens, np.ndarray) else jnp  # on the host (batches) or traced (decoding)
    return numpy.cumsum(tokens == separator, axis=-1, dtype=np.int32)


def run_separator(config: Config) -> int:
    """Returns the id that separates the run's documents: the prepared shards' (data.source tokens), else
    `data.separator` for `data.tokenizer`. Raises ConfigError as `resolve_separator` and `read_metadata` do."""
    if config.data.source == "tokens":
        first = mixture_sources(config)[0]
        return separator_of(read_metadata(first.directories[0], first.key))
    return resolve_separator(config.data.separator, config.data.tokenizer)


def run_chat_template(config: Config) -> str:
    """Returns the chat template of the run's conversations: the one prepared shards were rendered with (data.source
    tokens), else its tokenizer's checkpoint's. Raises ConfigError naming --chat when there is none."""
    if config.data.source == "tokens":
        first = mixture_sources(config)[0]
        directory = first.directories[0]
        name = read_metadata(directory, first.key).get("chat_template")
        if isinstance(name, str) and (directory / name).is_file():
            return (directory / name).read_text()
    return template_text(config.data.tokenizer, None, "--chat")


def masks_documents(config: Config, source: str) -> bool:
    """Returns whether the loss on rows of `source` (a data.source or eval.source) keeps attention within
    documents: with data.document_mask, for every source that packs documents (all but synthetic)."""
    return config.data.document_mask and source != "synthetic"


class SyntheticSource:
    """Arithmetic progressions modulo the vocabulary: token_t = (start + stride * t) mod vocab.

    Each row draws its start and stride (1..7) from (seed, step, row), so a
    model can learn the rule from the first two tokens: the loss visibly falls.
    """

    def __init__(self, config: Config):
        self.seed = config.run.seed
        self.vocab = config.model.vocab_size
        self.width = config.train.seq_len + 1
        self.global_batch = config.train.global_batch
        self.fingerprint = f"synthetic:vocab={self.vocab}"
        self.num_tokens = None  # unbounded
        self.separator = BYTES_SEPARATOR  # no documents: never masked

    def rows(self, step: int, rows: range) -> np.ndarray:
        """Returns the tokens of `rows` of global batch `step`, int32 [len(rows), seq_len + 1]."""
        out = np.empty((len(rows), self.width), np.int32)
        positions = np.arange(self.width, dtype=np.int64)
        for i, row in enumerate(rows):
            rng = np.random.default_rng((self.seed, step, row))
            start, stride = rng.integers(0, self.vocab), rng.integers(1, 8)
            out[i] = (start + stride * positions) % self.vocab
        return out




def text_files(patterns: tuple[str, ...]) -> list[Path]:
    """Returns the sorted files matched by the globs (default: the standard library's `*.py`).

    Raises ConfigError when nothing matches or a file is not text: a NUL byte
    (the document separator) anywhere in it (`first_nul`).
    """
    patterns = patterns or (str(Path(sysconfig.get_paths()["stdlib"]) / "*.py"),)
    files = sorted({Path(p) for pattern in patterns for p in glob.glob(pattern, recursive=True) if Path(p).is_file()})
    if not files:
        raise ConfigError([("data.paths", f"no file matches {list(patterns)}; give globs of text files")])
    for file in files:
        if (offset := first_nul(file)) is not None:
            raise ConfigError([("data.paths", f"{file} is not text (a NUL byte at offset {offset}; NUL "
                                              "separates documents); narrow the globs to text files")])
    return files


class TextSource:
    """Documents packed end to end, read in windows of seq_len + 1 tokens.

    Byte-level: a document's token count is its file size, so the index is
    built from `stat` alone and each process reads only the byte ranges of
    its own rows. With a tokenizer file, every document is tokenized once
    (lazily, cached) to learn the lengths.
    """

    def __init__(self, config: Config):
        self.seed = config.run.seed
        self.width = config.train.seq_len + 1
        self.global_batch = config.train.global_batch
        self.files = text_files(config.data.paths)
        self.tokenizer = load_tokenizer(config.data.tokenizer, config.model.vocab_size)
        self.separator = resolve_separator(config.data.separator, config.data.tokenizer)
        self._tokens: dict[int, np.ndarray] = {}
        lengths = [self._length(i) + 1 for i in range(len(self.files))]  # +1: the separator
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.num_tokens = int(self.starts[-1])
        self.order = WindowOrder(self.seed, windows_of(int(self.starts[-1]), self.width, "data.paths"))
        listing = "\n".join(f"{f}:{n}" for f, n in zip(self.files, lengths))
        listing += f"\nseparator:{self.separator}" if self.separator != BYTES_SEPARATOR else ""  # older runs' stay
        self.fingerprint = "text:" + hashlib.sha256(listing.encode()).hexdigest()[:16]

    def _length(self, index: int) -> int:
        if self.tokenizer is None:
            return self.files[index].stat().st_size
        return len(self._document(index))

    def _document(self, index: int) -> np.ndarray:
        if index not in self._tokens:
            text = self.files[index].read_text(errors="replace")
            self._tokens[index] = np.asarray(self.tokenizer(text), np.int32)
        return self._tokens[index]

    def _document_slice(self, index: int, start: int, stop: int) -> np.ndarray:
        """Returns tokens [start, stop) of document `index` followed by its separator."""
        length = int(self.starts[index + 1] - self.starts[index]) - 1
        body_stop = min(stop, length)
        if self.tokenizer is None:
            with self.files[index].open("rb") as f:
                f.seek(start)
                body = np.frombuffer(f.read(max(body_stop - start, 0)), np.uint8).astype(np.int32)
        else:
            body = self._document(index)[start:body_stop]
        separator = np.full((1,) if stop > length else (0,), self.separator, np.int32)
        return np.concatenate([body, separator])

    def window(self, index: int) -> np.ndarray:
        """Returns packed tokens [index * width, (index + 1) * width) of the corpus."""
        begin, end = index * self.width, (index + 1) * self.width
        pieces, position = [], begin
        document = bisect.bisect_right(self.starts, begin) - 1
        while position < end:
            offset = position - int(self.starts[document])
            stop = min(end, int(self.starts[document + 1])) - int(self.starts[document])
            pieces.append(self._document_slice(document, offset, stop))
            position = int(self.starts[document]) + stop
            document += 1
        return np.concatenate(pieces)

    def window_index(self, step: int, row: int) -> int:
        """Returns which window is row `row` of step `step`: a seeded permutation per epoch."""
        return self.order(step * self.global_batch + row)

    def rows(self, step: int, rows: range) -> np.ndarray:
        """Returns the tokens of `rows` of global batch `step`, int32 [len(rows), seq_len + 1]."""
        return np.stack([self.window(self.window_index(step, row)) for row in rows]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Field:
    """One named array of a global batch: its shape (rows first), dtype and logical axes."""

    shape: tuple[int, ...]
    dtype: np.dtype
    logical_axes: tuple[str | None, ...]

    def sharding(self, mesh: Mesh, rules: Rules) -> NamedSharding:
        return NamedSharding(mesh, partition_spec(self.logical_axes, rules))


def token_fields(config: Config, document_mask: bool, weighted: bool = False) -> dict[str, Field]:
    """Returns the fields of a language model's batch: "tokens" [global_batch, seq_len + 1], with
    `document_mask` the inputs' "segment_ids" [global_batch, seq_len], and when `weighted` the targets'
    loss weights (models.task.LOSS_WEIGHTS) float32 [global_batch, seq_len]."""
    rows, width = config.train.global_batch, config.train.seq_len + 1
    # whole rows on every context device (int32 ids: the model arranges its places and lays them out)
    fields = {"tokens": Field((rows, width), np.dtype(np.int32), (axes.BATCH, None))}
    if document_mask:
        fields["segment_ids"] = Field((rows, width - 1), np.dtype(np.int32), (axes.BATCH, None))
    if weighted:
        fields[LOSS_WEIGHTS] = Field((rows, width - 1), np.dtype(np.float32), (axes.BATCH, None))
    return fields


def weighted_shards(config: Config, source: str, paths: tuple[str, ...]) -> bool:
    """Returns whether prepared shards (`source` tokens) at `paths` (empty: data.paths or data.mixture) carry loss
    weights (chat data), as their first directory's metadata says; False for other sources, and for shards that
    cannot be read (the source says why when it opens them; a compile without data needs none)."""
    if source != "tokens":
        return False
    first = mixture_sources(config)[0] if not paths else MixtureSource("eval.paths", [Path(paths[0])], 1.0)
    if not first.directories:
        return False
    try:
        return has_weights(read_metadata(first.directories[0], first.key))
    except ConfigError:
        return False


def batch_fields(config: Config, source: str | None = None, paths: tuple[str, ...] | None = None,
                 key: str = "data.paths") -> dict[str, Field]:
    """Returns the fields of the batches of data source `source` reading `paths` (default: `data.source`,
    `data.paths`); named arrays are opened (memory-mapped) to learn theirs."""
    source = config.data.source if source is None else source
    if source not in ARRAY_SOURCES:
        return token_fields(config, masks_documents(config, source),
                            weighted_shards(config, source, () if paths is None else paths))
    arrays = (ArraySource.from_factory(config, "train") if source == "python" else
              ArraySource.from_paths(config, config.data.paths if paths is None else paths, key))
    return {name: Field((config.train.global_batch, *shape), dtype, field_axes(1 + len(shape)))
            for name, (shape, dtype) in arrays.example_shapes().items()}


def shardings(fields: dict[str, Field], mesh: Mesh, rules: Rules) -> dict[str, NamedSharding]:
    """Returns each field's sharding on `mesh` under `rules`."""
    return {name: field.sharding(mesh, rules) for name, field in fields.items()}


def abstract(fields: dict[str, Field], mesh: Mesh, rules: Rules) -> dict[str, jax.ShapeDtypeStruct]:
    """Returns the batch as shapes, dtypes and shardings: what a step compiles for, no data read."""
    return {name: jax.ShapeDtypeStruct(field.shape, field.dtype, sharding=field.sharding(mesh, rules))
            for name, field in fields.items()}


def make_source(config: Config, split: str = "train"):
    """Returns the source `data.source` names; `split` picks the split of prepared token shards."""
    if config.data.source == "tokens":
        return TokenSource(config, split)
    if config.data.source == "arrays":
        return ArraySource.from_paths(config, config.data.paths)
    if config.data.source == "python":
        return ArraySource.from_factory(config, split)
    return SyntheticSource(config) if config.data.source == "synthetic" else TextSource(config)


class DataPipeline:
    """The run's input: global batch `step` as a dict of sharded arrays, plus a checkpointable position.

    `source` (default: `make_source(config)`, training's) may be another source, e.g. the eval batches';
    `fields` are its batches' (default: `batch_fields(config)`, training's).
    """

    def __init__(self, config: Config, mesh: Mesh, rules: Rules, source=None, fields: dict[str, Field] | None = None):
        self.source = make_source(config) if source is None else source
        self.fields = batch_fields(config) if fields is None else fields
        self.shardings = shardings(self.fields, mesh, rules)
        self.next_step = 0

    def batch(self, step: int) -> dict[str, jax.Array]:
        """Returns global batch `step`, each field sharded as its logical axes say; the iterator then
        points after it.

        Each process builds only the rows its own devices hold (whatever order
        the mesh puts them in), once per distinct block of rows.
        """
        built: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        rows_total = next(iter(self.fields.values())).shape[0]

        def block(name: str, index: tuple[slice, ...]) -> np.ndarray:
            rows = range(*index[0].indices(rows_total))
            key = (rows.start, rows.stop)
            if key not in built:
                built[key] = self.source.rows(step, rows)
                if isinstance(built[key], np.ndarray):  # a token source's windows
                    built[key] = {"tokens": built[key]}
                if "segment_ids" in self.fields and "segment_ids" not in built[key]:
                    built[key]["segment_ids"] = document_ids(built[key]["tokens"][:, :-1], self.source.separator)
            return built[key][name][(slice(None), *index[1:])]

        self.next_step = step + 1
        return {name: jax.make_array_from_callback(field.shape, self.shardings[name],
                                                   lambda index, name=name: block(name, index))
                for name, field in self.fields.items()}
    def metrics(self, step: int) -> dict[str, float]:
        """Returns what global batch `step` logs about its data: each mixture source's share (if mixed)."""
        return self.source.shares(step) if isinstance(self.source, TokenSource) else {}

    def state(self) -> dict:
        """Returns the iterator state a checkpoint stores (JSON-able)."""
        return {"next_step": self.next_step, "source": self.source.fingerprint}

    def restore(self, state: dict, log=print) -> None:
        """Points the iterator at the saved position; warns when the source changed since the save."""
        if state.get("source") != self.source.fingerprint:
            log(f"warning: data source changed since the checkpoint ({state.get('source')} -> "
                f"{self.source.fingerprint}); batches after the resume differ from the original run")
        self.next_step = int(state["next_step"])
