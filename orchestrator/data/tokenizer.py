"""Tokenizers for text: Hugging Face `tokenizers` JSON, SentencePiece, or bytes.

Without a file, text is byte-level (vocab 256) and needs nothing. The
libraries are imported only when a file is given, so neither is a
dependency of nestor. A tokenizer's fingerprint (a hash of its file, or
`bytes`) travels with prepared token shards, so a run can tell whether its
shards were made by the tokenizer it expects.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from nestor.orchestrator.errors import ConfigError

Tokenizer = Callable[[str], Sequence[int]]  # a list, or an array of ids
Detokenizer = Callable[[Sequence[int]], str]
BYTES = "bytes"  # the name `nestor data prepare --tokenizer` takes for byte-level text
BYTE_VOCAB = 256


@dataclasses.dataclass(frozen=True)
class TokenizerFile:
    """A loaded tokenizer: text -> ids, ids -> text, its vocabulary size and fingerprint, and a token's
    id by its text (None: not one token of the vocabulary)."""

    encode: Tokenizer
    vocab_size: int
    fingerprint: str
    decode: Detokenizer
    token_id: Callable[[str], int | None] = lambda token: None


def _unreadable(path: Path, kind: str, error: Exception, key: str) -> ConfigError:
    reason = " ".join(str(error).split())[:200] or type(error).__name__
    return ConfigError([(key, f"{path} does not load as {kind}: {reason}")])


def _huggingface(path: Path, key: str) -> tuple[Tokenizer, int, Detokenizer, Callable[[str], int | None]]:
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ConfigError([(key, f"{path} needs the `tokenizers` package: pip install tokenizers")]) from None
    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 - the library raises its own types for any broken file
        raise _unreadable(path, "a tokenizers JSON", error, key) from None
    return (lambda text: tokenizer.encode(text).ids), tokenizer.get_vocab_size(), \
        (lambda ids: tokenizer.decode([int(i) for i in ids])), tokenizer.token_to_id


def _sentencepiece(path: Path, key: str) -> tuple[Tokenizer, int, Detokenizer, Callable[[str], int | None]]:
    try:
        import sentencepiece
    except ImportError:
        raise ConfigError([(key, f"{path} needs the `sentencepiece` package: pip install sentencepiece")]) from None
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as error:  # noqa: BLE001 - the library raises its own types for any broken file
        raise _unreadable(path, "a SentencePiece model", error, key) from None
    def token_id(piece: str) -> int | None:
        found = processor.piece_to_id(piece)
        return None if found == processor.unk_id() and piece != processor.id_to_piece(found) else found

    return processor.encode, processor.get_piece_size(), (lambda ids: processor.decode([int(i) for i in ids])), \
        token_id


def encode_bytes(text: str) -> np.ndarray:
    """Returns the UTF-8 bytes of `text` as token ids, uint8 (byte-level: vocab 256)."""
    return np.frombuffer(text.encode(), np.uint8)


def decode_bytes(ids: Sequence[int]) -> str:
    """Returns the text of byte-level ids (UTF-8, broken sequences replaced; ids past 255, which a model
    with a larger vocabulary may emit, are no bytes and are left out)."""
    return bytes(int(i) for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


def open_tokenizer(path: str | None, key: str = "data.tokenizer") -> TokenizerFile:
    """Returns the tokenizer of a `.json` (tokenizers) or `.model` (SentencePiece) file; None or
    `bytes` = byte-level.

    Raises ConfigError naming `key` when the file is absent, of an unknown kind, does not parse
    (empty, truncated) or its library is missing.
    """
    if path is None or path == BYTES:
        return TokenizerFile(encode_bytes, BYTE_VOCAB, BYTES, decode_bytes)
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError([(key, f"no file at {file}; give a tokenizers .json or SentencePiece .model")])
    loaders = {".json": _huggingface, ".model": _sentencepiece}
    if file.suffix not in loaders:
        raise ConfigError([(key, f"{file.name}: expected a .json (tokenizers) or .model (SentencePiece)")])
    encode, size, decode, token_id = loaders[file.suffix](file, key)
    return TokenizerFile(encode, size, tokenizer_fingerprint(file), decode, token_id)


def tokenizer_fingerprint(file: Path) -> str:
    """Returns the first 16 hex digits of the SHA-256 of a tokenizer file's bytes."""
    return hashlib.sha256(file.read_bytes()).hexdigest()[:16]


def fitting_tokenizer(path: str | None, vocab_size: int) -> TokenizerFile:
    """Returns `data.tokenizer` opened (see `open_tokenizer`; None = bytes).

    Raises ConfigError as `open_tokenizer` does, and when the vocabulary does not fit `model.vocab_size`.
    """
    tokenizer = open_tokenizer(path)
    if tokenizer.vocab_size > vocab_size:
        name = "byte-level text" if path is None else Path(path).name
        raise ConfigError([("model.vocab_size", f"{tokenizer.vocab_size} tokens of {name} do not fit {vocab_size}; "
                                                f"set model.vocab_size={tokenizer.vocab_size} or more")])
    return tokenizer


def load_tokenizer(path: str | None, vocab_size: int) -> Tokenizer | None:
    """Returns text -> token ids for `data.tokenizer`; None = bytes, read as such. Raises as `fitting_tokenizer`."""
    tokenizer = fitting_tokenizer(path, vocab_size)
    return None if path is None else tokenizer.encode
