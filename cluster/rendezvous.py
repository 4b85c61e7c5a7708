"""Joining `jax.distributed` with a deadline that names the rank that never came.

JAX's coordination service aborts the whole process (no Python exception)
when a task misses the registration deadline, so nestor counts arrivals
itself first: every rank checks in on a board, rank 0 also posts the
coordinator address, and only when all ranks are present does anyone call
`jax.distributed.initialize`. A rank missing at `timeout_s` becomes a
ClusterError that says which one.
"""

from __future__ import annotations

import socket
import time


class ClusterError(RuntimeError):
    """The cluster cannot run the job as configured; the message names the key and the fix."""


class Board:
    """Arrivals of one worker group, round by round (a restarted group starts a new round).

    Runs as a Ray actor in a real launch and as a plain object in tests.
    """

    def __init__(self, world: int):
        self.world = world
        self.round = 0
        self.ranks: set[int] = set()
        self.address: str | None = None

    def arrive(self, rank: int, address: str | None) -> int:
        """Records `rank` (rank 0 brings the coordinator address); returns the round it joined."""
        # A rank seen twice in a round means the group restarted before the round
        # filled; a full round means a new attempt. Either way, start afresh.
        if rank in self.ranks or len(self.ranks) == self.world:
            self.round, self.ranks, self.address = self.round + 1, set(), None
        self.ranks.add(rank)
        if rank == 0:
            self.address = address
        return self.round

    def state(self, round_: int) -> tuple[list[int], str | None]:
        """Returns (ranks present, coordinator address) of `round_`; ([], None) once it is superseded."""
        if round_ != self.round:
            return [], None
        return sorted(self.ranks), self.address


def free_coordinator_address(host: str) -> str:
    """Returns `host:port` with a port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return f"{host}:{probe.getsockname()[1]}"


def rendezvous(board, rank: int, world: int, host: str, timeout_s: float, poll_s: float = 0.1) -> str:
    """Checks `rank` in on `board` and waits for all `world` ranks; returns the coordinator address.

    `board` has Board's methods (called directly). Raises ClusterError naming
    the missing ranks when they have not all arrived after `timeout_s`.
    """
    address = free_coordinator_address(host) if rank == 0 else None
    round_ = board.arrive(rank, address)
    deadline = time.monotonic() + timeout_s
    while True:
        ranks, address = board.state(round_)
        if len(ranks) == world and address:
            return address
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(ranks))
            names = ", ".join(str(r) for r in missing)
            raise ClusterError(f"rank {names} of {world} never joined jax.distributed within "
                               f"cluster.init_timeout_s={timeout_s:g}s; check that worker's log, or raise the timeout")
        time.sleep(poll_s)
