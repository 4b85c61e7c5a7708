"""What a launcher checks in the user's process before any worker starts: the user's code, the data
sources and the newest checkpoint against the config. Each is a ConfigError naming the key, in seconds,
with nothing written; the workers check the same again where they run."""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from nestor.orchestrator.checkpoint_restore import checkpoint_dir, finalized_steps
from nestor.orchestrator.config import Config, ConfigError
from nestor.orchestrator.data.batches import text_files
from nestor.orchestrator.data.tokens import check_tokenizers, mixture_sources
from nestor.orchestrator.model_class import resolve_user_code
from nestor.orchestrator.paths import shown

# the config keys that shape the train state a checkpoint holds (the workers compare the arrays themselves)
SHAPING = {"model": ("class", "args", "vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "mlp_dim", "tie_embeddings", "qkv_bias", "out_bias", "qk_norm"),
           "moe": ("num_experts", "every", "expert_mlp_dim", "shared_experts", "first_dense_layers")}


def data_problems(config: Config) -> None:
    """Raises ConfigError where the training data cannot be opened: text globs that match nothing (or
    match binary files), prepared directories that are missing, unfinished or of another tokenizer, array
    files that do not exist."""
    data = config.data
    if data.source == "text":
        text_files(data.paths)
    elif data.source == "tokens":
        check_tokenizers(config, mixture_sources(config))
    elif data.source == "arrays":
        missing = [path for path in data.paths if not Path(path).exists()]
        if missing:
            raise ConfigError([("data.paths", f"{', '.join(missing)}: no such file or directory")])


def checkpoint_misfit(config: Config) -> None:
    """Raises ConfigError when run.dir's newest checkpoint was written by a model of other `model.*` or
    `moe.*` keys (its arrays would not fit), naming each key that differs."""
    steps = finalized_steps(checkpoint_dir(config.run.dir))
    if not steps:
        return
    step_dir = checkpoint_dir(config.run.dir) / str(steps[-1])
    try:
        saved = ocp.JsonCheckpointHandler().restore(step_dir / "config")
    except Exception:  # noqa: BLE001 - an unreadable config is the workers' to judge (and quarantine)
        return
    current = config.to_dict()
    problems = [(f"{section}.{key}", f"is {current[section].get(key)!r} but {shown(step_dir)} was written with "
                                     f"{saved[section][key]!r}; use the checkpoint's value or a new run.dir")
                for section, keys in SHAPING.items() for key in keys
                if key in saved.get(section, {}) and current[section].get(key) != saved[section][key]]
    if problems:
        raise ConfigError(problems)


def check_before_launch(config: Config) -> None:
    """Raises ConfigError for what the user's process can find wrong before workers start (see the module)."""
    resolve_user_code(config)
    data_problems(config)
    checkpoint_misfit(config)
