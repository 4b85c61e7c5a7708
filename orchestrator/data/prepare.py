"""`nestor data prepare`: text, JSONL and Parquet -> token shards (orchestrator.data.shards), resumably.

The inputs are cut into units of about `shard_mb` (a run of small text files,
a byte range of a JSONL file aligned to whole lines, a run of Parquet row
groups); each unit becomes shard N of each split. Units are tokenized by a
pool of worker processes; a finished unit writes its files first and then a
marker (`units/NNNNN.json`), each by atomic rename, so an interrupted prepare
run again with the same inputs and options redoes only the units without a
marker and writes byte-identical shards. `metadata.json` is written last.

The held-out split is chosen per document by a hash of its text (the same
text always lands in the same split, whatever the sharding), or is every
document of `--eval-source` inputs.

JSONL whose first record is chat or instruction data (`messages`, or `prompt`
and `completion`: orchestrator.data.chat) is prepared as such: every record
rendered by the chat template, and the shards carry per-token loss weights
beside the tokens; the template is kept in --out for the run's sampling.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import multiprocessing
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nestor.orchestrator.data.shards import (FORMAT, METADATA, SPLITS, TEXT_PROBE_BYTES, shard_name, token_dtype,
                                             write_atomically, write_shard)
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.data.chat import TEMPLATE_FILE, ChatEncoder, is_chat_record, template_text
from nestor.orchestrator.data.separator import EOS, resolve_separator
from nestor.orchestrator.data.tokenizer import BYTES, TokenizerFile, open_tokenizer

PLAN = "plan.json"
UNITS = "units"


@dataclasses.dataclass(frozen=True)
class Options:
    """What `nestor data prepare` was asked for (all but the inputs)."""

    tokenizer: str
    out: Path
    eval_fraction: float = 0.0
    text_field: str = "text"
    parquet_column: str = "text"
    workers: int = 1
    shard_mb: float = 256.0
    separator: int | str = EOS  # an id, or the tokenizer's end of text (orchestrator.data.separator)
    chat_template: str | None = None  # chat data: a template's name or file; None = the tokenizer's
    template: str | None = None  # the chat template's text when the inputs are chat data (set by `prepare`)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of one input file: a whole text file, bytes [start, stop) of a JSONL file, or row groups
    [start, stop) of a Parquet file. `held_out`: every document goes to the eval split."""

    path: str
    kind: str  # text | jsonl | parquet
    start: int
    stop: int
    held_out: bool


def input_files(sources: list[str], key: str) -> list[Path]:
    """Returns the files named by `sources` (files, globs, or directories searched recursively), sorted
    per source; raises ConfigError naming `key` for a source that names no file."""
    files: list[Path] = []
    for source in sources:
        path = Path(source).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file())
        else:
            found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not found:
            raise ConfigError([(key, f"{source} names no file; give text, .jsonl or .parquet files, globs or "
                                     "directories")])
        files += found
    return files


def is_binary(path: Path) -> bool:
    """Returns whether a text input holds a NUL byte in its first TEXT_PROBE_BYTES (a `.pyc`, an image):
    NUL never occurs in text, and its id 0 is the document separator."""
    with path.open("rb") as file:
        return b"\0" in file.read(TEXT_PROBE_BYTES)


def text_inputs(files: list[Path], log=print) -> list[Path]:
    """Returns `files` without the binary text inputs (`is_binary`; .jsonl and .parquet are kept), saying
    which were skipped."""
    skipped = [path for path in files if _kind(path) == "text" and is_binary(path)]
    if skipped:
        shown = ", ".join(str(path) for path in skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5
                                                                else "")
        log(f"skipped {len(skipped)} binary input(s) (a NUL byte; not text): {shown}")
    binary = set(skipped)
    return [path for path in files if path not in binary]


def _kind(path: Path) -> str:
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix, "text")


def _jsonl_pieces(path: Path, unit_bytes: int, held_out: bool) -> list[Piece]:
    """Cuts a JSONL file into byte ranges of about `unit_bytes`, each ending after a newline."""
    size, cuts = path.stat().st_size, [0]
    with path.open("rb") as f:
        while cuts[-1] + unit_bytes < size:
            f.seek(cuts[-1] + unit_bytes)
            f.readline()
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    cuts.append(size)
    return [Piece(str(path), "jsonl", start, stop, held_out) for start, stop in zip(cuts[:-1], cuts[1:])]


def _parquet_pieces(path: Path, unit_bytes: int, held_out: bool) -> list[Piece]:
    """Groups a Parquet file's row groups into runs of about `unit_bytes` (uncompressed)."""
    import pyarrow.parquet as parquet

    metadata = parquet.ParquetFile(path).metadata
    pieces, start, size = [], 0, 0
    for group in range(metadata.num_row_groups):
        size += metadata.row_group(group).total_byte_size
        if size >= unit_bytes or group == metadata.num_row_groups - 1:
            pieces.append(Piece(str(path), "parquet", start, group + 1, held_out))
            start, size = group + 1, 0
    return pieces


def plan_units(files: list[Path], held_out: set[Path], unit_bytes: int) -> list[list[Piece]]:
    """Returns the units of work in order: runs of consecutive text files of about `unit_bytes`, and
    the pieces of each JSONL and Parquet file, one unit each."""
    units: list[list[Piece]] = []
    texts: list[Piece] = []
    texts_bytes = 0
    for path in files:
        kind = _kind(path)
        if kind != "text" or (texts and texts[-1].held_out != (path in held_out)):
            units += [texts] if texts else []
            texts, texts_bytes = [], 0
        if kind == "jsonl":
            units += [[piece] for piece in _jsonl_pieces(path, unit_bytes, path in held_out)]
        elif kind == "parquet":
            units += [[piece] for piece in _parquet_pieces(path, unit_bytes, path in held_out)]
        else:
            size = path.stat().st_size
            texts.append(Piece(str(path), "text", 0, size, path in held_out))
            texts_bytes += size
            if texts_bytes >= unit_bytes:
                units.append(texts)
                texts, texts_bytes = [], 0
    return units + ([texts] if texts else [])


def documents(piece: Piece, options: Options) -> Iterator[str | dict]:
    """Yields the texts of a piece's documents (the records, for chat data); raises ConfigError naming the
    option that does not fit (a JSONL line without the text field, a Parquet file without the column, a
    record of chat data that is none)."""
    if piece.kind == "text":
        text = Path(piece.path).read_text(errors="replace")
        if "\0" in text:  # past the probe of `is_binary`
            raise ConfigError([("SOURCE", f"{piece.path} is not text: a NUL byte at offset {text.index(chr(0))} "
                                          "(NUL separates documents); leave the file out")])
        yield text
    elif piece.kind == "jsonl":
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            for line in f.read(piece.stop - piece.start).splitlines():
                if line.strip():
                    record = json.loads(line)
                    if options.template is not None:
                        if not is_chat_record(record):
                            raise ConfigError([("SOURCE", f"a line of {piece.path} is not chat data ({{messages}} "
                                                          f"or {{prompt, completion}}) as the first is: {line[:80]!r}")])
                        yield record
                        continue
                    if not isinstance(record, dict) or not isinstance(record.get(options.text_field), str):
                        raise ConfigError([("--text-field", f"a line of {piece.path} has no string field "
                                                            f"{options.text_field!r}: {line[:80]!r}")])
                    yield record[options.text_field]
    else:
        import pyarrow.parquet as parquet

        file = parquet.ParquetFile(piece.path)
        if options.parquet_column not in file.schema_arrow.names:
            raise ConfigError([("--parquet-column", f"{piece.path} has no column {options.parquet_column!r} "
                                                    f"(it has {', '.join(file.schema_arrow.names)})")])
        for group in range(piece.start, piece.stop):
            yield from file.read_row_group(group, columns=[options.parquet_column]).column(0).to_pylist()


def first_record(path: Path):
    """Returns the first record of a JSONL file (None for another kind of file, or an empty one)."""
    if _kind(path) != "jsonl":
        return None
    with path.open("rb") as file:
        for line in file:
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None
    return None


def held_out_by_hash(text: str, fraction: float) -> bool:
    """Returns whether a document goes to the eval split: its text's hash, read as a number in [0, 1),
    is below `fraction`."""
    digest = hashlib.blake2b(text.encode(errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


_TOKENIZERS: dict[str, TokenizerFile] = {}  # per worker process: loaded once
_ENCODERS: dict[tuple[str, str], ChatEncoder] = {}


def _encoded(document: str | dict, options: Options, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """Returns a document's token ids and, for a chat record, its loss weights; raises ConfigError for a record
    the chat encoder refuses."""
    if options.template is None:
        return np.asarray(_TOKENIZERS[options.tokenizer].encode(document), dtype), None
    if (options.tokenizer, options.template) not in _ENCODERS:
        _ENCODERS[options.tokenizer, options.template] = ChatEncoder(options.tokenizer, options.template)
    try:
        encoded = _ENCODERS[options.tokenizer, options.template](document)
    except (ValueError, TypeError) as error:
        raise ConfigError([("SOURCE", f"a record {json.dumps(document)[:80]}...: {error}")]) from None
    return encoded.ids.astype(dtype), encoded.weights.astype(np.uint8)


def prepare_unit(index: int, unit: list[Piece], options: Options) -> dict:
    """Tokenizes one unit into shard `index` of each split and writes its marker; returns the marker:
    tokens and documents per split."""
    if options.tokenizer not in _TOKENIZERS:
        _TOKENIZERS[options.tokenizer] = open_tokenizer(options.tokenizer, "--tokenizer")
    tokenizer = _TOKENIZERS[options.tokenizer]
    dtype = token_dtype(tokenizer.vocab_size)
    by_split: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    weights: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    for piece in unit:
        for document in documents(piece, options):
            ids, weight = _encoded(document, options, dtype)
            if not len(ids):
                continue
            text = document if isinstance(document, str) else json.dumps(document, sort_keys=True)
            split = "eval" if piece.held_out or held_out_by_hash(text, options.eval_fraction) else "train"
            by_split[split].append(ids)
            weights[split].append(weight)
    marker = {}
    for split, docs in by_split.items():
        # A unit of an --eval-source file has no train documents, and one of a SOURCE none held out
        # without --eval-fraction: no empty shard is written or listed.
        tokens, count = write_shard(options.out, shard_name(split, index), docs, dtype, options.separator,
                                    weights[split] if options.template is not None else None) if docs else (0, 0)
        marker[split] = {"name": shard_name(split, index), "tokens": tokens, "documents": count}
    write_atomically(options.out / UNITS / f"{index:05d}.json", json.dumps(marker).encode())
    return marker


def _plan_record(files: list[Path], held_out: set[Path], options: Options, tokenizer: TokenizerFile) -> dict:
    return {"inputs": [[str(p), p.stat().st_size, p.stat().st_mtime_ns, p in held_out] for p in files],
            "tokenizer": tokenizer.fingerprint, "eval_fraction": options.eval_fraction,
            "text_field": options.text_field, "parquet_column": options.parquet_column,
            "shard_mb": options.shard_mb, "separator": options.separator, "chat_template": options.template}


def _check_plan(options: Options, record: dict) -> None:
    """Records the plan in a new --out; an existing --out must have been started with the same plan."""
    file = options.out / PLAN
    if file.exists():
        before = json.loads(file.read_text())
        if before != record:
            changed = sorted(k for k in record if before.get(k) != record[k])
            raise ConfigError([("--out", f"{options.out} holds a prepare of other {', '.join(changed)}; give "
                                         "another --out, or remove it to start over")])
    else:
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / UNITS).mkdir(exist_ok=True)
        write_atomically(file, json.dumps(record, indent=1).encode())


def prepare(sources: list[str], options: Options, eval_sources: list[str] = (), log=print) -> dict:
    """Prepares `sources` (and `eval_sources`, held out whole) into `options.out`; returns the metadata.

    Units with a marker from an earlier, interrupted call are kept. Raises
    ConfigError naming the option for inputs that name no file, a tokenizer
    that does not load, an --out of another plan, or records without the text.
    """
    tokenizer = open_tokenizer(options.tokenizer, "--tokenizer")
    options = dataclasses.replace(options, separator=resolve_separator(options.separator, options.tokenizer,
                                                                       "--separator"))
    held_out = set(text_inputs(input_files(list(eval_sources), "--eval-source"), log)) if eval_sources else set()
    files = text_inputs(input_files(list(sources), "SOURCE"), log) + sorted(held_out)
    if not files:
        raise ConfigError([("SOURCE", "every input is binary; give text, .jsonl or .parquet files")])
    if is_chat_record(first_record(files[0])):
        if others := [str(path) for path in files if _kind(path) != "jsonl"]:
            raise ConfigError([("SOURCE", f"chat data is JSONL; {', '.join(others[:3])} is not")])
        options = dataclasses.replace(options, template=template_text(options.tokenizer, options.chat_template))
    units = plan_units(files, held_out, max(1, int(options.shard_mb * 2**20)))
    _check_plan(options, _plan_record(files, held_out, options, tokenizer))
    markers = {int(p.stem): json.loads(p.read_text()) for p in (options.out / UNITS).glob("*.json")}
    pending = [index for index in range(len(units)) if index not in markers]
    if markers:
        log(f"resuming: {len(units) - len(pending)} of {len(units)} shards already prepared in {options.out}")
    with UnitProgress(len(units), len(units) - len(pending), log) as progress:
        for index, marker in _run(units, pending, options):
            markers[index] = marker
            progress.advance(sum(marker[split]["tokens"] for split in SPLITS))
    metadata = {"format": FORMAT, "tokenizer": {"path": options.tokenizer if options.tokenizer == BYTES
                                                else str(Path(options.tokenizer).resolve()),
                                                "fingerprint": tokenizer.fingerprint,
                                                "vocab_size": tokenizer.vocab_size},
                "dtype": token_dtype(tokenizer.vocab_size).name, "separator": options.separator, "splits": {}}
    if options.template is not None:  # kept for the run's `nestor sample --chat` and its export
        write_atomically(options.out / TEMPLATE_FILE, options.template.encode())
        metadata.update(loss_weights=True, chat_template=TEMPLATE_FILE,
                        end_of_turn=ChatEncoder(options.tokenizer, options.template).end_of_turn())
    for split in SPLITS:
        shards = [markers[index][split] for index in range(len(units)) if markers[index][split]["documents"]]
        metadata["splits"][split] = {"tokens": sum(s["tokens"] for s in shards),
                                     "documents": sum(s["documents"] for s in shards), "shards": shards}
    write_atomically(options.out / METADATA, json.dumps(metadata, indent=1).encode())
    return metadata


def _run(units: list[list[Piece]], pending: list[int], options: Options) -> Iterator[tuple[int, dict]]:
    """Yields (unit, marker) as units finish: in this process for one worker, else in a spawned pool."""
    if options.workers == 1 or len(pending) <= 1:
        for index in pending:
            yield index, prepare_unit(index, units[index], options)
        return
    # spawn, not fork: the parent has imported JAX, whose threads a fork would copy in a broken state.
    with multiprocessing.get_context("spawn").Pool(min(options.workers, len(pending))) as pool:
        jobs = {index: pool.apply_async(prepare_unit, (index, units[index], options)) for index in pending}
        for index, job in jobs.items():
            yield index, job.get()


class UnitProgress:
    """Shows prepared shards and tokens/s: a bar on a terminal, one line per shard elsewhere."""

    def __init__(self, total: int, done: int, log):
        self.total, self.done, self.log = total, done, log
        self.tokens, self.started = 0, time.perf_counter()
        self.bar = None

    def __enter__(self) -> "UnitProgress":
        if sys.stdout.isatty() and self.log is print:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("shards"), MofNCompleteColumn(), BarColumn(),
                                TextColumn("{task.fields[tokens]} tokens  {task.fields[rate]} tok/s"),
                                TimeRemainingColumn())
            self.task = self.bar.add_task("prepare", total=self.total, completed=self.done, tokens="0", rate="-")
            self.bar.start()
        return self

    def advance(self, tokens: int) -> None:
        """Counts one more finished shard of `tokens` tokens (both splits)."""
        self.done += 1
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, tokens=f"{self.tokens:,}", rate=f"{rate:,.0f}")
        else:
            self.log(f"shard {self.done}/{self.total}: {self.tokens:,} tokens, {rate:,.0f} tok/s")

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
