"""Stopping one Ray head started on this machine, and nothing else.

`ray stop` ends every Ray process on the machine, whoever started it: on a shared host that ends other
people's clusters and runs. A head's processes are known by its GCS address instead: the GCS server
listens on its port and every other daemon and worker of the cluster (raylet, dashboard, agents,
monitors, workers) names it as `--gcs-address=HOST:PORT` on its command line. `stop_head` signals only those.
"""

from __future__ import annotations

import os
import time

import psutil

from nestor.cluster.rendezvous import ClusterError


def _belongs(process: psutil.Process, address: str, port: str) -> bool:
    try:
        command = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    if process.pid == os.getpid():  # the command that stops the head names its address too
        return False
    if any(f"address={address}" in part for part in command):  # --gcs-address=, --gcs_address=
        return True
    name = " ".join(command[:1])
    return "gcs_server" in name and any(part == f"--gcs_server_port={port}" for part in command)


def head_processes(address: str) -> list[psutil.Process]:
    """Returns this machine's processes of the Ray cluster whose GCS is at `address` (HOST:PORT): those that
    name it, and their descendants (workers and agents retitle themselves `ray::...`)."""
    _, _, port = address.rpartition(":")
    found = {process.pid: process for process in psutil.process_iter() if _belongs(process, address, port)}
    for process in list(found.values()):
        try:
            found.update((child.pid, child) for child in process.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    found.pop(os.getpid(), None)
    return list(found.values())


def stop_head(address: str, grace_s: float = 10.0) -> int:
    """Ends the processes of the Ray head at `address` (HOST:PORT) on this machine, SIGTERM then SIGKILL after
    `grace_s`; returns how many there were. Raises ClusterError when there are none."""
    if ":" not in address:
        raise ClusterError(f"--address {address}: give the head's GCS address HOST:PORT (ray start --port)")
    processes = head_processes(address)
    if not processes:
        raise ClusterError(f"--address {address}: no Ray process of that head runs on this machine")
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    time.sleep(0.1)
    return len(processes)
