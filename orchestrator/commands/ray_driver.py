"""Runs a config's training where `cluster.launcher` says: in this process or on Ray workers."""

from __future__ import annotations

import re
import time

from nestor.cluster.connect import ClusterSpec
from nestor.cluster.driver import Recovery, Restart, launch
from nestor.cluster.interrupts import Interrupted, kept_signal
from nestor.cluster.worker import Preempted, Stopped
from nestor.orchestrator.checkpoint.files import checkpoint_dir, finalized_steps
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.errors import ConfigError, RunFailed
from nestor.orchestrator.job.processes import collective_timeout_s
from nestor.orchestrator.commands.first_line import starting_line
from nestor.orchestrator.commands.launch_checks import check_before_launch, check_target_fit
from nestor.orchestrator.commands.user_errors import user_code_error
from nestor.orchestrator.paths import show_relative_to, user_directory
from nestor.orchestrator.loop.console import Console, ForwardingConsole, replay
from nestor.orchestrator.checkpoint.run_lock import RunDirLock
from nestor.orchestrator.loop.signals import stopping_line
from nestor.orchestrator.specs.registry import user_code_paths


def cluster_spec(config: Config) -> ClusterSpec:
    """Returns what the run asks of Ray, from the `cluster.*` keys."""
    c = config.cluster
    return ClusterSpec(hosts=c.hosts, devices_per_host=c.devices_per_host, accelerator=c.accelerator,
                       address=c.address, max_failures=c.max_failures, min_hosts=c.min_hosts,
                       restart_timeout_s=c.restart_timeout_s, init_timeout_s=c.init_timeout_s,
                       tpu_topology=c.tpu_topology, tpu_type=c.tpu_type, dashboard=c.dashboard,
                       worker_logs=c.worker_logs, user_code=user_code_paths(config) if c.address else (),
                       collective_timeout_s=collective_timeout_s(config), keep_head_s=c.keep_head_s)


def config_on_hosts(config: Config, hosts: int) -> Config | None:
    """Returns `config` for `hosts` of its `cluster.hosts` with the same global batch, or None where there is
    none: the data (else fsdp) degree across hosts (else within them, or a data or fsdp degree of -1 that
    takes what is left) divided by cluster.hosts / hosts, and train.grad_accum multiplied by it, so each
    device's micro-batch stays. A TPU slice spans its hosts: there, only whole slices (dcn) go."""
    factor, rest = divmod(config.cluster.hosts, hosts)
    if rest or hosts < 1:
        return None
    updates = {"cluster.hosts": hosts, "train.grad_accum": config.train.grad_accum * factor}
    dcn, ici = config.mesh.dcn_shape(), config.mesh.ici_shape()
    across = [axis for axis in ("data", "fsdp") if dcn[axis] % factor == 0]
    within = [axis for axis in ("data", "fsdp") if ici[axis] != -1 and ici[axis] % factor == 0]
    if across:
        updates[f"mesh.dcn.{across[0]}"] = dcn[across[0]] // factor
    elif config.cluster.accelerator == "tpu":
        return None
    elif -1 in ici.values():  # the -1 axis takes what is left: it must be a batch axis
        if [axis for axis, size in ici.items() if size == -1][0] not in ("data", "fsdp"):
            return None
    elif within:
        updates[f"mesh.{within[0]}"] = ici[within[0]] // factor
    else:
        return None
    try:
        return config.replace(**updates)
    except ValueError:  # a ConfigError: e.g. the global batch does not split over the smaller mesh
        return None


def train_on_worker(job: tuple[Config, str], send, stop_requested) -> None:
    """The function each Ray worker runs once jax.distributed is up: the ordinary train loop of
    `job` = (config, the directory the user ran nestor in).

    Process 0 speaks for the run: its console calls travel to the driver
    through `send`, paths in them shown as the driver would show them (Ray
    runs workers in a directory of its own); the other processes say
    nothing. Raises Preempted when every process stopped after the same step
    for a SIGTERM and saved it; Stopped when they stopped so because the
    driver was told to (`stop_requested`).
    """
    import jax

    from nestor.orchestrator.job.processes import enable_compile_cache
    from nestor.orchestrator.loop.train import train

    config, directory = job
    show_relative_to(directory)
    enable_compile_cache(config)
    console = ForwardingConsole(send) if jax.process_index() == 0 else Console.silent()
    # The driver holds run.dir's lock (train_on_ray).
    try:
        result = train(config, console=console, lock=False, stop_requested=stop_requested)
    except ConfigError:
        raise  # nestor's own, naming its key (also one raised under the user's frames), as the CLI shows it
    except Exception as error:  # the user's code's: a config error with its frames, which the driver shows
        if (converted := user_code_error(config, error)) is None:
            raise
        raise converted from None
    if result.stopped_by is None:
        return
    if stop_requested(now=True) is not None:
        raise Stopped(f"signal {result.stopped_by}")
    console.log(f"preempted: the worker group starts again from step {int(result.state['step'])}")
    raise Preempted(f"signal {result.stopped_by}")


RESTART_LINE = re.compile(r"^restart \d+: ")  # how the driver's log says each restart (`restart_lines`)
_BACK = "back at step "  # and the run's return after it


def restart_lines(log: str) -> list[str]:
    """Returns the lines of a driver's log that say a restart, and the run's return after each."""
    return [line for line in log.splitlines() if RESTART_LINE.match(line) or line.startswith(_BACK)]


class _Restarts:
    """The driver's view of the run for restarts: the newest step process 0 logged, the steps it logged a save
    of (and when each reached the driver), and the newest complete checkpoint on disk; says each restart
    with the steps and time it lost, and how long the run took to get back."""

    def __init__(self, config: Config, console: Console):
        self.config, self.console = config, console
        self.last_logged = 0
        self.saves: dict[int, float] = {}  # step -> time.monotonic() its record (a save's) reached the driver
        self.failed_at: float | None = None  # when the newest restart was decided, until a step is logged again

    def replay(self, message: tuple) -> None:
        if message[0] == "step":
            record, now = message[1][0], time.monotonic()
            self.last_logged = record["step"]
            if "checkpoint_s" in record:
                self.saves[record["step"]] = now
            if self.failed_at is not None:
                self.console.log(f"{_BACK}{record['step']} {now - self.failed_at:.0f} s after the failure")
                self.failed_at = None
        replay(self.console, message)

    def newest_checkpoint(self) -> int:
        """The newest complete checkpoint in run.dir, else (a driver that does not see the workers' run.dir)
        the newest step process 0 logged a save of."""
        steps = finalized_steps(checkpoint_dir(self.config.run.dir))
        return steps[-1] if steps else max(self.saves, default=0)

    def restart(self, restart: Restart) -> None:
        saved, self.failed_at = self.newest_checkpoint(), time.monotonic()
        steps = (f"steps {saved + 1}-{self.last_logged} logged, maybe more" if self.last_logged > saved
                 else f"any step after {saved}")
        since = self.saves.get(saved)
        work = f", {self.failed_at - since:.0f} s of training" if since is not None else ""
        limit = f"at most {restart.limit}" if restart.limit >= 0 else "no limit"
        self.console.log(f"restart {restart.number}: {restart.cause}; lost: {steps}{work}; the new worker group "
                         f"resumes from {f'checkpoint {saved}' if saved else 'the start'} (failure "
                         f"{restart.in_a_row} in a row with no new checkpoint; cluster.max_failures: {limit})")
        self.last_logged = saved
        self.saves = {step: at for step, at in self.saves.items() if step <= saved}


def train_on_ray(config: Config, console: Console, said: str | None = None) -> int | None:
    """Trains `config` on `cluster.hosts` Ray workers, showing process 0's progress on `console` (after `said`,
    the line the CLI printed already); returns when they finish: None, or the signal that stopped this process (the driver), once the
    workers saved the step they reached (a second signal stops them at once: KeyboardInterrupt).

    Raises cluster.rendezvous.ClusterError (unreachable cluster, too few devices,
    a rank that never joins, more than `cluster.max_failures` failed worker
    groups in a row with no new checkpoint between them) and the workers'
    own config errors; ConfigError when another run holds run.dir, and for a step the target's compiler,
    where installed here, finds larger than a device's memory (launch_checks.check_target_fit).
    The lock is held here, in the driver, for the whole run: it outlives
    worker-group restarts, and a refused run never starts Ray.
    """
    c = config.cluster
    line = starting_line(c.hosts, c.devices_per_host, c.accelerator, c.address)
    if line != said:  # the CLI says it before the config's checks where it can (first_line)
        console.log(line)
    check_before_launch(config)  # one line in seconds, before Ray starts and before anything is written
    check_target_fit(config, console.log)  # where the target's compiler is installed here: its memory analysis
    try:
        with RunDirLock(config.run.dir, console.log):
            if (signum := kept_signal()) is not None:  # before Ray starts: stop now, nothing to save
                raise Interrupted(signum)
            restarts = _Restarts(config, console)
            directory = str(user_directory())

            def resize(hosts: int):
                smaller = config_on_hosts(config, hosts)
                return None if smaller is None else (smaller, directory)

            def resized(hosts: int, why: str, argument) -> None:
                c = argument[0]
                console.log(f"the worker group starts on {hosts} host(s) ({why}): " + (
                    "the configured mesh" if hosts == config.cluster.hosts else
                    f"mesh.dcn {c.mesh.dcn_shape()}, mesh {c.mesh.ici_shape()}, train.grad_accum="
                    f"{c.train.grad_accum}, the same global batch of {c.train.global_batch}"))

            # a run's own failure (diverged, a save that failed) would fail again the same way
            recovery = Recovery(final=lambda error: isinstance(error, RunFailed), progress=restarts.newest_checkpoint,
                                on_restart=restarts.restart, resize=resize, on_resize=resized)
            return launch(train_on_worker, (config, directory), cluster_spec(config), on_message=restarts.replay,
                          on_stop=lambda signum: console.log(stopping_line(signum, workers=True)), on_phase=console.log,
                          kept_signal=kept_signal, recovery=recovery)
    finally:
        console.close()
