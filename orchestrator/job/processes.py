"""Setting up this process's JAX for a run: platform, simulated devices, compilation cache."""

from __future__ import annotations

import itertools
import secrets
import socket
from pathlib import Path

from nestor.cluster.cpu_devices import simulate_cpu_devices
from nestor.cluster.rendezvous import ClusterError
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.paths import shown

_HOSTNAME_BYTES = 64  # a host's name as it travels in the run.dir check


def configure_jax(config: Config) -> None:
    """Points this single process's jax at the configured platform and turns the compilation cache on.

    On CPU it simulates the devices of all `cluster.hosts` hosts, so the mesh
    has the shape it will have on the cluster. Must run before jax creates
    its backends (the first device query); call it before `build_job` or
    `restore_state` in a script of your own.
    """
    import jax

    if config.cluster.accelerator == "cpu":
        simulate_cpu_devices(jax, config.cluster.hosts * config.cluster.devices_per_host, collective_timeout_s(config))
    enable_compile_cache(config)


# How long past run.hang_timeout_s XLA:CPU may let a collective wait: the watchdog's stacks, native ones
# included, take a few minutes at worst (loop/hang.py).
WATCHDOG_MARGIN_S = 600
# One value for every limit up to a day (the automatic limit grows with the steps): XLA_FLAGS are part of
# jax's compilation-cache key, so a resume with another limit still loads its programs.
AUTO_LIMIT_COLLECTIVE_S = 86_400
INT32_MAX = 2**31 - 1  # XLA's flags are int32


def collective_timeout_s(config: Config) -> int | None:
    """Returns the least XLA:CPU collective timeout for the run: past `run.hang_timeout_s`, so that a collective
    that never completes (a stopped peer, a deadlock) is reported by the hang watchdog with every thread's stacks
    rather than ended by XLA at 40 s with "Aborted"; None (XLA's own) where the watchdog is off (0)."""
    limit = config.run.hang_timeout_s
    if limit == 0:
        return None
    return min(max(AUTO_LIMIT_COLLECTIVE_S, int(limit or 0) + WATCHDOG_MARGIN_S), INT32_MAX)


def enable_compile_cache(config: Config) -> None:
    """Keeps compiled programs in `run.compile_cache` (null: off), so a second run of the same
    config (a resume, a rerun) loads the train step instead of compiling it again.

    Any process, any time before its first compile; an unwritable directory leaves the cache off.
    """
    import jax

    if not config.run.compile_cache:
        return
    try:
        Path(config.run.compile_cache).mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # a cache is an optimisation: never fail a run for it
    jax.config.update("jax_compilation_cache_dir", config.run.compile_cache)


def check_shared_run_dir(run_dir: Path) -> None:
    """Checks that every process of a multi-host run sees the same `run_dir` (one process: nothing to do).

    Process 0 writes a marker with a fresh random name; after a barrier every
    process looks for it. A cluster needs run.dir on storage all hosts share
    (checkpoints written by one host are restored by all); raises ClusterError
    naming the processes and hosts that do not see the marker.
    """
    import jax

    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    token = multihost_utils.broadcast_one_to_all(np.frombuffer(secrets.token_bytes(16), np.uint8))
    marker = run_dir / f".nestor-shared-{bytes(np.asarray(token)).hex()}"
    if jax.process_index() == 0:
        marker.touch()
    multihost_utils.sync_global_devices("nestor: run.dir marker written")
    host = socket.gethostname().encode()[:_HOSTNAME_BYTES].ljust(_HOSTNAME_BYTES, b"\0")
    seen = np.array([marker.exists(), *host], np.uint8)
    every = np.asarray(multihost_utils.process_allgather(seen))  # [processes, 1 + hostname bytes]
    multihost_utils.sync_global_devices("nestor: run.dir marker read")
    if jax.process_index() == 0:
        marker.unlink()
    hosts = [bytes(row[1:]).rstrip(b"\0").decode(errors="replace") for row in every]
    missing = [f"process {index} on {hosts[index]}" for index, row in enumerate(every) if not row[0]]
    if missing:
        raise ClusterError(f"run.dir={shown(run_dir)} is not the same directory on every host: {', '.join(missing)} "
                           "cannot see what process 0 wrote there; put run.dir on storage every host shares "
                           "(NFS, Filestore, GCS FUSE)")


# How long one process may wait for the others to finish compiling. On CPU a
# process other than 0 never loads the step from the compilation cache (JAX
# writes entries from process 0 only, and its CPU cache key differs per
# process), so the others can compile long after process 0 is done.
COMPILED_BARRIER_TIMEOUT_S = 3600
_BARRIER_NUMBERS = itertools.count(1)  # this process's barriers; every process counts the same ones


def _coordination_client(name: str):
    """Returns jax.distributed's coordination client (barriers, key-value store); ClusterError if there is none."""
    import jax
    from jax._src import distributed  # no public API has the coordination service's barrier or store

    if distributed.global_state.client is None:
        raise ClusterError(f"'{name}': {jax.process_count()} processes but jax.distributed is not initialized here")
    return distributed.global_state.client


def wait_for_every_process(name: str, timeout_s: float = COMPILED_BARRIER_TIMEOUT_S) -> None:
    """Returns once every process of a multi-host run has called this with `name` (one process: at once).

    A barrier of jax.distributed's coordination service, not a collective: the
    first collective of a step sets up its Gloo/NCCL communicators with a fixed
    deadline (30 s for Gloo on CPU), which a process still compiling would miss.
    Raises ClusterError when a process has not arrived within `timeout_s`.
    """
    import jax

    if jax.process_count() == 1:
        return
    client = _coordination_client(name)
    # A barrier id may be used once per coordination service: number them.
    try:
        client.wait_at_barrier(f"nestor {next(_BARRIER_NUMBERS)}: {name}", int(timeout_s * 1000))
    except jax.errors.JaxRuntimeError as error:
        raise ClusterError(f"not every process reached '{name}' within {timeout_s:g} s: "
                           f"{str(error).splitlines()[0]}") from error


# How long processes wait for each other's verdict on a checkpoint: a restore reads every array once.
VERDICT_TIMEOUT_S = 600


def every_process_says(name: str, value: str, timeout_s: float = VERDICT_TIMEOUT_S) -> list[str]:
    """Returns every process's `value` for `name`, indexed by process (one process: `[value]`).

    Through jax.distributed's key-value store and a barrier with a deadline,
    not a collective: a process whose part failed still answers, so processes
    that saw different things (one restore fails, another does not) decide
    together instead of one waiting forever at a barrier the others skipped.
    Raises ClusterError when a process has not answered within `timeout_s`.
    """
    import jax

    if jax.process_count() == 1:
        return [value]
    client = _coordination_client(name)
    directory = f"nestor {next(_BARRIER_NUMBERS)}: {name}/"
    client.key_value_set(f"{directory}{jax.process_index()}", value)
    wait_for_every_process(f"{name} said", timeout_s)
    said = dict(client.key_value_dir_get(directory))
    return [said[f"{directory}{process}"] for process in range(jax.process_count())]


def _to_process_0(name: str, process: int) -> str:
    return f"nestor to process 0: {name}/{process}"


def send_to_process_0(name: str, value: str) -> None:
    """Leaves `value` under `name` for process 0 (`received_by_process_0`) in jax.distributed's key-value
    store; waits for nobody. Process 0 itself, and a one-process run, send nothing.

    For a process's part of work that process 0 finishes while the others wait
    elsewhere (inside Orbax's save), where no barrier of nestor's can be met.
    """
    import jax

    if jax.process_index() != 0:
        _coordination_client(name).key_value_set(_to_process_0(name, jax.process_index()), value, allow_overwrite=True)


def received_by_process_0(name: str, value: str, timeout_s: float = VERDICT_TIMEOUT_S) -> list[str]:
    """On process 0: returns every process's value for `name`, indexed by process: its own `value` and
    what each other process sent (`send_to_process_0`), which it takes out of the store.

    Raises ClusterError when a process has sent nothing within `timeout_s`.
    """
    import jax

    received = [value]
    for process in range(1, jax.process_count()):
        client, key = _coordination_client(name), _to_process_0(name, process)
        try:
            received.append(client.blocking_key_value_get(key, int(timeout_s * 1000)))
        except jax.errors.JaxRuntimeError as error:
            raise ClusterError(f"process {process} sent no '{name}' within {timeout_s:g} s: "
                               f"{str(error).splitlines()[0]}") from error
        client.key_value_delete(key)
    return received


def preemption_agreed(calls: int) -> bool:
    """Returns True on every process at the same call once any process of a multi-host run got SIGTERM.

    `calls` counts this run's calls, from 1. jax.distributed's preemption sync
    manager catches SIGTERM in every process (its handler, installed by
    `jax.distributed.initialize`, keeps the process alive), shares the notice
    through the coordination service, and picks one past the furthest call any
    process has made: the step every process stops after. Checking costs a
    lock and a comparison; no message is sent until a notice arrives. One
    process, or `jax_enable_preemption_service` off: always False.
    """
    from jax.experimental import multihost_utils

    return preemption_is_agreed() and multihost_utils.reached_preemption_sync_point(calls)


def preemption_is_agreed() -> bool:
    """Returns whether SIGTERM stops this run through `preemption_agreed` (a multi-host run with the service)."""
    import jax
    from jax._src import distributed

    return jax.process_count() > 1 and distributed.global_state.preemption_sync_manager is not None
