"""What a launcher checks in the user's process before any worker starts: the user's code, the data
sources, the model built abstractly (its layout on the mesh, its loss on abstract inputs) and the newest
checkpoint against the config, each a ConfigError naming the key, in seconds, with nothing written (the
workers check the same again where they run); then, where the target's compiler is installed here, the
step compiled for the target against its memory (`check_target_fit`, as long as a compile takes)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import orbax.checkpoint as ocp

from nestor.backend import BackendError
from nestor.backend.targets import compiler_version, target_devices, target_name
from nestor.orchestrator.checkpoint.files import checkpoint_dir, finalized_steps
from nestor.orchestrator.checkpoint.reader import config_differences
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.batches import text_files
from nestor.orchestrator.data.tokens import check_tokenizers, mixture_sources
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.abstract_check import check_abstractly
from nestor.orchestrator.loader.memory_fit import GIB, fit_report
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
    more than a device's memory; `say` gets a line before the compile and one after. Returns explain's
    `fit` entry, or None where nothing was compiled: `cluster.compile_check` false, a target nestor ships no
    compiler for or its extra not installed here (the train state alone was checked, `check_abstractly`), or
    `cluster.devices_per_host=-1` (the count is the hosts').
    This process compiles and runs nothing else, so its jax is kept off any accelerator of this host."""
    import jax

    from nestor.orchestrator.job.build import build_job, devices_here
    from nestor.orchestrator.job.compiled import memory_per_device, timed_compile
    from nestor.orchestrator.job.state import bytes_text

    cluster = config.cluster
    target = target_name(cluster.device_kind)
    if not cluster.compile_check or target is None or cluster.devices_per_host == -1:
        return None
    if compiler_version(target) is None:
        return None
    if not jax.config.jax_platforms:  # a driver on a GPU host must not claim the workers' GPU memory
        jax.config.update("jax_platforms", "cpu")
    try:
        devices = target_devices(cluster.device_kind, "cpu", cluster.hosts, cluster.devices_per_host,
                                 math.prod(config.mesh.dcn_shape().values()))
    except BackendError as error:
        raise ConfigError([(error.key, error.message)]) from None
    count = cluster.hosts * cluster.devices_per_host
    say(f"compile check: {devices.compiler} compiles the step for {count} x {target} "
        "(cluster.compile_check=false skips it)")
    job = build_job(config, devices=devices.devices, with_data=False)
    compiled, seconds = timed_compile(job)
    memory = memory_per_device(job, compiled)
    fit = fit_report(config, job.backend, memory["params"] + memory["optimizer"], memory["temporaries"],
                     memory["peak_estimate"], devices_here(job.mesh), job.mesh.shape["pipeline"])
    needs = (f"{bytes_text(fit['total_bytes'])} per device (parameters + optimizer {bytes_text(fit['state_bytes'])}, "
             f"temporaries {bytes_text(fit['temporaries_bytes'])})")
    if fit["fits"] is False:
        key = "model.remat" if config.model.remat != "full" else "train.grad_accum"
        change = "model.remat=full" if key == "model.remat" else "more train.grad_accum"
        raise ConfigError([(key, f"the step as {devices.compiler} compiles it needs {needs}, more than the "
                                 f"{fit['device_memory_bytes'] / GIB:g} GiB of {fit['device_kind']}: "
                                 f"{fit['verdict']}; try {change}, more mesh.fsdp, or `nestor plan` for a layout "
                                 "that fits (cluster.compile_check=false starts it anyway)")])
    say(f"compile check: {needs} in {seconds:.0f} s: {fit['verdict']}")
    return fit
