"""The training loop: config -> mesh -> sharded state -> steps -> metrics.jsonl."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import optax
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nestor.backend import Backend
from nestor.orchestrator.config import Config, ConfigError
from nestor.orchestrator.checkpoint import Checkpointer
from nestor.orchestrator.checkpoint_restore import finalized_steps
from nestor.orchestrator.data.pipeline import DataPipeline, batch_shape
from nestor.orchestrator.errors import RunFailed
from nestor.orchestrator.evaluation.loss import Evaluator
from nestor.orchestrator.health import CALMER, StateHealth
from nestor.orchestrator.metrics import MetricsWriter, Throughput, sharding_table
from nestor.orchestrator.optimizer import schedule_change
from nestor.orchestrator.paths import shown
from nestor.orchestrator.profiler import StepProfiler
from nestor.orchestrator.progress import Console
from nestor.orchestrator.run_lock import RunDirLock
from nestor.orchestrator.runtime import (check_shared_run_dir, preemption_agreed, preemption_is_agreed,
                                  wait_for_every_process)
from nestor.orchestrator.state import StateLayout, init_state, param_table, state_layout
from nestor.orchestrator.step import backend_for, batch_sharding, make_train_step
from nestor.orchestrator.validation import mesh_axes_key
from nestor.parallel.mesh import MeshError, build_mesh
from nestor.parallel.rules import Rules, resolve_rules


def select_devices(config: Config) -> list[jax.Device]:
    """Returns the devices the run uses: `cluster.devices_per_host` of each process's devices.

    A single process standing in for `cluster.hosts` hosts (explain, the
    in-process launcher) takes the devices of all of them. Raises ConfigError
    when a process has fewer devices than asked for.
    """
    wanted = config.cluster.devices_per_host
    if wanted != -1 and jax.process_count() == 1:
        wanted *= config.cluster.hosts
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
        key = mesh_axes_key(config) if error.key == "mesh" else error.key
        raise ConfigError([(key, str(error).split(": ", 1)[1] + " (or change cluster.devices_per_host)")]) from None


@dataclasses.dataclass
class Job:
    """A compiled-to-be training job: mesh, rules, state layout, step function, data, evaluation."""

    config: Config
    mesh: Mesh
    rules: Rules
    backend: Backend
    layout: StateLayout
    step_fn: object
    data: DataPipeline | None  # None when built without data (explain)
    evaluator: Evaluator | None = None  # with eval.every and data only


def build_job(config: Config, devices: list[jax.Device] | None = None, with_data: bool = True) -> Job:
    """Returns the job for `config` on `devices` (default: `select_devices`), nothing compiled yet.

    `with_data=False` leaves the data sources unopened (no file listed, no tokenizer loaded), for a
    job that is only compiled; with data and `eval.every`, the job has its evaluator.
    """
    mesh = make_mesh(config, devices)
    rules = resolve_rules(config.mesh.rules)
    backend = backend_for(config, mesh)
    layout = state_layout(config, mesh, rules)
    step_fn = make_train_step(config, layout, mesh, rules, backend)
    data = DataPipeline(config, batch_sharding(mesh, rules)) if with_data else None
    evaluator = Evaluator(config, layout, mesh, rules) if with_data and config.eval.every else None
    return Job(config, mesh, rules, backend, layout, step_fn, data, evaluator)


class TrainingDiverged(RunFailed):
    """The loss or the parameters became NaN or Inf; the newest checkpoint, if any, is the last good state."""

    headline = "training diverged: "


@dataclasses.dataclass
class TrainResult:
    losses: list[float]      # loss of every step this call ran, in order
    state: dict              # the final train state (sharded)
    history: list[dict]      # the logged records, as in metrics.jsonl
    first_step: int = 0      # the step this call resumed from (0 = fresh start)
    stopped_by: int | None = None  # the signal that ended the run early, if one did


def no_stop_request(now: bool = False) -> None:
    """The `stop_requested` of a run that no launcher can stop: never a signal."""


class StopSignals:
    """While active, SIGTERM and SIGINT only set `received`: the loop saves and stops at the next step
    (a SIGINT after the first signal raises KeyboardInterrupt: Ctrl-C twice stops at once).

    In a multi-host run SIGTERM belongs to jax's preemption sync manager (see
    `preemption_agreed`), so that every process stops after the same step;
    SIGINT is handed to it as a SIGTERM. `requested` (a Ray launcher's
    `stop_requested`) returns a signal sent to the process that launched this
    one, or None: it stops the run as that signal here would have
    (`requested(now=True)` asks at once, where it matters: which signal stopped the run).
    """

    def __init__(self, requested: Callable[..., int | None] = no_stop_request):
        self.received: int | None = None
        self._requested = requested
        self._passed_on = False  # a request handed to the preemption sync manager
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        # Handlers can only be installed from the main thread; elsewhere the caller owns signals.
        if threading.current_thread() is threading.main_thread():
            if preemption_is_agreed():
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._forward)
            else:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the save
        self.received = signum

    @staticmethod
    def _forward(signum, frame) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    def stop_before(self, calls: int) -> bool:
        """Returns whether to stop before this run's `calls`-th step (from 1): a signal came to this
        process, or, in a multi-host run, every process agreed on this step after one got SIGTERM."""
        if self.received is None and not self._passed_on and (requested := self._requested()) is not None:
            self._passed_on = True
            if preemption_is_agreed():
                os.kill(os.getpid(), signal.SIGTERM)  # every process stops after the step they agree on
            elif jax.process_count() == 1:
                self.received = requested
            # else processes that cannot agree on a step go on: one that stopped alone would hang the rest
        if self.received is None and preemption_agreed(calls):
            self.received = self._requested(now=True) or signal.SIGTERM
        return self.received is not None

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class PendingStep(NamedTuple):
    """A dispatched step whose values are not read yet."""
    step: int
    metrics: dict[str, Any]  # on the device until read
    started: float  # time.perf_counter() when the step before it was done
    finished: float | None = None  # when its outputs were known to be ready; None: when they are read


def _to_host(metrics: dict) -> dict:
    return {name: np.asarray(value) for name, value in metrics.items()}


def _check_finite(step: int, values: dict, checkpointer: Checkpointer) -> None:
    for name in ("loss", "param_norm"):
        if name in values and not np.isfinite(values[name]):
            checkpointer.raise_if_failed(wait=True)  # a save in flight is kept (or its failure said) first
            kept = finalized_steps(checkpointer.directory)
            rerun = (f"checkpoint {kept[-1]} holds the last good state, and running again resumes from it" if kept
                     else "no checkpoint is kept, so running again starts from step 0")
            raise TrainingDiverged(f"{name} is {float(values[name])} at step {step}; stopped without saving this "
                                   f"state. {rerun}: {CALMER} first")


def _start_state(config: Config, job: Job, checkpointer: Checkpointer, log) -> tuple[int, dict]:
    """Returns (step, state) to start from: the newest checkpoint that restores, else a fresh state."""
    resumed = checkpointer.restore_latest()
    if resumed is None:
        return 0, init_state(config, job.layout)
    step, state, data_state = resumed
    job.data.restore(data_state, log)
    log(f"resumed from checkpoint {step} in {shown(checkpointer.directory)}")
    if change := schedule_change(checkpointer.saved_config(step), config, step):
        log(change)
    return step, state


def _sharding_text(job: Job) -> str:
    return sharding_table(param_table(job.layout))


def abstract_batch(job: Job) -> jax.ShapeDtypeStruct:
    """Returns the shape, dtype and sharding of one global batch: what the step compiles for, no data read."""
    return jax.ShapeDtypeStruct(batch_shape(job.config), np.int32, sharding=batch_sharding(job.mesh, job.rules))


def _compile(job: Job, state: dict, first_step: int, console: Console) -> tuple[object, float]:
    """Returns the train step compiled for `state` and the batches, and the seconds it took (said too)."""
    console.compiling()
    started = time.perf_counter()
    compiled = job.step_fn.lower(state, abstract_batch(job)).compile()
    seconds = time.perf_counter() - started
    console.compiled(seconds)
    wait_for_every_process(f"step {first_step} compiled")  # the first step's collectives start together
    return compiled, seconds


def train(config: Config, devices: list[jax.Device] | None = None, console: Console | None = None,
          lock: bool = True, stop_requested: Callable[..., int | None] = no_stop_request) -> TrainResult:
    """Trains up to `config.train.steps` steps, resuming from run.dir's newest complete checkpoint.

    Saves every `checkpoint.every` steps, at the end, and on SIGTERM/SIGINT
    (then returns early with `stopped_by` set; in a multi-host run, a SIGTERM
    to any process stops every process after the same step), and when
    `stop_requested()` returns a signal (a Ray launcher's driver got it). Device values
    are read one step late, so logging never waits on the step that is running. Progress
    goes to `console` (default: this terminal). With `lock`, process 0 holds
    run.dir's lock for the run (the Ray launcher holds it in the driver and
    passes False). Returns the losses, final state and logged records. Raises
    ConfigError for configs that do not fit the devices, a checkpoint that
    does not fit the config (run.dir left as it was) or a run.dir another run
    holds; ClusterError when the processes of a multi-host run do not share
    run.dir; TrainingDiverged on a NaN/Inf loss, leaving the last good
    checkpoint newest; CheckpointWriteError as soon as a save fails (disk
    full, read-only run.dir). A state whose loss or parameter norm blew up
    (checkpoint.health_factor) is not saved.
    """
    console = console or Console()
    job = build_job(config, devices)
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    check_shared_run_dir(run_dir)
    with holding_run_dir(run_dir, lock, console.log):
        return _train(config, job, console, stop_requested)


@contextlib.contextmanager
def holding_run_dir(run_dir: Path, lock: bool, log):
    """Holds run.dir's lock on process 0 for the run (nothing without `lock`). In a multi-process run
    every process learns whether process 0 got it, so none goes on alone; raises ConfigError if not."""
    with contextlib.ExitStack() as stack:
        refusal = None
        if lock and jax.process_index() == 0:
            try:
                stack.enter_context(RunDirLock(run_dir, log))
            except ConfigError as error:
                refusal = error
        if lock and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if multihost_utils.broadcast_one_to_all(np.int32(refusal is not None)) and refusal is None:
                whose = "is in use by another run (process 0 says whose)"
                refusal = ConfigError([("run.dir", f"{shown(run_dir)} {whose}")])
        if refusal is not None:
            raise refusal
        yield


def _train(config: Config, job: Job, console: Console, stop_requested: Callable[..., int | None]) -> TrainResult:
    log = console.log
    lead = jax.process_index() == 0
    log(f"mesh {dict(job.mesh.shape)} over {job.mesh.devices.size} {job.mesh.devices.flat[0].platform} devices")
    # Whatever fails, everything opened so far is closed, newest first (async saves are waited for).
    with contextlib.ExitStack() as closing:
        checkpointer = Checkpointer(config, job.layout, log)
        closing.callback(checkpointer.close)
        first_step, state = _start_state(config, job, checkpointer, log)
        result = TrainResult([], state, [], first_step)
        if first_step >= config.train.steps:  # run.dir is left as it was, config.yaml included
            steps = config.train.steps
            reached = " = train.steps" if first_step == steps else f", past train.steps={steps}"
            log(f"nothing to train: the checkpoint in {shown(config.run.dir)} is at step {first_step}{reached}; "
                f"set train.steps above {first_step} to train on")
            return result
        if lead:  # only once the checkpoint is known to fit: a rejected resume leaves run.dir as it was
            (Path(config.run.dir) / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        replicated = NamedSharding(job.mesh, PartitionSpec())  # every process can read the norm
        start_norm = jax.jit(optax.tree.norm, out_shardings=replicated)(state["params"])
        health = StateHealth(config.checkpoint.health_factor, float(start_norm))
        job.step_fn, compile_s = _compile(job, state, first_step, console)
        throughput = Throughput(config, job.mesh.devices.size, job.mesh.devices.flat[0].device_kind)
        writer = MetricsWriter(config, throughput, enabled=lead)
        closing.callback(writer.close)
        writer.start(first_step, _sharding_text(job))
        console.start(config.train.steps, first_step)
        closing.callback(console.close)
        timings = {"compile_s": compile_s}  # one-off times, logged with the next record

        def flush(pending, save=None) -> None:
            """Reads a finished step's values, checks them, runs `save` (the step's checkpoint) and logs."""
            step, metrics, started, finished = pending
            logged = (step % config.train.log_every == 0 or step == config.train.steps or save is not None
                      or "eval_loss" in metrics)
            # Off logging steps, only what every step needs comes to the host.
            values = _to_host(metrics if logged else {name: metrics[name] for name in ("loss", "param_norm")})
            finished_at = time.perf_counter() if finished is None else finished
            _check_finite(step, values, checkpointer)  # before the state goes to disk
            result.losses.append(float(values["loss"]))
            if unhealthy := health.judge(values):
                checkpointer.refused.add(step)
            if save is not None and unhealthy:
                newest = checkpointer.latest_step()
                kept = ("no checkpoint is kept yet" if newest is None
                        else f"the newest checkpoint ({newest}) stays the last good state")
                log(f"checkpoint {step} not saved: {unhealthy}; {kept}")
                timings["checkpoint_skipped"] = 1
            elif save is not None:
                saving = time.perf_counter()
                save()
                timings["checkpoint_s"] = time.perf_counter() - saving
            if logged:
                record = writer.write(step, values, finished_at - started, timings)
                timings.clear()
                result.history.append(record)
                console.step(record)

        profiler = StepProfiler(config, enabled=lead, log=log)
        closing.callback(profiler.stop)
        started = time.perf_counter()
        with StopSignals(stop_requested) as signals:
            result.state, result.stopped_by = _loop(config, job, state, first_step, checkpointer, flush, signals,
                                                    profiler)
    if result.stopped_by is not None:
        everywhere = " on every process" if jax.process_count() > 1 else ""
        log(f"stopped by signal {result.stopped_by} after step {int(result.state['step'])}{everywhere}; "
            "checkpoint saved")
    if result.losses:
        log(f"trained steps {first_step + 1}..{first_step + len(result.losses)} in "
            f"{time.perf_counter() - started:.0f} s: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    return result


def _loop(config: Config, job: Job, state: dict, first_step: int, checkpointer: Checkpointer,
          flush, signals: StopSignals, profiler: StepProfiler) -> tuple[dict, int | None]:
    """Runs the steps; returns (final state, the stop signal or None). Saves only verified states."""
    pending: PendingStep | None = None
    last = time.perf_counter()
    for step in range(first_step, config.train.steps):
        if signals.stop_before(step - first_step + 1):
            break
        checkpointer.raise_if_failed()  # a save that failed in the background stops the run now
        # The trace starts once the previous step (its evaluation included) is done; its start is no step's.
        if (ready := profiler.before(step + 1, (state, pending and pending.metrics))) is not None:
            if pending is not None and pending.finished is None:  # an evaluated step's end is known already
                pending = pending._replace(finished=ready)
            last = time.perf_counter()
        with profiler.annotation(step + 1):
            state, metrics = job.step_fn(state, job.data.batch(step))
        metrics = {**metrics, **job.data.metrics(step)}  # host floats: a mixture's realised shares
        if pending is not None:
            jax.block_until_ready(pending.metrics)
            flush(pending)
            last = time.perf_counter()
        evaluated = None
        if job.evaluator is not None and job.evaluator.due(step + 1):
            # An evaluation is no step's time: the step ends when its outputs are ready, and the evaluation
            # (its first compile included) is eval_s. It runs before the next step donates the state.
            jax.block_until_ready(metrics)
            evaluated = time.perf_counter()
            metrics = {**metrics, **jax.block_until_ready(job.evaluator(state))}
            metrics["eval_s"] = time.perf_counter() - evaluated
        # A step ends when its outputs are ready; the last traced one before its trace is written.
        ready = profiler.after(step + 1, (state, metrics))
        pending = PendingStep(step + 1, metrics, last, ready if evaluated is None else evaluated)
        every = config.checkpoint.every
        if every and (step + 1) % every == 0:
            jax.block_until_ready(metrics)
            flush(pending, save=functools.partial(checkpointer.save, step + 1, state, job.data.state()))
            pending, last = None, time.perf_counter()
    jax.block_until_ready(state)
    final_save = functools.partial(checkpointer.save, int(state["step"]), state, job.data.state(), force=True)
    if pending is None:
        final_save()  # the state is the restored one or already saved: nothing new unless no step ran
    else:
        flush(pending, save=final_save)
    return state, signals.received
