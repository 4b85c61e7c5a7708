"""Preference pairs for DPO (`train.objective: dpo`): JSONL records of a `prompt` (messages, or text) with
a `chosen` and a `rejected` answer (a message, messages, or text), rendered as SFT's prompt/completion
records are (orchestrator.data.chat: the chat template, completion weights 1 on the answer) and stored as
named arrays that `data.source: arrays` reads: `chosen` and `rejected` tokens [pairs, length + 1] and their
completion weights `chosen_weights`, `rejected_weights` [pairs, length] (the weight of each target), padded
with the separator at weight 0. A side longer than length + 1 tokens is cut there, and counted.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from nestor.models.dpo import SIDES
from nestor.orchestrator.data.chat import ChatEncoder, template_text
from nestor.orchestrator.data.separator import resolve_separator
from nestor.orchestrator.errors import ConfigError

FIELDS = ("prompt", "chosen", "rejected")
SPLIT_FILES = {"train": "train.npz", "eval": "eval.npz"}


def is_preference_record(record) -> bool:
    """Returns whether a JSONL record is a preference pair (prompt, chosen and rejected)."""
    return isinstance(record, dict) and set(FIELDS) <= set(record)


def _completion(answer, prompt) -> str | list[dict]:
    """Returns an answer as SFT's prompt/completion records hold it: text after a text prompt, else messages."""
    if isinstance(prompt, str) or not isinstance(answer, str):
        return answer
    return [{"role": "assistant", "content": answer}]


def encode_pair(encoder: ChatEncoder, record: dict, separator: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Returns each side's (tokens, completion mask per token) of a preference record: prompt + answer, a
    text answer followed by the separator (weighted: the policy learns to stop). Raises ValueError naming
    what a malformed record lacks."""
    sides = {}
    for side in SIDES:
        encoded = encoder({"prompt": record["prompt"], "completion": _completion(record[side], record["prompt"])})
        ids, mask = encoded.ids, encoded.weights
        if len(mask) > len(ids):  # a text completion's weight of the separator that ends it
            ids = np.append(ids, separator)
        sides[side] = (ids, mask)
    return sides


def _rows(pairs: list[dict], length: int, separator: int) -> tuple[dict[str, np.ndarray], int]:
    """Returns (the named arrays of `pairs`, each side [pairs, length + 1], the sides cut to fit)."""
    arrays = {side: np.full((len(pairs), length + 1), separator, np.int32) for side in SIDES}
    arrays.update({f"{side}_weights": np.zeros((len(pairs), length), np.float32) for side in SIDES})
    cut = 0
    for row, pair in enumerate(pairs):
        for side in SIDES:
            ids, mask = pair[side]
            cut += len(ids) > length + 1
            ids, mask = ids[:length + 1], mask[:length + 1]
            arrays[side][row, :len(ids)] = ids
            arrays[f"{side}_weights"][row, :len(ids) - 1] = mask[1:]  # target t + 1 of place t
    return arrays, cut


def prepare_preferences(files: list[Path], tokenizer: str, out: Path, eval_fraction: float = 0.0,
                        seq_len: int = 0, chat_template: str | None = None, separator: int | str = "eos",
                        log=print) -> dict:
    """Writes the preference pairs of JSONL `files` to `out`/train.npz (and eval.npz: the pairs a hash of
    their prompt holds out at `eval_fraction`), each side `seq_len` + 1 tokens (0: the longest pair's);
    returns {"seq_len", "splits": {split: pairs}, "cut"}. Raises ConfigError naming SOURCE for a record that
    is not a pair."""
    records = [(f"{path}:{number}", json.loads(line)) for path in files
               for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    chat = any(isinstance(record, dict) and not isinstance(record.get("prompt"), str) for _, record in records)
    path = None if tokenizer == "bytes" else tokenizer
    encoder = ChatEncoder(path, template_text(path, chat_template) if chat else "")  # text pairs need no template
    end = resolve_separator(separator, tokenizer, "--separator")
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    for where, record in records:
        try:
            if not is_preference_record(record):
                raise ValueError(f"it lacks {', '.join(f for f in FIELDS if f not in record)}")
            pair = encode_pair(encoder, record, end)
        except (ValueError, TypeError) as error:
            raise ConfigError([("SOURCE", f"{where} is not a preference pair: {error}")]) from None
        held = zlib.crc32(json.dumps(record["prompt"]).encode()) / 2**32 < eval_fraction
        splits["eval" if held else "train"].append(pair)
    if not splits["train"]:
        raise ConfigError([("SOURCE", "no preference pair for training (all held out, or none)")])
    length = seq_len or max(len(ids) for pairs in splits.values() for pair in pairs for ids, _ in pair.values()) - 1
    out.mkdir(parents=True, exist_ok=True)
    cut = 0
    for split, pairs in splits.items():
        if pairs:
            arrays, split_cut = _rows(pairs, length, end)
            cut += split_cut
            np.savez(out / SPLIT_FILES[split], **arrays)
    if cut:
        log(f"{cut} answer(s) longer than {length + 1} tokens were cut there (--seq-len)")
    return {"seq_len": length, "splits": {split: len(pairs) for split, pairs in splits.items()}, "cut": cut}
