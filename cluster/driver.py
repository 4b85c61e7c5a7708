"""The driver of a run on Ray: `launch` runs a train function on `hosts` Ray workers that form one JAX
program (cluster.group places one worker per host; cluster.worker is each one). The train
function is an argument; this module knows nothing of what it trains.

A group that fails (a worker dies, or raises an error that `final` does not
claim) is started again by this module, so that each restart
is said with its cause (which process, how) and counted against
`max_failures` failures in a row without progress (`progress()` unchanged).
Restarted groups call the train function again from the top, and it is the
function's job to resume from its newest checkpoint. A function that stopped
for a preemption notice (after saving) raises `Preempted` on every worker: the
group then starts again at once, without counting as a failure.

SIGINT or SIGTERM to the driver (Ctrl-C in its terminal) is passed on: the
workers' `stop_requested()` returns the signal, the train function saves and
raises `Stopped`, no group is started again and `launch` returns the signal.
A second one stops the workers at once, without a save (KeyboardInterrupt).

Workers' own output stays in Ray's log files (unless `spec.worker_logs`):
what the user should see, a worker sends to the driver as messages through a
small actor (the mailbox), and the driver hands them to `on_message` in its
main thread, in the order each worker sent them. So the user reads one
stream, without Ray's prefixes, colour codes or the collectives' chatter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from typing import Any, Callable

from nestor.cluster.connect import ClusterSpec, check_capacity, connect, room_for_workers
from nestor.cluster.group import GroupFailed, GroupNotStarted, run_group
from nestor.cluster.interrupts import Interrupted
from nestor.cluster.rendezvous import Board, ClusterError
from nestor.cluster.worker import LastWords, Phase, Worker

@dataclasses.dataclass(frozen=True)
class Restart:
    """A failed worker group started again (`launch`'s `on_restart`)."""

    number: int  # restarts in this launch so far, this one included
    in_a_row: int  # failures since progress() last changed, this one included
    limit: int  # ClusterSpec.max_failures (-1: no limit)
    cause: str  # which process failed and how, one line


@dataclasses.dataclass(frozen=True)
class Recovery:
    """How `launch` treats a failed worker group: `final(error)` says a worker's error no restart can mend
    (raised as a one-line ClusterError); `progress()` returns a value that changes when the run gets further (its newest
    checkpoint), which resets the count of failures in a row; `on_restart` hears each restart.
    `resize(hosts)` returns the train function's argument for a group of fewer workers than
    `ClusterSpec.hosts` (the same run on a smaller mesh), or None where it has none; `on_resize` hears
    each group that starts on another number of workers than the one before."""

    final: Callable[[BaseException], bool] = lambda error: False
    progress: Callable[[], Any] = lambda: None
    on_restart: Callable[[Restart], None] = lambda restart: None
    resize: Callable[[int], Any] = lambda hosts: None  # the train function's argument for fewer hosts, or None
    on_resize: Callable[[int, str, Any], None] = lambda hosts, why, argument: None  # a group of `hosts` workers


def launch(train_fn: Callable[[Any, Callable[[Any], None], Callable[..., int | None]], Any], argument: Any,
           spec: ClusterSpec, on_message: Callable[[Any], None] = lambda message: None,
           on_stop: Callable[[int], None] = lambda signum: None,
           on_phase: Callable[[str], None] = lambda text: None,
           kept_signal: Callable[[], int | None] = lambda: None, recovery: Recovery = Recovery()) -> int | None:
    """Runs `train_fn(argument, send, stop_requested)` on `spec.hosts` workers joined by jax.distributed;
    returns when all finish: None, or the signal the driver was stopped by. `on_phase(text)` hears each
    start-up phase as it ends (Ray up, the worker processes joined), with the seconds since `launch` began.

    `send(message)` (any picklable value) reaches `on_message(message)` in this
    process, in order. A group whose workers raise `Preempted` is started
    again, as often as that happens. A first SIGINT or SIGTERM to this process
    (when it runs `launch` in its main thread) calls `on_stop(signal)` and makes
    every worker's `stop_requested()` return that signal (within STOP_POLL_S;
    `stop_requested(now=True)` asks the driver at once): `train_fn` should save,
    every worker at the same step, and raise `Stopped`; no group is started
    after that, and `launch` returns the signal (None if the workers finished
    first). A second one, or a first one before any group started (`kept_signal()`
    returns one that came before `launch` handled signals), raises Interrupted
    here, and the workers stop without a save; once the
    workers have ended, signals are ignored while Ray shuts down. Connects to `spec.address`, else to the
    cluster of the surrounding Ray job, else starts an embedded local cluster
    (127.0.0.1) and stops it afterwards. Raises ClusterError when the cluster is
    unreachable, too small for the spec (checked before any worker starts),
    or the run fails more than `spec.max_failures` times in a row; a worker's
    config error or ClusterError as itself.
    """
    address = spec.address or os.environ.get("RAY_ADDRESS")
    if not address or address.split("://")[-1].rpartition(":")[0] in ("127.0.0.1", "localhost"):
        # Ray swaps 127.0.0.1 for the machine's routable IP unless told it is a
        # laptop-only cluster; read once when Ray is imported, so set it first.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    started = time.monotonic()
    # ray.init makes SIGTERM exit the process: a signal kept for the run (or a handler not Python's) stays
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    release = connect(spec, on_phase)
    try:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        on_phase(f"Ray is up ({time.monotonic() - started:.0f} s); starting {spec.hosts} worker process(es)")
        return _run_connected(train_fn, argument, spec, on_message, on_stop, on_phase, kept_signal,
                              recovery, started)
    finally:
        release()  # after ray.shutdown: the next command may have a kept head


def _run_connected(train_fn, argument, spec: ClusterSpec, on_message, on_stop, on_phase,
                   kept_signal, recovery: Recovery, started: float) -> int | None:
    """`launch` once connected: runs the groups, and disconnects (ending an embedded cluster of its own)."""
    import ray

    def message(value: Any) -> None:
        if isinstance(value, Phase):
            on_phase(f"{value.text} ({time.monotonic() - started:.0f} s)")
        else:
            on_message(value)

    with _DriverSignals(on_stop, kept_signal) as signals:
        try:
            check_capacity(spec, ray.nodes())
            stopped_by = _fit(train_fn, argument, spec, message, signals, recovery)
            signals.settled = True  # the workers have ended: a Ctrl-C now would only cut Ray's shutdown short
            return stopped_by
        finally:
            # Stops the embedded cluster's raylet and GCS too when this process started them.
            ray.shutdown()


class Mailbox:
    """Messages from workers to the driver (a Ray actor): `put` appends, `take` empties; why the group
    ended early, "preempted" or "stopped" (`ended` says it, `take_ended` reads and clears it); the
    signal the driver was told to stop by (`request_stop` sets it, `stop_request` reads it); and who
    the group's workers are (`joined`; `take_group` reads and clears it)."""

    def __init__(self):
        self.messages: list = []
        self.ended_for: str | None = None
        self.stop_signal: int | None = None
        self.workers: dict[int, Worker] = {}

    def joined(self, rank: int, worker: Worker) -> None:
        self.workers[rank] = worker

    def group(self) -> dict[int, Worker]:
        return dict(self.workers)

    def take_group(self) -> dict[int, Worker]:
        workers, self.workers = self.workers, {}
        return workers

    def put(self, message) -> None:
        self.messages.append(message)

    def take(self) -> list:
        messages, self.messages = self.messages, []
        return messages

    def sync(self) -> None:
        """Returns once every earlier call of the caller has run."""

    def ended(self, reason: str) -> None:
        self.ended_for = reason

    def take_ended(self) -> str | None:
        reason, self.ended_for = self.ended_for, None
        return reason

    def request_stop(self, signum: int) -> None:
        self.stop_signal = signum

    def stop_request(self) -> int | None:
        return self.stop_signal


class _DriverSignals:
    """In the driver's main thread, while active: the first SIGINT or SIGTERM is kept in `received` (or the
    one `kept_signal()` returns on entry), a second raises Interrupted, and once `settled` (the workers have
    ended) they are ignored.
    Elsewhere nothing changes. `pass_on` tells the workers, once."""

    def __init__(self, on_stop: Callable[[int], None], kept_signal: Callable[[], int | None] = lambda: None):
        self.on_stop = on_stop
        self.kept_signal = kept_signal
        self.received: int | None = None
        self.settled = False
        self._passed_on = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_DriverSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        kept = self.kept_signal()  # one that came while Ray started
        if kept is not None and self.received is None:
            self.received = kept
        return self

    def _handle(self, signum, frame) -> None:
        if self.settled:
            return
        if self.received is not None:
            raise Interrupted(signum)
        self.received = signum

    def pass_on(self, mailbox) -> None:
        """Marks a received signal on the workers' mailbox and calls `on_stop` (outside the handler)."""
        import ray

        if self.received is not None and not self._passed_on:
            self._passed_on = True
            ray.get(mailbox.request_stop.remote(self.received))
            self.on_stop(self.received)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class FailuresInARow:
    """Counts failed groups since the run's progress (`Recovery.progress()`) last changed."""

    def __init__(self, progress: Any):
        self.progress, self.count = progress, 0

    def failed(self, progress: Any) -> int:
        """Records a failure, the run's progress as it is now; returns the failures in a row, this one included."""
        self.count = 1 if progress != self.progress else self.count + 1
        self.progress = progress
        return self.count


def _fit(train_fn, argument, spec: ClusterSpec, on_message, signals: _DriverSignals,
         recovery: Recovery) -> int | None:
    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On the driver's node: a lost worker node must not take the run's board and mailbox with it.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    board = ray.remote(num_cpus=0)(Board).options(scheduling_strategy=here).remote(spec.hosts)
    mailbox = ray.remote(num_cpus=0)(Mailbox).options(scheduling_strategy=here).remote()
    restarts, failures = 0, FailuresInARow(recovery.progress())
    group_spec, group_argument = spec, argument
    while True:
        if signals.received is not None:
            raise Interrupted(signals.received)  # a stop before this group started: none starts, nothing new to save
        failure = _fit_group(train_fn, group_argument, group_spec, on_message, board, mailbox, signals,
                             recovery)
        if failure is not None:
            if signals.received is not None:  # told to stop while the group failed: no new group
                raise ClusterError(f"the worker group failed while stopping: {failure}")
            in_a_row = failures.failed(recovery.progress())
            if 0 <= spec.max_failures < in_a_row:
                raise ClusterError(f"the worker group failed {in_a_row} time(s) in a row with no new checkpoint "
                                   f"between them (cluster.max_failures={spec.max_failures}), last: {failure}")
            restarts += 1
            recovery.on_restart(Restart(restarts, in_a_row, spec.max_failures, failure))
        else:
            ended = ray.get(mailbox.take_ended.remote())
            if ended == "stopped":
                return signals.received  # every worker saved the step they agreed on
            if ended != "preempted":
                return None  # else every worker saved the same step after a preemption: a new group resumes it
        room = _hosts_for_next_group(spec, signals)
        if signals.received is not None:
            raise Interrupted(signals.received)  # told to stop while waiting for hosts: no group starts
        if room != group_spec.hosts:
            resized, hosts = _argument_on(room, spec, argument, recovery)
            if hosts != group_spec.hosts:  # else the group runs on the mesh it had
                recovery.on_resize(hosts, f"room for {room} of cluster.hosts={spec.hosts} workers"
                                   + (f" after {spec.restart_timeout_s:g} s" if room < spec.hosts else ""), resized)
                group_spec, group_argument = dataclasses.replace(spec, hosts=hosts), resized


def _argument_on(room: int, spec: ClusterSpec, argument, recovery: Recovery) -> tuple[Any, int]:
    """Returns the train function's argument and the number of workers for a group with room for `room`:
    all of them, else the most, down to `spec.min_hosts`, that the run has a mesh for; ClusterError if none."""
    if room >= spec.hosts:
        return argument, spec.hosts
    for hosts in range(room, (spec.min_hosts or spec.hosts) - 1, -1):
        if (smaller := recovery.resize(hosts)) is not None:
            return smaller, hosts
    raise ClusterError(f"only {room} of cluster.hosts={spec.hosts} hosts have room for a worker after "
                       f"{spec.restart_timeout_s:g} s (cluster.restart_timeout_s), and the run has no mesh with the "
                       f"same global batch on {room} host(s) or fewer down to cluster.min_hosts={spec.min_hosts}")


def _hosts_for_next_group(spec: ClusterSpec, signals: _DriverSignals, poll_s: float = 1.0) -> int:
    """Returns how many workers the next group starts with: `spec.hosts` once the live nodes hold them, else,
    after `spec.restart_timeout_s`, as many as they hold if at least `spec.min_hosts` (ClusterError if not)."""
    import ray

    deadline = time.monotonic() + spec.restart_timeout_s
    while (room := min(room_for_workers(spec, ray.nodes()), spec.hosts)) < spec.hosts:
        if signals.received is not None:
            return room
        if time.monotonic() >= deadline:
            if room < (spec.min_hosts or spec.hosts):
                least = (f"cluster.min_hosts={spec.min_hosts}" if spec.min_hosts
                         else "every host: cluster.min_hosts is unset")
                raise ClusterError(f"only {room} of cluster.hosts={spec.hosts} hosts have room for a worker after "
                                   f"{spec.restart_timeout_s:g} s (cluster.restart_timeout_s); the run needs {least}")
            return room
        time.sleep(poll_s)
    return room


def _fit_group(train_fn, argument, spec: ClusterSpec, on_message, board, mailbox, signals: _DriverSignals,
               recovery: Recovery) -> str | None:
    """Runs one start of the worker group (cluster.group); returns None when it ends, or the cause of its
    failure (one line) when a worker died or raised an error that `recovery.final` does not claim; raises a
    final error as `launch` does."""
    import ray
    from ray import cloudpickle

    ray.get(mailbox.take_group.remote())  # a worker of an earlier group is none of this one's
    # The train function and its argument travel as bytes that a worker loads once its devices are set up and
    # it has joined jax.distributed: loading them imports jax (run_worker).
    work = {"work": cloudpickle.dumps((train_fn, argument)), "spec": spec, "board": board, "mailbox": mailbox}
    words: dict[int, str] = {}

    def deliver() -> None:
        """Passes a stop on, and shows what the workers sent."""
        signals.pass_on(mailbox)
        for message in ray.get(mailbox.take.remote()):
            if not isinstance(message, LastWords):
                on_message(message)
                continue
            if not words:  # the first worker to end itself: the others may be stopped (SIGSTOP)
                _continue_workers(ray.get(mailbox.group.remote()))
            words[message.rank] = message.text

    try:
        run_group(spec, work, between=deliver)
    except GroupFailed as error:
        deliver()
        final = _final_error(error, recovery, words)
        if final is not None:
            raise final from None
        return _failure_cause(error, ray.get(mailbox.take_group.remote()), words)
    except GroupNotStarted as error:
        return f"the worker group could not start: {error}"
    deliver()
    return None


def _cause(failure: BaseException) -> BaseException:
    return getattr(failure, "cause", None) or failure  # Ray wraps the worker's exception in RayTaskError


def _died(failure: BaseException | None) -> bool:
    """Whether a worker's failure is its process's death (Ray saw it end), not an error it raised."""
    return type(_cause(failure)).__name__ in ("ActorDiedError", "ActorUnavailableError")


def _final_error(error, recovery: Recovery, words: dict[int, str]) -> Exception | None:
    """Returns the error to raise for a failed group that no restart can mend, or None: the lowest rank's own
    error when it is a user error of the train function (a ClusterError, or a config error: a ValueError
    listing `problems`), returned as it is, or one `recovery.final` claims (as a one-line ClusterError).
    None whenever a worker died or ended itself (`words`): the others' errors then follow from that."""
    if words or any(_died(failure) for failure in error.worker_failures.values()):
        return None
    rank = min(error.worker_failures)
    cause = _cause(error.worker_failures[rank])
    if isinstance(cause, ClusterError) or (isinstance(cause, ValueError) and hasattr(cause, "problems")):
        return cause
    if recovery.final(cause):
        return ClusterError(f"rank {rank}: {type(cause).__name__}: {_first_line(cause)}")
    return None


def _failure_cause(error, workers: dict[int, Worker], words: dict[int, str]) -> str:
    """Returns which processes of a failed group failed and how, one line: those that ended themselves
    (their last `words`) or died (Ray saw them end) first, then those that raised."""
    died, raised = [], []
    for rank in sorted(set(error.worker_failures) | set(words)):
        worker = workers.get(rank)
        who = f"process {rank} (pid {worker.pid} on {worker.node_ip})" if worker else f"process {rank}"
        cause = _cause(error.worker_failures.get(rank))
        said = f"{_ray_reason(cause)}; its log is in Ray's session logs"
        if rank in words:
            died.append(f"{who} {words[rank]}")
        elif _died(cause) and worker is None:  # its actor never started, or died before it reached the board
            died.append(f"{who} ended before it reported to the driver ({said})")
        elif _died(cause):
            died.append(f"{who} died without a Python error (a signal such as SIGKILL, the kernel's OOM killer, "
                        f"or a crash; {said})")
        else:
            raised.append(f"{who} raised {type(cause).__name__}: {_first_line(cause)}")
    return "; ".join(died + raised)


def _ray_reason(death: BaseException) -> str:
    """Ray's own account of an actor's death, its first sentence: the line under ActorDiedError's header and
    fields ("The actor is dead because its worker process has died"), or ActorUnavailableError's one line."""
    lines = [line.strip() for line in str(death).splitlines() if line.strip() and not line.startswith("\t")]
    lines = [line for line in lines if line != _RAY_DEATH_HEADER]
    return f"Ray: {lines[0].split('. ')[0].rstrip('.')}" if lines else "Ray gave no reason"


_RAY_DEATH_HEADER = "The actor died unexpectedly before finishing this task."  # ActorDiedError.BASE_ERROR_MSG


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _continue_process(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _continue_workers(workers: dict[int, Worker]) -> None:
    """Sends SIGCONT to every worker of the group on a live node, each from a task on its own node (a stopped
    one can then end); waits for none of them: a lost node's task would never run."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    task = ray.remote(num_cpus=0)(_continue_process)
    for worker in workers.values():
        if worker.node_id in alive:
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(worker.node_id, soft=False)).remote(
                worker.pid)
