"""Chat and instruction data: records rendered into token ids and per-token loss weights.

Records (one JSON object a line of a `.jsonl` file), the formats of the OpenAI
and Hugging Face chat datasets and of TRL:
- `{"messages": [{"role": ..., "content": ...}, ...]}`: rendered by the chat
  template; the tokens of assistant turns (the template's `{% generation %}`
  blocks) weigh 1, every other token 0;
- `{"prompt": [messages], "completion": message or [messages]}`: the prompt
  rendered with the generation prompt, then the whole conversation; the
  tokens after the prompt's weigh 1;
- `{"prompt": "text", "completion": "text"}`: plain text, no template; the
  completion's tokens and the separator after it weigh 1.

A template is rendered as transformers' `apply_chat_template` renders it: jinja2
in a sandbox with `trim_blocks` and `lstrip_blocks`, the special tokens of
`tokenizer_config.json` as variables, and the `{% generation %}` extension
recording where assistant text lies; the text is then tokenized without
added special tokens, and each recorded span weighs the tokens from the one
holding its first character to the one holding its last. The template is the
checkpoint's (`chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`) or one named here for tokenizers without one (`chatml`), or
a `.jinja` file.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import numpy as np

from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.data.separator import read_json
from nestor.orchestrator.data.tokenizer import BYTES, encode_bytes

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
NAMED_TEMPLATES = {
    # ChatML (OpenAI; Qwen's, without its tool calls): assistant turns with their end of turn are trained
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
               "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
               "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
}
PROBE = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]  # finds the end of turn


def template_text(tokenizer_path: str | None, choice: str | None, key: str = "--chat-template") -> str:
    """Returns the chat template `choice` names (a name of NAMED_TEMPLATES or a .jinja file), or by default
    the tokenizer's checkpoint's. Raises ConfigError naming `key` when there is none."""
    if choice:
        if choice in NAMED_TEMPLATES:
            return NAMED_TEMPLATES[choice]
        if Path(choice).expanduser().is_file():
            return Path(choice).expanduser().read_text()
        raise ConfigError([(key, f"{choice!r} is neither a template name ({', '.join(NAMED_TEMPLATES)}) nor a file")])
    directory = Path(tokenizer_path).expanduser().parent if tokenizer_path not in (None, BYTES) else None
    if directory is not None and (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text()
    found = special_tokens_config(tokenizer_path).get("chat_template")
    if isinstance(found, list):  # named templates: transformers renders "default"
        found = next((entry.get("template") for entry in found if isinstance(entry, dict)
                      and entry.get("name") == "default"), None)
    if isinstance(found, str) and found:
        return found
    raise ConfigError([(key, f"the tokenizer {tokenizer_path} has no chat template ({TEMPLATE_FILE} or "
                             f"{CONFIG_FILE}'s chat_template beside it); name one ({', '.join(NAMED_TEMPLATES)}) "
                             "or give a .jinja file")])


def special_tokens_config(tokenizer_path: str | None) -> dict:
    """Returns the tokenizer_config.json beside a tokenizer file ({} when there is none)."""
    if tokenizer_path in (None, BYTES):
        return {}
    return read_json(Path(tokenizer_path).expanduser().parent / CONFIG_FILE)


def _special_token_variables(config: dict) -> dict:
    """Returns the special tokens transformers passes a template (bos_token, eos_token, ...) as text."""
    variables = {}
    for name, value in config.items():
        if name.endswith("_token"):
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                variables[name] = value
    return variables


class ChatTemplate:
    """A chat template compiled once: `render(messages, add_generation_prompt)` -> (text, spans of the
    assistant text as [start, stop) character offsets)."""

    def __init__(self, text: str, special_tokens: dict, key: str = "--chat-template"):
        try:
            import jinja2
            from jinja2 import nodes
            from jinja2.ext import Extension, loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError([(key, "chat templates need jinja2: pip install jinja2")]) from None
        spans: list[tuple[int, int]] = []
        pieces: list[str] = []

        class Generation(Extension):
            """`{% generation %}...{% endgeneration %}`: records where the text inside lies in the output."""

            tags = {"generation"}

            def parse(self, parser):
                line = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(line)

            def _record(self, caller):
                inside = caller()
                start = sum(map(len, pieces))  # every earlier piece of the output has been yielded
                spans.append((start, start + len(inside)))
                return inside

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[Generation, loopcontrols])
        environment.filters["tojson"] = tojson
        environment.globals.update(raise_exception=raise_exception,
                                   strftime_now=lambda format: datetime.now().strftime(format))
        try:
            self._template = environment.from_string(text)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ConfigError([(key, f"the chat template does not parse: {error}")]) from None
        self._spans, self._pieces, self._error = spans, pieces, jinja2.exceptions.TemplateError
        self.special_tokens = special_tokens
        self.key = key

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """Returns (the rendered text, [start, stop) character spans of its `{% generation %}` blocks).
        Raises ConfigError when the template rejects the messages (its `raise_exception`)."""
        self._spans.clear()
        self._pieces.clear()
        try:
            for piece in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 tools=None, documents=None, **self.special_tokens):
                self._pieces.append(piece)
        except self._error as error:
            raise ConfigError([(self.key, f"the chat template refuses the messages: {error}")]) from None
        return "".join(self._pieces), [span for span in self._spans if span[1] > span[0]]


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A record as tokens: int ids and float loss weights (one more weight than ids where the separator
    after them is trained too)."""

    ids: np.ndarray
    weights: np.ndarray


def offsets_encoder(tokenizer_path: str | None, key: str = "--tokenizer") -> Callable[[str], tuple[list[int], Callable]]:
    """Returns encode(text) -> (ids without added special tokens, char_to_token(offset) -> token index or
    None): a tokenizers .json's offsets, or bytes'. Raises ConfigError naming `key` for another kind."""
    if tokenizer_path in (None, BYTES):
        def encode_text_bytes(text: str):
            ids = encode_bytes(text).tolist()
            starts = np.cumsum([0] + [len(character.encode()) for character in text])
            return ids, lambda offset: int(starts[offset]) if 0 <= offset < len(text) else None
        return encode_text_bytes
    if not str(tokenizer_path).endswith(".json"):
        raise ConfigError([(key, f"chat data is tokenized with a tokenizers .json or bytes, not {tokenizer_path}")])
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_path).expanduser()))

    def encode(text: str):
        encoding = tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.char_to_token

    return encode


def weighted_tokens(encode, text: str, spans: list[tuple[int, int]]) -> Encoded:
    """Returns `text` encoded, the tokens from the one holding each span's first character to the one holding
    its last weighing 1 (as transformers builds its assistant masks)."""
    ids, char_to_token = encode(text)
    weights = np.zeros(len(ids), np.float32)
    for start, stop in spans:
        first, last = char_to_token(start), char_to_token(stop - 1)
        if first is None:
            continue
        weights[first:(last + 1 if last is not None else len(ids))] = 1
    return Encoded(np.asarray(ids, np.int64), weights)


def is_chat_record(record) -> bool:
    """Returns whether a JSONL record is chat or instruction data (`messages`, or `prompt` and `completion`)."""
    return isinstance(record, dict) and ("messages" in record or {"prompt", "completion"} <= set(record))


def _messages(value, what: str) -> list[dict]:
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise ValueError(f"{what} is not a list of {{role, content}} messages")
    return value


class ChatEncoder:
    """Chat and instruction records -> `Encoded` tokens and loss weights (see the module doc)."""

    def __init__(self, tokenizer_path: str | None, template: str):
        self.encode = offsets_encoder(tokenizer_path)
        self.template = ChatTemplate(template, _special_token_variables(special_tokens_config(tokenizer_path)))

    def __call__(self, record: dict) -> Encoded:
        """Returns a record's tokens and weights; raises ValueError saying what a malformed record lacks."""
        if "messages" in record:
            text, spans = self.template.render(_messages(record["messages"], "messages"))
            return weighted_tokens(self.encode, text, spans)
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            encoded = weighted_tokens(self.encode, prompt + completion, [(len(prompt), len(prompt + completion))])
            return Encoded(encoded.ids, np.append(encoded.weights, 1))  # and the separator: learn to stop
        prompt = _messages(prompt, "prompt")
        prompt_ids, _ = self.encode(self.template.render(prompt, add_generation_prompt=True)[0])
        ids, _ = self.encode(self.template.render(prompt + _messages(completion, "completion"))[0])
        if list(ids[:len(prompt_ids)]) != list(prompt_ids):
            raise ValueError("the chat template renders the prompt otherwise at the start of the whole conversation")
        weights = np.concatenate([np.zeros(len(prompt_ids)), np.ones(len(ids) - len(prompt_ids))]).astype(np.float32)
        return Encoded(np.asarray(ids, np.int64), weights)

    def end_of_turn(self) -> int | None:
        """Returns the id that ends an assistant turn (the last token of a `{% generation %}` block), or None
        for a template without one."""
        text, spans = self.template.render(PROBE)
        encoded = weighted_tokens(self.encode, text, spans)
        trained = np.flatnonzero(encoded.weights)
        return int(encoded.ids[trained[-1]]) if len(trained) else None

    def prompt(self, messages: list[dict]) -> list[int]:
        """Returns the ids of `messages` rendered with the generation prompt: what a model answers."""
        return list(self.encode(self.template.render(messages, add_generation_prompt=True)[0])[0])
