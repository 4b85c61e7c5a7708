"""Keys a config sets that do nothing in the run it describes: TPU placement off TPUs, the Ray launcher's
keys in-process, pipeline keys without a pipeline, MoE keys of a dense model, data keys its source does
not read. Such a config is valid, but a key set to no effect is as likely a mistake as a typo: the CLI
names them all in one warning line instead of refusing the run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nestor.orchestrator.config.keys import key_table
from nestor.orchestrator.config.degrees import mesh_degrees, total_devices
from nestor.orchestrator.specs.registry import spec_of

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config

RAY_LAUNCHER_KEYS = ("cluster.address", "cluster.max_failures", "cluster.min_hosts", "cluster.restart_timeout_s",
                     "cluster.init_timeout_s", "cluster.dashboard", "cluster.worker_logs", "cluster.compile_check")
TPU_KEYS = ("cluster.tpu_topology", "cluster.tpu_type")
PIPELINE_KEYS = ("pipeline.microbatches", "pipeline.schedule", "pipeline.repeats", "pipeline.stack")


def idle_keys(config: Config, searched: frozenset[str] = frozenset()) -> list[tuple[list[str], str]]:
    """Returns (keys, why they do nothing) for each group of keys set away from their defaults that this
    run never reads; empty when every key set counts. `searched`: the keys a plan chooses (named by no
    group; with mesh.pipeline among them, the stages are not known, and no pipeline key is idle)."""
    changed = _changed_keys(config) - searched
    groups = []
    for keys, why in _modes(config, stages_known="mesh.pipeline" not in searched):
        if idle := [key for key in keys if key in changed]:
            groups.append((idle, why))
    return groups


def idle_warning(config: Config, searched: frozenset[str] = frozenset()) -> str | None:
    """Returns the one warning line that names every idle key (`idle_keys`) and why, or None."""
    groups = idle_keys(config, searched)
    if not groups:
        return None
    return "warning: these keys do nothing in this run: " + "; ".join(f"{', '.join(keys)} ({why})"
                                                                      for keys, why in groups)


def _modes(config: Config, stages_known: bool = True) -> list[tuple[tuple[str, ...], str]]:
    """Returns (keys, why) for every mode of `config` that leaves keys unread (the pipeline's only where
    `stages_known`)."""
    cluster, data = config.cluster, config.data
    modes = []
    if cluster.accelerator != "tpu":
        modes.append((TPU_KEYS, f"cluster.accelerator={cluster.accelerator}: they place TPU workers"))
    if cluster.launcher == "inprocess":
        modes.append((RAY_LAUNCHER_KEYS, "cluster.launcher=inprocess: they configure the Ray launcher"))
    stages = _pipeline_stages(config) if stages_known else None
    if stages == 1:
        modes.append((PIPELINE_KEYS, "mesh.pipeline=1: no pipeline"))
    elif stages and config.pipeline.schedule == "circular" and config.pipeline.repeats == 1:
        modes.append((("pipeline.schedule",), "circular with pipeline.repeats=1 runs as gpipe"))
    modes += spec_of(config).idle_modes(config)
    if data.source in ("synthetic", "python"):
        modes.append((("data.paths",), f"data.source={data.source} reads no files"))
    if data.source != "python":
        modes.append((("data.factory", "data.args"), f"data.source={data.source}, not python"))
    if not config.profile.start_step:
        modes.append((("profile.steps",), "profile.start_step=0: no trace"))
    return modes


def _pipeline_stages(config: Config) -> int | None:
    """Returns the pipeline's degree, or None while a -1 mesh axis waits for the device count."""
    if total_devices(config) is None and -1 in config.mesh.ici_shape().values():
        return None
    return mesh_degrees(config)["pipeline"]


def _changed_keys(config: Config) -> set[str]:
    """Returns the dotted paths of the keys whose value is not their default."""
    plain = config.to_dict()
    changed = set()
    for path, _, default, _ in key_table(type(config)):
        value: Any = plain
        for part in path.split("."):
            value = value[part]
        if value != (list(default) if isinstance(default, tuple) else default):
            changed.add(path)
    return changed
