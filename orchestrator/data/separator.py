"""The document separator: the token id that ends every packed document (`data.separator`).

It opens the segment of the document after it (the document mask), ends a
sample, and is the end-of-text id an export writes. `eos` (the default) is
the tokenizer's own end of text, read from the files beside its
`tokenizer.json` as transformers reads them: `tokenizer_config.json`'s
`eos_token`, else `generation_config.json`'s, else `config.json`'s
`eos_token_id`. Byte-level text keeps id 0 (NUL never occurs in text), and
so does a tokenizer file with none of those files beside it (one trained
for the run, whose first special token docs/data.md puts at id 0).
Prepared shards record the separator they were written with; shards that
record none were written with 0.
"""

from __future__ import annotations

import json
from pathlib import Path

from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.data.tokenizer import BYTES, TokenizerFile, open_tokenizer

EOS = "eos"  # data.separator's default: the tokenizer's end of text
BYTES_SEPARATOR = 0
SPECIAL_TOKENS_FILE = "tokenizer_config.json"
ID_FILES = ("generation_config.json", "config.json")  # the files whose eos_token_id names the end of text


def read_json(path: Path) -> dict:
    """Returns the JSON object in `path`, or {} when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _token_text(value) -> str | None:
    """Returns a special token of tokenizer_config.json as text: a string, or an AddedToken's `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _first_id(value) -> int | None:
    """Returns an `eos_token_id` (an id, or a list of ids whose first is the end of text) as an int."""
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def special_token(directory: Path, tokenizer: TokenizerFile, name: str) -> int | None:
    """Returns the id of the special token `name` ("eos" or "bos") a checkpoint directory names: by text in
    tokenizer_config.json (`<name>_token`), else by id in generation_config.json or config.json
    (`<name>_token_id`); None when none names one."""
    text = _token_text(read_json(directory / SPECIAL_TOKENS_FILE).get(f"{name}_token"))
    if text is not None and (found := tokenizer.token_id(text)) is not None:
        return found
    for file in ID_FILES:
        if (found := _first_id(read_json(directory / file).get(f"{name}_token_id"))) is not None:
            return found
    return None


def end_of_text(tokenizer_path: str | None, key: str = "data.separator") -> int:
    """Returns the end-of-text id of a tokenizer file (see the module doc); 0 for bytes (None or `bytes`)
    and for a tokenizer file with no checkpoint file beside it.

    Raises ConfigError naming `key` when the files beside the tokenizer name no end-of-text token of it.
    """
    if tokenizer_path is None or tokenizer_path == BYTES:
        return BYTES_SEPARATOR
    directory = Path(tokenizer_path).expanduser().parent
    if not any((directory / name).is_file() for name in (SPECIAL_TOKENS_FILE, *ID_FILES)):
        return BYTES_SEPARATOR
    tokenizer = open_tokenizer(tokenizer_path, key)
    found = special_token(directory, tokenizer, "eos")
    if found is None or found >= tokenizer.vocab_size:
        raise ConfigError([(key, f"no end-of-text token of {tokenizer_path} is named beside it ({SPECIAL_TOKENS_FILE}'s "
                                 f"eos_token, or eos_token_id in {' or '.join(ID_FILES)}); set {key} to its id")])
    return found


def resolve_separator(value: int | str, tokenizer_path: str | None, key: str = "data.separator") -> int:
    """Returns the separator id `value` (an id, or `eos`) means for a tokenizer file (None or `bytes`:
    byte-level). Raises ConfigError naming `key` for another string, and as `end_of_text` does."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError([(key, f"must be a token id >= 0 or {EOS}, got {value}")])
        return value
    if value != EOS:
        raise ConfigError([(key, f"must be a token id or {EOS} (the tokenizer's end of text), got {value!r}")])
    return end_of_text(tokenizer_path, key)
