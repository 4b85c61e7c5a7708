"""Simulated CPU devices: how many a process shows, and the threads XLA:CPU gives them.

Tests, the inprocess launcher, Ray workers on CPU and the bench scripts run
a mesh of N devices in one process (`--xla_force_host_platform_device_count`,
`jax_num_cpu_devices`). Imports nothing heavy, so a script can call it before
it imports jax.
"""

from __future__ import annotations

import os
import re


def without_device_count(xla_flags: str) -> str:
    """Returns XLA_FLAGS without a simulated host device count, every other flag kept."""
    return " ".join(re.sub(r"--xla_force_host_platform_device_count=\d+", "", xla_flags).split())


# XLA:CPU's collective timeouts and their defaults: past the first it ends the process with no more than
# "Aborted" when a collective's participants have not all arrived, and the second bounds a collective's run.
COLLECTIVE_TIMEOUTS = {"xla_cpu_collective_call_terminate_timeout_seconds": 40,
                       "xla_cpu_collective_timeout_seconds": 30 * 60}


def with_collective_timeouts(xla_flags: str, seconds: int) -> str:
    """Returns XLA_FLAGS with XLA:CPU's collective timeouts at least `seconds` (a larger one, given or XLA's
    default, kept)."""
    for flag, default in COLLECTIVE_TIMEOUTS.items():
        given = [int(value) for value in re.findall(rf"--{flag}=(\d+)", xla_flags)]
        xla_flags = re.sub(rf"--{flag}=\d+", "", xla_flags)
        xla_flags += f" --{flag}={max([seconds, default, *given])}"
    return " ".join(xla_flags.split())


def collective_timeouts(xla_flags: str) -> dict[str, int]:
    """Returns XLA:CPU's collective timeouts (seconds) that `xla_flags` sets, XLA's default for the others."""
    return {flag: int((re.findall(rf"--{flag}=(\d+)", xla_flags) or [default])[-1])
            for flag, default in COLLECTIVE_TIMEOUTS.items()}


def simulate_cpu_devices(jax, devices: int, collective_timeout_s: int | None = None) -> None:
    """Makes this process's jax use the CPU and show `devices` devices (0: jax's default, one), with the
    threads they need, and XLA:CPU's collective timeouts at least `collective_timeout_s` (None: XLA's own);
    must run before jax starts its backend (which reads XLA_FLAGS)."""
    # A device count inherited through XLA_FLAGS (tests set 8) would override the config.
    os.environ["XLA_FLAGS"] = without_device_count(os.environ.get("XLA_FLAGS", ""))
    if collective_timeout_s is not None:
        os.environ["XLA_FLAGS"] = with_collective_timeouts(os.environ["XLA_FLAGS"], collective_timeout_s)
    jax.config.update("jax_platforms", "cpu")
    one_program_at_a_time(jax)
    if devices > 0:
        jax.config.update("jax_num_cpu_devices", devices)
        size_cpu_thread_pool(devices)


def one_program_at_a_time(jax) -> None:
    """Makes each XLA:CPU program end before its call returns (no asynchronous dispatch); must run before
    jax starts its backend.

    With asynchronous dispatch the train loop keeps two steps in flight, and the waiters of both programs'
    collectives share the one thread pool below, sized for one program's. A CPU's devices share its
    cores, so overlapping two programs gains nothing there.
    """
    jax.config.update("jax_cpu_enable_async_dispatch", False)


# Threads XLA:CPU gets per simulated device. A device starts its independent collectives in an order of its
# own (a race), each waiting on a thread, so the pool fills only when the devices wait in this many at once
# on average (what 2 per device still allowed: docs/cluster.md).
THREADS_PER_DEVICE = 8


def size_cpu_thread_pool(devices: int) -> None:
    """Gives XLA:CPU THREADS_PER_DEVICE threads per simulated device (PJRT_NPROC), a larger PJRT_NPROC already set kept;
    call it before jax's backend starts.

    XLA:CPU runs each device's independent thunks on one shared pool of max(cores, devices) threads,
    and a collective holds its thread until every device has joined it. When a device runs two
    collectives at once, the pool can fill with waiters: in a pipeline4 x fsdp2 step on 2 cores,
    seven devices waited in the pipeline loop's collective-permute for the eighth, whose loop had
    no thread left because its one thread waited in an all-gather for the seven. XLA aborts the
    process when the rendezvous times out ("Fatal Python error: Aborted" mid-step, no message).
    A waiting thread costs no CPU; the pool's size is read from PJRT_NPROC when the backend starts.
    """
    os.environ["PJRT_NPROC"] = cpu_pool_threads(devices)


def usable_cores() -> int:
    """Returns how many cores this process may run on (its CPU affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_pool_threads(devices: int) -> str:
    """Returns PJRT_NPROC for `devices` simulated devices: the cores this process may use, THREADS_PER_DEVICE
    per device, or the size this environment already asks for, whichever is largest."""
    cores = usable_cores()
    already = os.environ.get("PJRT_NPROC") or os.environ.get("NPROC", "")  # XLA reads them in this order
    return str(max(cores, THREADS_PER_DEVICE * devices, int(already) if already.isdigit() else 0))


def simulate_cpu_devices_before_import(devices: int) -> None:
    """For a script that has not imported jax yet: `devices` simulated CPU devices and their threads."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={devices}").strip()
    size_cpu_thread_pool(devices)


# The jax versions whose cache keys were seen equal in every process once the devices replace the topology
# (tests/test_cluster.py): on another, keys that still differed would leave process 1 waiting for an entry
# process 0 never shares, so it compiles for itself as before.
KEYS_CHECKED_ON = ("0.10.",)


def share_compiled_programs(jax) -> bool:
    """For the processes of one multi-process CPU run that all run on this machine: process 0 alone compiles
    each program and the others load its binary (`jax_share_binary_between_hosts`), and every process finds
    the persistent compilation cache's entries under the same key. Returns whether it could; call it in every
    process, before the first compile, only when they all run here.

    JAX keys a CPU program's cache entry with the topology of the process's own devices, which differs between
    processes, and writes entries from process 0 only; so every other process compiled every program of every
    run, a rerun's included, while process 0 loaded them. Here the key hashes the devices' kind and global ids,
    which every process sees alike. One machine only: XLA:CPU compiles for its own CPU, which another host's
    may lack. Sharing, like the cache, needs `jax_compilation_cache_dir` set; without it each process compiles.
    """
    if not jax.__version__.startswith(KEYS_CHECKED_ON):
        return False
    try:
        from jax._src import cache_key
        if getattr(cache_key._hash_accelerator_config, "shared_by_processes", False):
            return True
        by_topology = cache_key._hash_accelerator_config
        hash_string = cache_key._hash_string
    except (ImportError, AttributeError):
        return False

    def by_devices(hash_obj, devices) -> None:
        if all(device.platform == "cpu" for device in devices.flat):
            for device in devices.flat:
                hash_string(hash_obj, f"{device.device_kind}:{device.id}")
        else:
            by_topology(hash_obj, devices)

    by_devices.shared_by_processes = True
    cache_key._hash_accelerator_config = by_devices
    jax.config.update("jax_share_binary_between_hosts", True)
    return True
