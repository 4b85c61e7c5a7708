"""What a launcher checks in the user's process before any worker starts: the user's code, the data
sources, the model built abstractly (its layout on the mesh, its loss on abstract inputs) and the newest
checkpoint against the config. Each is a ConfigError naming the key, in seconds,
with nothing written; the workers check the same again where they run."""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from nestor.orchestrator.checkpoint.files import checkpoint_dir, finalized_steps
from nestor.orchestrator.checkpoint.reader import config_differences
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.batches import text_files
from nestor.orchestrator.data.tokens import check_tokenizers, mixture_sources
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.abstract_check import check_abstractly
from nestor.orchestrator.specs.registry import resolve_user_code, spec_of


def data_problems(config: Config) -> None:
    """Raises ConfigError where the training data cannot be opened: text globs that match nothing (or
    match binary files), prepared directories that are missing, unfinished or of another tokenizer, array
    files that do not exist. A run on a cluster by address reads its data there: not checked here."""
    data = config.data
    if config.cluster.address:
        return
    if data.source == "text":
        text_files(data.paths)
    elif data.source == "tokens":
        check_tokenizers(config, mixture_sources(config))
    elif data.source == "arrays":
        missing = [path for path in data.paths if not Path(path).exists()]
        if missing:
            raise ConfigError([("data.paths", f"{', '.join(missing)}: no such file or directory")])


def checkpoint_misfit(config: Config) -> None:
    """Raises ConfigError when run.dir's newest checkpoint was written by nestor's LM with other keys that
    shape its arrays (model sizes, MoE layout), naming each; a model of the user's is left to the workers,
    which compare the arrays."""
    steps = finalized_steps(checkpoint_dir(config.run.dir))
    if not steps:
        return
    step_dir = checkpoint_dir(config.run.dir) / str(steps[-1])
    try:
        saved = ocp.JsonCheckpointHandler().restore(step_dir / "config")
    except Exception:  # noqa: BLE001 - an unreadable config is the workers' to judge (and quarantine)
        return
    current = config.to_dict()
    keys = spec_of(config).checkpoint_shape_keys(current, saved)
    if keys is None:
        return
    problems = config_differences(current, saved, keys, step_dir, "; use the checkpoint's value or a new run.dir")
    if problems:
        raise ConfigError(problems)


def check_before_launch(config: Config) -> None:
    """Raises ConfigError for what the user's process can find wrong before workers start (see the module)."""
    resolve_user_code(config)
    data_problems(config)
    if not config.cluster.address:  # a cluster by address reads the data the model is checked on there
        check_abstractly(config)
    checkpoint_misfit(config)
