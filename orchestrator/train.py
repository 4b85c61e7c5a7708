"""The training loop: config -> mesh -> sharded state -> steps -> metrics.jsonl."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import numpy as np
import yaml
from jax.sharding import Mesh

from orchestrator.config import Config, ConfigError
from orchestrator.data import SyntheticData
from orchestrator.state import StateLayout, init_state, state_layout
from orchestrator.step import batch_sharding, make_train_step
from parallel.mesh import MeshError, build_mesh
from parallel.rules import Rules, resolve_rules


def select_devices(config: Config) -> list[jax.Device]:
    """Returns the devices the run uses: `cluster.devices_per_host` of each process's devices.

    Raises ConfigError when a process has fewer devices than asked for.
    """
    wanted = config.cluster.devices_per_host
    by_process: dict[int, list[jax.Device]] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    selected = []
    for process, devices in sorted(by_process.items()):
        if wanted != -1 and len(devices) < wanted:
            raise ConfigError([("cluster.devices_per_host",
                                f"asks for {wanted} devices but process {process} has {len(devices)} "
                                f"({devices[0].platform}); lower it or use -1 for all")])
        selected += devices if wanted == -1 else devices[:wanted]
    return selected


def make_mesh(config: Config, devices: list[jax.Device] | None = None) -> Mesh:
    """Returns the run's mesh; a degree that does not fit the devices raises ConfigError."""
    try:
        return build_mesh(config.mesh.ici_shape(), config.mesh.dcn_shape(),
                          devices if devices is not None else select_devices(config))
    except MeshError as error:
        raise ConfigError([(error.key, str(error).split(": ", 1)[1])]) from None


@dataclasses.dataclass
class Job:
    """A compiled-to-be training job: mesh, rules, state layout, step function, data."""

    config: Config
    mesh: Mesh
    rules: Rules
    layout: StateLayout
    step_fn: object
    data: SyntheticData


def build_job(config: Config, devices: list[jax.Device] | None = None, *, unroll_loops: bool = False) -> Job:
    """Returns the job for `config` on `devices` (default: `select_devices`), nothing compiled yet.

    `unroll_loops=True` gives a step for FLOP counting only (see make_train_step).
    """
    mesh = make_mesh(config, devices)
    rules = resolve_rules(config.mesh.rules)
    layout = state_layout(config, mesh, rules)
    step_fn = make_train_step(config, layout, mesh, rules, unroll_loops=unroll_loops)
    data = SyntheticData(config, batch_sharding(mesh, rules))
    return Job(config, mesh, rules, layout, step_fn, data)


@dataclasses.dataclass
class TrainResult:
    losses: list[float]
    state: dict
    history: list[dict]


def _to_host(metrics: dict) -> dict:
    # scalars become floats; per-layer arrays (MoE tokens per expert) nested lists
    return {name: np.asarray(value).tolist() for name, value in metrics.items()}


class MetricsLog:
    """Appends one JSON object per logged step to run.dir/metrics.jsonl."""

    def __init__(self, run_dir: Path, tokens_per_step: int):
        self.path = run_dir / "metrics.jsonl"
        self.tokens_per_step = tokens_per_step
        self.enabled = jax.process_index() == 0

    def write(self, step: int, metrics: dict, step_time_s: float) -> dict:
        record = {"step": step, **metrics, "step_time_s": step_time_s,
                  "tokens_per_s": self.tokens_per_step / step_time_s if step_time_s > 0 else math.nan}
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record


def train(config: Config, devices: list[jax.Device] | None = None, log=print) -> TrainResult:
    """Trains `config.train.steps` steps; returns the losses, final state and logged records.

    Device values are read one step late, so logging never waits on the step
    that is running. Raises ConfigError for configs that do not fit the devices.
    """
    job = build_job(config, devices)
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    log(f"mesh {dict(job.mesh.shape)} over {job.mesh.devices.size} {job.mesh.devices.flat[0].platform} devices")
    state = init_state(config, job.layout)
    metrics_log = MetricsLog(run_dir, config.train.global_batch * config.train.seq_len)
    history, losses = [], []
    pending = None  # (step, device metrics, start time) of the step whose values are not read yet

    def flush(pending, finished_at):
        step, metrics, started = pending
        values = _to_host(metrics)
        losses.append(values["loss"])
        if step % config.train.log_every == 0 or step == config.train.steps:
            record = metrics_log.write(step, values, finished_at - started)
            history.append(record)
            log(f"step {step:5d}  loss {values['loss']:.4f}  lr {values['lr']:.2e}  "
                f"grad_norm {values['grad_norm']:.3f}  {record['tokens_per_s']:.0f} tok/s")

    last = time.perf_counter()
    for step in range(config.train.steps):
        tokens = job.data.batch(step)
        state, metrics = job.step_fn(state, tokens)
        if pending is not None:
            jax.block_until_ready(pending[1])
            now = time.perf_counter()
            flush(pending, now)
            last = now
        pending = (step + 1, metrics, last)
    jax.block_until_ready(state)
    flush(pending, time.perf_counter())
    return TrainResult(losses, state, history)
