"""One worker of a run's group (`run_worker`, in a cluster.group actor): on CPU it simulates its devices;
it joins jax.distributed through `rendezvous` (on CPU too: this is what lets a laptop run real multi-host),
then calls the train function; and what workers and the driver say to each other through
the driver's mailbox: phases, last words, the ends `Preempted` and `Stopped`, stop requests (`_StopWatch`)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import pickle
import threading
import time

from nestor.cluster.connect import ClusterSpec
from nestor.cluster.cpu_devices import share_compiled_programs, simulate_cpu_devices
from nestor.cluster.rendezvous import ClusterError, rendezvous

STOP_POLL_S = 0.5  # how often a worker asks the driver whether it was told to stop
ANSWER_TIMEOUT_MS = 120_000  # how long a worker waits for process 0's word on where the workers run


class Preempted(Exception):
    """Raised by a train function on every worker once the group saved its state after a preemption
    notice; `launch` starts the group again, and it resumes from that state."""


class Stopped(Exception):
    """Raised by a train function on every worker once the group saved its state for a stop the driver
    was told (`stop_requested`); `launch` returns the driver's signal."""


@dataclasses.dataclass(frozen=True)
class Phase:
    """A start-up phase a worker reports to the driver (`launch`'s `on_phase`), apart from the run's messages."""

    text: str


@dataclasses.dataclass(frozen=True)
class Worker:
    """A worker process of the group, as it reported itself when it started."""

    pid: int
    node_ip: str
    node_id: str


@dataclasses.dataclass(frozen=True)
class LastWords:
    """What a worker says just before it ends itself (`last_words`): the cause of the group's failure."""

    rank: int
    text: str


class _BoardClient:
    """Calls a Board actor as if it were local, for `rendezvous`."""

    def __init__(self, handle):
        self.handle = handle

    def arrive(self, group, rank, address):
        import ray
        return ray.get(self.handle.arrive.remote(group, rank, address))

    def state(self, group):
        import ray
        return ray.get(self.handle.state.remote(group))


_LAST_WORDS = None  # in a Ray worker: (the mailbox, this worker's rank)


LAST_WORDS_TIMEOUT_S = 10


def last_words(text: str) -> None:
    """In a Ray worker about to end itself: tells the driver why (the cause its restart line gives), and
    has it continue the group's stopped workers (SIGCONT) so that they can end too. Elsewhere nothing."""
    if _LAST_WORDS is None:
        return
    import ray

    mailbox, rank = _LAST_WORDS
    ray.get(mailbox.put.remote(LastWords(rank, text)), timeout=LAST_WORDS_TIMEOUT_S)


def run_worker(config: dict, rank: int, world: int) -> None:
    """Process `rank` of `world` in a worker group (cluster.group): on CPU simulates its devices; joins
    jax.distributed; then trains. Raises ClusterError when a rank never joins, and the train function's
    errors as they are."""
    import ray

    spec: ClusterSpec = config["spec"]
    global _LAST_WORDS
    _LAST_WORDS = (config["mailbox"], rank)
    host = ray.util.get_node_ip_address()
    config["mailbox"].joined.remote(rank, Worker(os.getpid(), host, ray.get_runtime_context().get_node_id()))
    # Ray sets Python logging to INFO in its workers: keep Orbax's and JAX's INFO lines out of the run's output.
    for name in ("absl", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Every start of the worker group (first or restart) gets its own placement group.
    group = ray.util.get_current_placement_group()
    if group is None:
        raise ClusterError("a worker of the group runs outside a placement group; cannot tell restarts apart")
    address = rendezvous(_BoardClient(config["board"]), group.id.hex(), rank, world, host, spec.init_timeout_s)
    if spec.accelerator != "cpu":  # a platform jax must find, not fall back from to the CPU
        os.environ.setdefault("JAX_PLATFORMS", "cuda" if spec.accelerator == "gpu" else "tpu")
    slices, per_slice = config["tpu_slices"]  # (slices, hosts per slice), cluster.group's
    if slices > 1:  # libtpu joins the slices over the data-center network, read when jax starts
        from ray.util.tpu import get_tpu_coordinator_env_vars

        os.environ.update(get_tpu_coordinator_env_vars(address.rpartition(":")[0], slices, rank // per_slice))
    import jax

    if spec.accelerator == "cpu":
        simulate_cpu_devices(jax, spec.devices_per_host, spec.collective_timeout_s)
    # Bind the coordinator to the node's Ray address, not every interface.
    # A stopped process misses its heartbeats too: past jax's 100 s its peers were ended before the hang
    # watchdog's limit (a process that dies is Ray's to notice, at once)
    patience = {"heartbeat_timeout_seconds": max(100, spec.collective_timeout_s or 0)}
    if "heartbeat_timeout_seconds" not in inspect.signature(jax.distributed.initialize).parameters:
        patience = {}  # a jax without the setting: its own
    jax.distributed.initialize(address, num_processes=world, process_id=rank, coordinator_bind_address=address,
                               initialization_timeout=max(int(spec.init_timeout_s), 1), **patience)
    if spec.accelerator == "cpu" and _on_one_machine(jax, group):
        share_compiled_programs(jax)  # process 0 compiles for all

    if jax.process_index() == 0:
        config["mailbox"].put.remote(Phase(f"{jax.process_count()} worker process(es) joined jax.distributed, "
                                           f"{jax.device_count()} devices"))
    train_fn, argument = pickle.loads(config["work"])  # the driver's (driver._fit_group)
    mailbox = config["mailbox"]
    stop = _StopWatch(mailbox)
    try:
        train_fn(argument, mailbox.put.remote, stop.requested)
    except Preempted:
        mailbox.ended.remote("preempted")  # a clean end of the worker; the driver starts the next group
    except Stopped:
        mailbox.ended.remote("stopped")  # a clean end of the worker; the driver starts none
    finally:  # an actor runs one caller's calls in order: every message has landed, an error's too
        ray.get(mailbox.sync.remote())


def _on_one_machine(jax, group) -> bool:
    """Whether the worker group's placement `group` put every worker on one machine (Ray nodes started on one
    machine, as a test's, share its address), as process 0 sees it: every process takes its word through
    jax.distributed's key-value store, so that none waits for a binary process 0 does not share."""
    import ray
    from jax._src import distributed  # no public API has the coordination service's key-value store

    key = "nestor: the workers run on one machine"
    if jax.process_index() == 0:
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        bundles = ray.util.placement_group_table(group)["bundles_to_node_id"].values()
        distributed.global_state.client.key_value_set(key, str(len({addresses.get(node, node) for node in bundles})))
    return distributed.global_state.client.blocking_key_value_get(key, ANSWER_TIMEOUT_MS) == "1"


class _StopWatch:
    """In a worker: asks the driver's mailbox every STOP_POLL_S, in a thread, whether the driver was told to
    stop; `requested()` returns the signal it was told by, or None (`requested(now=True)` asks at once:
    workers poll at their own moments, and one may stop for a request before its own poll saw it)."""

    def __init__(self, mailbox):
        self._mailbox = mailbox
        self._signal: int | None = None
        threading.Thread(target=self._watch, name="nestor-stop-watch", daemon=True).start()

    def _watch(self) -> None:
        import ray

        while self._signal is None:
            try:
                self._signal = ray.get(self._mailbox.stop_request.remote())
            except Exception:  # the driver is gone: Ray ends this worker anyway
                return
            time.sleep(STOP_POLL_S)

    def requested(self, now: bool = False) -> int | None:
        if now and self._signal is None:
            import ray

            self._signal = ray.get(self._mailbox.stop_request.remote())
        return self._signal
