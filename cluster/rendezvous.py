"""Joining `jax.distributed` with a deadline that names the rank that never came.

JAX's coordination service aborts the whole process (no Python exception)
when a task misses the registration deadline, so nestor counts arrivals
itself first: every rank checks in on a board, rank 0 also posts the
coordinator address, and only when all ranks are present does anyone call
`jax.distributed.initialize`. A rank missing at `timeout_s` becomes a
ClusterError that says which one.
"""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path


class ClusterError(RuntimeError):
    """The cluster cannot run the job as configured; the message names the key and the fix."""


class Board:
    """Arrivals per worker group: a restarted group (cluster.group makes a new placement
    group for it) checks in under its own id, so it never meets a dead group's ranks.

    Runs as a Ray actor in a real launch and as a plain object in tests.
    """

    def __init__(self, world: int):
        self.world = world
        self.groups: dict[str, tuple[set[int], str | None]] = {}

    def arrive(self, group: str, rank: int, address: str | None) -> None:
        """Records `rank` of worker group `group`; rank 0 brings the coordinator address."""
        ranks = self.groups.setdefault(group, (set(), None))[0]
        ranks.add(rank)
        if rank == 0:
            self.groups[group] = (ranks, address)

    def state(self, group: str) -> tuple[list[int], str | None]:
        """Returns (ranks present, coordinator address) of worker group `group`."""
        ranks, address = self.groups.get(group, (set(), None))
        return sorted(ranks), address


_RAY_WORKER_PORTS_END = 20_000  # a `ray start` node's workers take ports 10002-19999 unless told otherwise
_NODE_PORTS_START = 30_000  # Kubernetes' NodePorts (30000-32767), which kube-proxy redirects on a node
_PORTS = random.SystemRandom()  # never the `random` module's state, which a job or a test may seed


def _ephemeral_ports_start() -> int:
    """The first port of the kernel's ephemeral range, from which every outgoing connection takes its own."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default; IANA's range starts higher still


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str) -> int:
    """Returns a TCP port that is free on `host` right now, for a server that binds it a moment later.

    It is drawn above Ray's worker ports and below both the kernel's ephemeral range and Kubernetes'
    NodePorts: a port the kernel hands out (bind to port 0) can be taken in that moment by any process's
    outgoing connection, which on a busy machine failed a Ray head's GCS ("Address already in use"). Where
    that range is too narrow, the kernel's choice is returned."""
    end = min(_ephemeral_ports_start(), _NODE_PORTS_START)
    if end - _RAY_WORKER_PORTS_END >= 1_000:
        for port in _PORTS.sample(range(_RAY_WORKER_PORTS_END, end), 64):
            if _binds(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def rendezvous(board, group: str, rank: int, world: int, host: str, timeout_s: float, poll_s: float = 0.1) -> str:
    """Checks `rank` of worker group `group` in on `board` and waits for all `world`
    ranks of that group; returns the coordinator address.

    `board` has Board's methods (called directly). Raises ClusterError naming
    the missing ranks when they have not all arrived after `timeout_s`.
    """
    address = f"{host}:{free_port(host)}" if rank == 0 else None
    board.arrive(group, rank, address)
    deadline = time.monotonic() + timeout_s
    while True:
        ranks, address = board.state(group)
        if len(ranks) == world and address:
            return address
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(ranks))
            names = ", ".join(str(r) for r in missing)
            raise ClusterError(f"rank {names} of {world} never joined jax.distributed within "
                               f"cluster.init_timeout_s={timeout_s:g}s; check that worker's log, or raise the timeout")
        time.sleep(poll_s)
