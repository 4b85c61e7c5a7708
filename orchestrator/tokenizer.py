"""Optional tokenizer files for the text source: Hugging Face `tokenizers` JSON or SentencePiece.

Without a file the text source is byte-level (vocab 256) and needs nothing.
The libraries are imported only when a file is given, so neither is a
dependency of nestor.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from orchestrator.config import ConfigError

Tokenizer = Callable[[str], list[int]]


def _unreadable(path: Path, kind: str, error: Exception) -> ConfigError:
    reason = " ".join(str(error).split())[:200] or type(error).__name__
    return ConfigError([("data.tokenizer", f"{path} does not load as {kind}: {reason}")])


def _huggingface(path: Path) -> tuple[Tokenizer, int]:
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ConfigError([("data.tokenizer", f"{path} needs the `tokenizers` package: pip install tokenizers")]) from None
    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 - the library raises its own types for any broken file
        raise _unreadable(path, "a tokenizers JSON", error) from None
    return (lambda text: tokenizer.encode(text).ids), tokenizer.get_vocab_size()


def _sentencepiece(path: Path) -> tuple[Tokenizer, int]:
    try:
        import sentencepiece
    except ImportError:
        raise ConfigError([("data.tokenizer", f"{path} needs the `sentencepiece` package: "
                                              "pip install sentencepiece")]) from None
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as error:  # noqa: BLE001 - the library raises its own types for any broken file
        raise _unreadable(path, "a SentencePiece model", error) from None
    return processor.encode, processor.get_piece_size()


def load_tokenizer(path: str | None, vocab_size: int) -> Tokenizer | None:
    """Returns text -> token ids for a `.json` (tokenizers) or `.model` (SentencePiece) file; None = bytes.

    Raises ConfigError when the file is absent, of an unknown kind, does not
    parse (empty, truncated), its library is missing, or its vocabulary does not fit `model.vocab_size`.
    """
    if path is None:
        if vocab_size < 256:
            raise ConfigError([("model.vocab_size", f"byte-level text needs at least 256, got {vocab_size}")])
        return None
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError([("data.tokenizer", f"no file at {file}; give a tokenizers .json or SentencePiece .model")])
    loaders = {".json": _huggingface, ".model": _sentencepiece}
    if file.suffix not in loaders:
        raise ConfigError([("data.tokenizer", f"{file.name}: expected a .json (tokenizers) or .model (SentencePiece)")])
    tokenizer, size = loaders[file.suffix](file)
    if size > vocab_size:
        raise ConfigError([("model.vocab_size", f"{size} tokens in {file.name} do not fit {vocab_size}; "
                                                f"set model.vocab_size={size} or more")])
    return tokenizer
