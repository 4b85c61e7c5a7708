"""Stopping one Ray head started on this machine, and nothing else.

`ray stop` ends every Ray process on the machine, whoever started it: on a shared host that ends other
people's clusters and runs. A head's processes are known by its GCS address instead: the GCS server
listens on its port and every other daemon and worker of the cluster (raylet, dashboard, agents,
monitors) names it as `--gcs-address=HOST:PORT` on its command line, and the workers and agents are
their children. `stop_head` signals only those. A head started without `--node-ip-address` names the
host's own IP there, whatever address the user knows it by: on this machine, the port is matched on any
of its addresses (`127.0.0.1:PORT` stops a head whose daemons name `10.0.0.5:PORT`).
"""

from __future__ import annotations

import socket
import time

import psutil

from nestor.cluster.rendezvous import ClusterError


FLAGS = ("--gcs-address=", "--gcs_address=")  # how Ray's daemons name their cluster's GCS


def local_hosts() -> set[str]:
    """Returns the names and addresses this machine answers to: `localhost`, its host name and every
    address of its network interfaces (a head started without `--node-ip-address` names the host's own)."""
    hosts = {"localhost", socket.gethostname()}
    for addresses in psutil.net_if_addrs().values():
        hosts.update(entry.address.split("%")[0] for entry in addresses
                     if entry.family in (socket.AF_INET, socket.AF_INET6))
    return hosts


def _hosts_of(host: str) -> set[str]:
    """Returns the hosts a GCS address's `host` stands for: any of this machine's when it is one of them."""
    local = local_hosts()
    return local if host in local else {host}


def _belongs(process: psutil.Process, hosts: set[str], port: str) -> bool:
    try:
        command = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    for part in command:
        for flag in FLAGS:
            if part.startswith(flag):
                host, _, named_port = part[len(flag):].rpartition(":")
                if named_port == port and host.strip("[]") in hosts:
                    return True
    name = " ".join(command[:1])
    return "gcs_server" in name and f"--gcs_server_port={port}" in command


def head_processes(address: str) -> list[psutil.Process]:
    """Returns this machine's processes of the Ray cluster whose GCS is at `address` (HOST:PORT, the port
    matched on any of this machine's addresses when HOST is one of them): its GCS server, the daemons that
    name it, and their descendants (workers and agents retitle themselves `ray::...`); never this process
    or one it runs under."""
    host, _, port = address.rpartition(":")
    hosts = _hosts_of(host.strip("[]"))
    found = {process.pid: process for process in psutil.process_iter() if _belongs(process, hosts, port)}
    for process in list(found.values()):
        try:
            found.update((child.pid, child) for child in process.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    here = psutil.Process()
    for own in (here, *here.parents()):
        found.pop(own.pid, None)
    return list(found.values())


def stop_head(address: str, grace_s: float = 10.0) -> int:
    """Ends the processes of the Ray head at `address` (HOST:PORT) on this machine, SIGTERM then SIGKILL after
    `grace_s`; returns how many there were. Raises ClusterError when there are none."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        raise ClusterError(f"--address {address}: give the head's GCS address HOST:PORT (ray start --port), not "
                           "its dashboard URL")
    processes = head_processes(address)
    if not processes:
        raise ClusterError(f"--address {address}: no Ray process of that head runs on this machine")
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
        except psutil.AccessDenied:
            raise ClusterError(f"--address {address}: process {process.pid} of that head belongs to another "
                               "user; stop it as that user") from None
    kill_if_still_running(processes, grace_s)
    time.sleep(0.1)
    return len(processes)


def kill_if_still_running(processes: list[psutil.Process], grace_s: float) -> None:
    """Gives `processes`, already sent SIGTERM, `grace_s` to end; SIGKILLs the others and waits as long again."""
    for process in _still_running(processes, grace_s):
        try:
            process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    _still_running(processes, grace_s)


def _still_running(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Waits up to `timeout_s` for `processes` to end; returns those still running. One that has exited but
    that its parent has not reaped yet (a zombie) has ended: psutil's own wait would wait the whole time for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [process for process in processes if _running(process)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
