"""Small real datasets that ship inside packages of the package index, as `data.factory` functions
(`data.source: python`): what the model families' configs and tests train on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nestor.orchestrator.errors import ConfigError

SPLITS = ("train", "eval")


def digits(split: str = "train", eval_fraction: float = 0.2, seed: int = 0) -> dict[str, np.ndarray]:
    """Returns scikit-learn's handwritten digits (8 x 8 grayscale images, UCI; `load_digits`) as
    {"image" float32 [n, 8, 8, 1] in [0, 1], "label" int32 [n]}: the `eval` split is a fixed `eval_fraction`
    of the images (a permutation by `seed`), `train` the rest."""
    if split not in SPLITS:
        raise ConfigError([("data.factory", f"digits has the splits {', '.join(SPLITS)}, not {split!r}")])
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError([("data.factory", "digits reads scikit-learn's copy of the dataset: pip install "
                                            "scikit-learn (nestor's `examples` extra)")]) from None
    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    held_out = int(round(eval_fraction * len(order)))
    rows = order[:held_out] if split == "eval" else order[held_out:]
    images = (data.images[rows] / 16.0).astype(np.float32)[..., None]
    return {"image": images, "label": data.target[rows].astype(np.int32)}


def _byte_tokens(text: str, length: int, bos: bool) -> np.ndarray:
    """Returns `text`'s UTF-8 bytes as tokens (byte b -> b + 2; models.seq2seq's PAD 0, BOS 1), BOS first when
    `bos`, cut or padded with PAD to `length`."""
    tokens = [1] * bos + [byte + 2 for byte in text.encode()]
    return np.asarray((tokens + [0] * length)[:length], np.int32)


def _pairs_to_arrays(pairs: list[tuple[str, str]], source_length: int, target_length: int) -> dict[str, np.ndarray]:
    return {"source": np.stack([_byte_tokens(source, source_length, False) for source, _ in pairs]),
            "target": np.stack([_byte_tokens(target, target_length + 1, True) for _, target in pairs])}


def translation(split: str = "train", paths: tuple[str, ...] = (), source_length: int = 64, target_length: int = 64,
                eval_fraction: float = 0.05, seed: int = 0) -> dict[str, np.ndarray]:
    """Returns source/target pairs of JSONL files (`paths`; one {"source": ..., "target": ...} object a line)
    as byte tokens: "source" int32 [n, source_length], "target" int32 [n, target_length + 1] opening with
    BOS (models.seq2seq). The `eval` split is a fixed `eval_fraction` of the pairs (a permutation by `seed`)."""
    if split not in SPLITS:
        raise ConfigError([("data.factory", f"translation has the splits {', '.join(SPLITS)}, not {split!r}")])
    if not paths:
        raise ConfigError([("data.args", "translation needs paths: [JSONL files of {source, target} objects]")])
    pairs = []
    for path in paths:
        for number, line in enumerate(Path(path).expanduser().read_text().splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict) or not {"source", "target"} <= set(record):
                    raise ConfigError([("data.args", f"{path}:{number} is not a {{source, target}} object")])
                pairs.append((str(record["source"]), str(record["target"])))
    order = np.random.default_rng(seed).permutation(len(pairs))
    held_out = max(1, int(round(eval_fraction * len(pairs))))
    rows = order[:held_out] if split == "eval" else order[held_out:]
    return _pairs_to_arrays([pairs[row] for row in rows], source_length, target_length)


def reversal(split: str = "train", rows: int = 4096, words: int = 3, source_length: int = 24,
             target_length: int = 24, seed: int = 0) -> dict[str, np.ndarray]:
    """Returns a synthetic translation task: `words` random lowercase words, and as the target the same
    words in reverse order, each spelled backwards (every target byte needs attention to another source
    position). `eval` draws its own `rows // 8` pairs from another seed."""
    if split not in SPLITS:
        raise ConfigError([("data.factory", f"reversal has the splits {', '.join(SPLITS)}, not {split!r}")])
    rng = np.random.default_rng((seed, SPLITS.index(split)))
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    pairs = []
    for _ in range(rows if split == "train" else max(rows // 8, 1)):
        sentence = " ".join("".join(rng.choice(letters, rng.integers(2, 6))) for _ in range(words))
        pairs.append((sentence, sentence[::-1]))
    return _pairs_to_arrays(pairs, source_length, target_length)
