"""Small real datasets that ship inside packages of the package index, as `data.factory` functions
(`data.source: python`): what the model families' configs and tests train on."""

from __future__ import annotations

import numpy as np

from nestor.orchestrator.config import ConfigError

SPLITS = ("train", "eval")


def digits(split: str = "train", eval_fraction: float = 0.2, seed: int = 0) -> dict[str, np.ndarray]:
    """Returns scikit-learn's handwritten digits (1,797 images of 8 x 8 pixels, UCI; `load_digits`) as
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
