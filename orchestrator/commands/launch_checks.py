"""What a launcher checks in the user's process before any worker starts: the user's code, the data
sources, the model built abstractly (its layout on the mesh, its loss on abstract inputs) and the newest
checkpoint against the config, each a ConfigError naming the key, in seconds, with nothing written (the
workers check the same again where they run); then, where the target's compiler is installed here, the
step compiled for the target against its memory (`check_target_fit`, as long as a compile takes)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orbax.checkpoint as ocp

from nestor.orchestrator.checkpoint.files import checkpoint_dir, finalized_steps
from nestor.orchestrator.checkpoint.reader import config_differences
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.batches import text_files
from nestor.orchestrator.data.tokens import check_tokenizers, mixture_sources
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.abstract_check import check_abstractly
from nestor.orchestrator.loader.memory_fit import GIB
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


def check_target_fit(config: Config, say: Callable[[str], None]) -> dict | None:
    """Compiles the train step for `cluster.device_kind`'s deviceless devices with the target's own compiler
    (backend.targets) and raises ConfigError when XLA's memory analysis of it, state and temporaries, is
    more than a device's memory; `say` gets a line before the compile and one after. A step compiled with a
    kernel substituted (cuDNN's attention without its wheel, say) is an upper bound: said, never refused.
    Returns explain's `fit` entry, or None where nothing was compiled: `cluster.compile_check` false, a
    cluster by address (its hosts read the data the batch is built from), `cluster.devices_per_host=-1`
    (the count is the hosts'), or a target nestor ships no compiler for or whose extra is not installed here
    (the train state alone was checked, `check_abstractly`). Its jax is kept on the CPU: this process runs
    nothing, and on a GPU host jax would claim memory the workers need."""
    import jax

    from nestor.orchestrator.job.build import build_job, compile_target
    from nestor.orchestrator.job.compiled import from_cache, memory_per_device, step_fit, timed_compile
    from nestor.orchestrator.job.state import bytes_text

    cluster = config.cluster
    if not cluster.compile_check or cluster.address or cluster.devices_per_host == -1:
        return None
    target = compile_target(config, present="cpu")
    if target.devices is None:
        return None
    jax.config.update("jax_platforms", "cpu")
    count = cluster.hosts * cluster.devices_per_host
    say(f"compile check: {target.compiler} compiles the step for {count} x {target.target} "
        "(cluster.compile_check=false skips it)")
    job = build_job(config, devices=target.devices, with_data=False)
    compiled, seconds = timed_compile(job)
    fit = step_fit(job, memory_per_device(job, compiled))
    needs = (f"{bytes_text(fit['total_bytes'])} per device (parameters + optimizer {bytes_text(fit['state_bytes'])}, "
             f"temporaries {bytes_text(fit['temporaries_bytes'])})")
    substituted = job.backend.compiled_here().substitutions
    if fit["fits"] is False and not substituted:
        memory = f"{fit['device_memory_bytes'] / GIB:g} GiB of {fit['device_kind']}"
        if fit["state_bytes"] > fit["device_memory_bytes"]:
            key, change = "mesh.fsdp", "shard the state over more devices (mesh.fsdp)"
        elif config.model.remat != "full":
            key, change = "model.remat", "model.remat=full, more mesh.fsdp"
        else:
            key, change = "train.grad_accum", "more train.grad_accum, more mesh.fsdp"
        raise ConfigError([(key, f"the step as {target.compiler} compiles it needs {needs}, more than the {memory}: "
                                 f"{fit['verdict']}; try {change}, or `nestor plan` for a layout that fits "
                                 "(cluster.compile_check=false starts it anyway)")])
    bound = f" (an upper bound: {'; '.join(substituted)})" if substituted else ""
    anyway = "; started anyway: the target's own kernels need less" if fit["fits"] is False else ""
    took = "read from run.compile_cache" if from_cache(compiled) else f"in {seconds:.0f} s"
    say(f"compile check: {needs}{bound} {took}: {fit['verdict']}{anyway}")
    return fit
