"""The training loop: a job (orchestrator.job.build) -> sharded state -> steps -> checkpoints, metrics.jsonl."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import signal
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import optax
import yaml
from jax.sharding import NamedSharding, PartitionSpec

from nestor.cluster.interrupts import Interrupted
from nestor.cluster.worker import last_words
from nestor.orchestrator.checkpoint.owner import Checkpointer
from nestor.orchestrator.checkpoint.files import finalized_steps
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.errors import RunFailed
from nestor.orchestrator.loop.goodput import Goodput
from nestor.orchestrator.loop.hang import HangWatchdog, xla_cpu_patience
from nestor.orchestrator.loop.health import CALMER, StateHealth, best_of
from nestor.orchestrator.hf.load import keep_source_files
from nestor.orchestrator.job.build import Job, abstract_batch, build_job, traced_use, unsplit_rows_warning
from nestor.orchestrator.loop.metrics import MetricsWriter, Throughput, sharding_table
from nestor.orchestrator.job.optimizer import schedule_change
from nestor.orchestrator.paths import shown
from nestor.orchestrator.loop.profiler import StepProfiler
from nestor.orchestrator.loop.console import Console
from nestor.orchestrator.checkpoint.run_lock import claim_run_dir, holding_run_dir
from nestor.orchestrator.job.processes import check_shared_run_dir, every_process_says, wait_for_every_process
from nestor.orchestrator.loop.signals import StopSignals, no_stop_request, stopping_line
from nestor.orchestrator.job.state import init_state, layout_warnings, param_table
from nestor.orchestrator.specs.registry import spec_of


class TrainingDiverged(RunFailed):
    """The loss or the parameters became NaN or Inf, or blew up against the run's best (orchestrator.loop.health);
    the newest checkpoint, if any, is the last good state."""

    headline = "training diverged: "


@dataclasses.dataclass
class TrainResult:
    losses: list[float]      # loss of every step this call ran, in order
    state: dict              # the final train state (sharded)
    history: list[dict]      # the logged records, as in metrics.jsonl
    first_step: int = 0      # the step this call resumed from (0 = fresh start)
    stopped_by: int | None = None  # the signal that ended the run early, if one did


class PendingStep(NamedTuple):
    """A dispatched step whose values are not read yet."""
    step: int
    metrics: dict[str, Any]  # on the device until read
    started: float  # time.perf_counter() when the step before it was done
    finished: float | None = None  # when its outputs were known to be ready; None: when they are read


def _to_host(metrics: dict) -> dict:
    return {name: np.asarray(value) for name, value in metrics.items()}


def _diverged(what: str, checkpointer: Checkpointer, broken: int | None) -> TrainingDiverged:
    """Returns the error that stops a run whose state became `what`: saves in flight are finished, checkpoint
    `broken` (a restored one whose first loss says it is broken) and those saved since are moved aside, and
    the message names the newest checkpoint left, the last good state."""
    checkpointer.raise_if_failed(wait=True)  # a save in flight is kept (or its failure said) first
    if broken is not None:
        checkpointer.set_aside([step for step in finalized_steps(checkpointer.directory) if step >= broken],
                               "broken (the first loss after restoring it was not finite or blew up)")
    kept = finalized_steps(checkpointer.directory)
    rerun = (f"checkpoint {kept[-1]} holds the last good state, and running again resumes from it" if kept
             else "no checkpoint is kept, so running again starts from step 0")
    return TrainingDiverged(f"{what}; stopped without saving this state. {rerun}: {CALMER} first")


@dataclasses.dataclass
class StepRecorder:
    """Takes each finished step, one step late: reads its values to the host, checks the state's health
    (before it goes to disk), runs its save and logs its record. `timings` holds one-off times (the
    compile's, a save's), logged with the next record."""

    config: Config
    checkpointer: Checkpointer
    health: StateHealth
    restored: tuple[int, dict] | None  # (step, its record) the run resumed from
    first_step: int
    watchdog: HangWatchdog
    goodput: Goodput
    writer: MetricsWriter
    console: Console
    result: TrainResult
    timings: dict[str, float]
    signals: StopSignals

    def __call__(self, pending: PendingStep, save: Callable[..., Any] | None = None) -> None:
        """Reads `pending`'s values, checks them, runs `save` (the step's checkpoint) and logs."""
        step, metrics, started, finished = pending
        logged = (step % self.config.train.log_every == 0 or step == self.config.train.steps or save is not None
                  or "eval_loss" in metrics)
        # Off logging steps, only what every step needs comes to the host.
        values = _to_host(metrics if logged else {name: metrics[name] for name in ("loss", "param_norm")})
        self.watchdog.beat(f"step {step + 1}", step_done=True)
        finished_at = time.perf_counter() if finished is None else finished
        self._check_health(step, values)
        self.result.losses.append(float(values["loss"]))
        # A second Ctrl-C stops a save at once and never leaves a saved step unlogged: a save it cut logs its
        # step first (a resume drops records past the checkpoint it restores), and after a save it waits for the log.
        with self.signals.deferred():
            if save is not None:
                saving = time.perf_counter()
                self.watchdog.beat(f"the save of checkpoint {step}")
                try:
                    with self.goodput.charged("checkpoint_save"), self.signals.cuttable():
                        save(health=self.health.record())
                except Interrupted:
                    self._log(step, values, finished_at - started)
                    raise
                self.watchdog.beat(f"step {step + 1}")
                self.timings["checkpoint_s"] = time.perf_counter() - saving
            if logged:
                self._log(step, values, finished_at - started)

    def _log(self, step: int, values: dict, seconds: float) -> None:
        record = self.writer.write(step, values, seconds, {**self.timings, **self.goodput.log(step)})
        self.timings.clear()
        self.result.history.append(record)
        self.console.step(record)

    def _check_health(self, step: int, values: dict) -> None:
        """Raises TrainingDiverged when the state of `step` is not finite or blew up (health.StateHealth)."""
        broken = None
        if self.restored is not None and step == self.first_step + 1:  # its loss is the restored parameters'
            if self.health.restored_state_is_broken(float(values["loss"])):
                broken = self.restored[0]
        imported = self.config.model.init_from
        if imported and self.restored is None and step == 1 and not np.isfinite(values["loss"]):
            raise TrainingDiverged(f"loss is {float(values['loss'])} at step 1, computed on the weights of "
                                   f"{shown(imported)} before any update (no learning rate is to blame): its values "
                                   "make the model's loss overflow; check model.init_from (model.dtype "
                                   f"{self.config.model.dtype}) before training from it")
        for name in ("loss", "param_norm"):
            if not np.isfinite(values[name]):
                raise _diverged(f"{name} is {float(values[name])} at step {step}", self.checkpointer, broken)
        if unhealthy := self.health.judge(step, values):
            raise _diverged(f"the state of step {step} blew up: {unhealthy}", self.checkpointer, broken)


def _start_state(config: Config, job: Job, checkpointer: Checkpointer, log,
                 watchdog: HangWatchdog) -> tuple[int, dict]:
    """Returns (step, state) to start from: the newest checkpoint that restores, else a fresh state (step 0;
    its init compiles, unwatched)."""
    if kept := finalized_steps(checkpointer.directory):
        log(f"restoring checkpoint {kept[-1]} from {shown(checkpointer.directory)}")
    resumed = checkpointer.restore_latest()
    if resumed is None:
        if config.model.init_from:
            log(f"starting from the weights of {shown(config.model.init_from)}")
            keep_source_files(config)
        with watchdog.paused():
            return 0, init_state(config, job.layout)
    step, state, data_state = resumed
    job.data.restore(data_state, log)
    log(f"resumed from checkpoint {step} in {shown(checkpointer.directory)}")
    if change := schedule_change(checkpointer.saved_config(step), config, step):
        log(change)
    return step, state


def _watchdog(config: Config, platform: str) -> HangWatchdog:
    """Starts this process's hang watchdog (of a run on `platform`'s devices), waiting for the start state; its
    hang directory is named by process 0's clock at this moment (a name no earlier attempt took), the same for
    every process."""
    hangs, name = Path(config.run.dir) / "hangs", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    suffixes = (f"{name}-{n}" for n in itertools.count(2))
    while (hangs / name).exists():  # an earlier attempt's (a clock set back): peers would take it for this one's
        name = next(suffixes)
    started = every_process_says("attempt started", name)[0]
    watchdog = HangWatchdog(config.run.hang_timeout_s, hangs / started, jax.process_index(), jax.process_count(),
                            last_words=last_words, preamble=xla_cpu_patience(platform))
    watchdog.beat("the start state (a restore or a fresh init)")
    return watchdog


def _norm(job: Job, state: dict) -> float:
    """Returns the norm of `state`'s parameters (replicated: every process reads it)."""
    replicated = NamedSharding(job.mesh, PartitionSpec())
    return float(jax.jit(optax.tree.norm, out_shardings=replicated)(state["params"]))


def _mesh_text(job: Job) -> str:
    """Returns the mesh as metrics.jsonl names it: its axes past 1, and the processes it spans."""
    axes = " x ".join(f"{axis} {size}" for axis, size in job.mesh.shape.items() if size > 1) or "one device"
    return f"{axes} over {jax.process_count()} process(es)"


def _sharding_text(job: Job) -> str:
    return sharding_table(param_table(job.layout))


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
    run.dir; TrainingDiverged on a NaN/Inf loss or parameter norm, or a
    state whose loss or parameter norm blew up against the run's best
    (checkpoint.health_factor), before it is saved, leaving the last good
    checkpoint newest; CheckpointWriteError as soon as a save fails (disk
    full, read-only run.dir). Process 0 accounts for every second of the
    call in run.dir/goodput.jsonl (orchestrator.loop.goodput) and says the run's goodput at the end.
    """
    goodput = Goodput()  # from here, every second of this attempt is charged to a goodput category
    console = console or Console()

    def acknowledge(signum: int, calls: int) -> None:  # before the first step, the closing line says it
        if calls > 1:
            console.log(stopping_line(signum))

    # From the start: a signal during start-up or the compile stops the run before its first step.
    with StopSignals(stop_requested, on_signal=acknowledge) as signals:
        job = build_job(config, devices)
        run_dir = Path(config.run.dir)
        if lock and jax.process_index() == 0:
            claim_run_dir(run_dir)  # before anything is made in it: a file or a directory of the user's is refused
        run_dir.mkdir(parents=True, exist_ok=True)
        check_shared_run_dir(run_dir)
        with holding_run_dir(run_dir, lock, console.log), goodput.ending_on_error():
            result = _train(config, job, console, signals, goodput)
            # a stop its launcher's driver was told (`nestor stop`, a Ctrl-C there) is the user's, not a preemption
            by_launcher = result.stopped_by is not None and stop_requested(now=True) is not None
            if summary := goodput.end(result.stopped_by, by_launcher):
                console.log(summary)
            return result


def _train(config: Config, job: Job, console: Console, signals: StopSignals, goodput: Goodput) -> TrainResult:
    log = console.log
    lead = jax.process_index() == 0
    platform = job.mesh.devices.flat[0].platform
    log(f"mesh {dict(job.mesh.shape)} over {job.mesh.devices.size} {platform} devices")
    for warning in layout_warnings(job.layout, job.rules) if lead else ():
        log(warning)
    # Whatever fails, everything opened so far is closed, newest first (async saves are waited for).
    with contextlib.ExitStack() as closing:
        watchdog = _watchdog(config, platform)
        closing.callback(watchdog.close)
        checkpointer = Checkpointer(config, job.layout, log)
        watchdog.before_exit = checkpointer.abandon_unfinished  # a hang in a save leaves no temporary directory
        closing.callback(goodput.charged("checkpoint_save")(checkpointer.close))  # it waits for saves in flight
        with goodput.charged("restore"):
            first_step, state = _start_state(config, job, checkpointer, log, watchdog)
        result = TrainResult([], state, [], first_step)
        if first_step >= config.train.steps:  # run.dir is left as it was, config.yaml included
            steps = config.train.steps
            reached = " = train.steps" if first_step == steps else f", past train.steps={steps}"
            log(f"nothing to train: the checkpoint in {shown(config.run.dir)} is at step {first_step}{reached}; "
                f"set train.steps above {first_step} to train on")
            return result
        if lead:  # only once the checkpoint is known to fit: a rejected resume leaves run.dir as it was
            (Path(config.run.dir) / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        goodput.start(Path(config.run.dir), first_step, enabled=lead, log=log)
        restored = (first_step, checkpointer.record(first_step)) if first_step else None
        best = best_of(restored and restored[1].get("health"))
        with watchdog.paused():  # the norm compiles a program of its own
            health = StateHealth(config.checkpoint.health_factor, best, None if best else _norm(job, state))
        with goodput.charged("compile"), watchdog.paused():
            job.step_fn, compile_s = _compile(job, state, first_step, console)
            if lead and job.mesh.shape["context"] > 1 and not spec_of(config).splits_rows and \
                    (warning := unsplit_rows_warning(job, traced_use(job)[1])):  # one more trace: a model of yours
                log(warning)
        watchdog.beat(f"step {first_step + 1}")
        throughput = Throughput(config, job.mesh.devices.size, job.mesh.devices.flat[0].device_kind)
        writer = MetricsWriter(config, throughput, enabled=lead, log=log)
        closing.callback(writer.close)
        writer.start(first_step, _sharding_text(job), _mesh_text(job))
        console.start(config.train.steps, first_step)
        closing.callback(console.close)
        recorder = StepRecorder(config, checkpointer, health, restored, first_step, watchdog, goodput, writer,
                                console, result, timings={"compile_s": compile_s}, signals=signals)
        profiler = StepProfiler(config, enabled=lead, log=log)
        closing.callback(profiler.stop)
        started = time.perf_counter()
        result.state, result.stopped_by = _loop(config, job, state, first_step, checkpointer, recorder, signals,
                                                profiler, goodput, watchdog)
        watchdog.beat("the last saves to finish")  # closing waits for them
    if result.stopped_by is not None:
        everywhere = " on every process" if jax.process_count() > 1 else ""
        name = signal.Signals(result.stopped_by).name
        log(f"stopped by {name} after step {int(result.state['step'])}{everywhere}; checkpoint saved"
            if result.losses else f"stopped by {name} before the first step{everywhere}: nothing trained or saved")
    if result.losses:
        log(f"trained steps {first_step + 1}..{first_step + len(result.losses)} in "
            f"{time.perf_counter() - started:.0f} s: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    return result


def _loop(config: Config, job: Job, state: dict, first_step: int, checkpointer: Checkpointer,
          flush: StepRecorder, signals: StopSignals, profiler: StepProfiler, goodput: Goodput,
          watchdog: HangWatchdog) -> tuple[dict, int | None]:
    """Runs the steps; returns (final state, the stop signal or None). Saves only verified states. The host's
    time making batches, in steps (dispatching them, waiting on their outputs) and evaluating is charged to
    `goodput`'s data_wait, step and eval; a save's, to checkpoint_save (in `flush`, the run's StepRecorder)."""
    def wait_for(outputs) -> None:  # waiting on a step's outputs is that step's time
        with goodput.charged("step"):
            jax.block_until_ready(outputs)

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
        with goodput.charged("data_wait"):
            batch = job.data.batch(step)
        with profiler.annotation(step + 1), goodput.charged("step"):
            state, metrics = job.step_fn(state, batch)
        metrics = {**metrics, **job.data.metrics(step)}  # host floats: a mixture's realised shares
        if pending is not None:
            wait_for(pending.metrics)
            flush(pending)
            last = time.perf_counter()
        evaluated = None
        if job.evaluator is not None and job.evaluator.due(step + 1):
            # An evaluation is no step's time: the step ends when its outputs are ready, and the evaluation
            # (its first compile included) is eval_s. It runs before the next step donates the state.
            wait_for(metrics)
            evaluated = time.perf_counter()
            with goodput.charged("eval"), watchdog.paused():
                metrics = {**metrics, **jax.block_until_ready(job.evaluator(state))}
            metrics["eval_s"] = time.perf_counter() - evaluated
        # A step ends when its outputs are ready; the last traced one before its trace is written.
        ready = profiler.after(step + 1, (state, metrics))
        pending = PendingStep(step + 1, metrics, last, ready if evaluated is None else evaluated)
        every = config.checkpoint.every
        if every and (step + 1) % every == 0:
            wait_for(metrics)
            flush(pending, save=functools.partial(checkpointer.save, step + 1, state, job.data.state()))
            pending, last = None, time.perf_counter()
    wait_for(state)
    final_save = functools.partial(checkpointer.save, int(state["step"]), state, job.data.state(), force=True)
    if pending is None:
        if int(state["step"]) > first_step:
            with goodput.charged("checkpoint_save"):
                final_save()  # saved already, unless the steps since the last save were none of checkpoint.every's
    else:
        flush(pending, save=final_save)
    return state, signals.received
