"""One start of a run's worker group on Ray's own primitives (`run_group`): a placement group of one bundle
per host (on TPU with `cluster.tpu_type` and `cluster.tpu_topology`, whole slices), one `GroupWorker` actor
in each bundle, and how the group ended. The worker in each actor is cluster.worker's `run_worker`. It stands
in for Ray Train's `JaxTrainer`, whose controller and helper processes cost every start of the group several
seconds (docs/cluster.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

from nestor.cluster.connect import ClusterSpec, tpu_slices
from nestor.cluster.rendezvous import ClusterError

# After a worker fails, how long its peers have to fail too before the group is ended (a peer's
# save that failed because the first worker died is reported with that death).
PEERS_GRACE_S = 1.0
# The least time a placement is given to come free, whatever cluster.init_timeout_s says: a busy cluster's
# raylets may take that long to grant it.
PLACEMENT_FLOOR_S = 60.0


def placement_timeout_s(spec: ClusterSpec) -> float:
    return max(spec.init_timeout_s, PLACEMENT_FLOOR_S)


@dataclasses.dataclass(eq=False)
class GroupFailed(Exception):
    """A group whose workers failed: rank -> the worker's failure (Ray's RayTaskError around the error it
    raised, or ActorDiedError when its process died)."""

    worker_failures: dict[int, BaseException]


class GroupNotStarted(Exception):
    """The group's placement could not be reserved in time: the cluster has no room for it."""


class GroupWorker:
    """A worker process of the group (a Ray actor: `ray::GroupWorker` in its process title)."""

    def run(self, work: dict, rank: int, world: int) -> None:
        """Runs `run_worker`; raises what it raises (a ClusterError, the train function's errors)."""
        from nestor.cluster.worker import run_worker

        run_worker(work, rank, world)


def actor_options(spec: ClusterSpec) -> dict[str, Any]:
    """Returns the Ray actor options that take one bundle of `spec.worker_resources()`, exactly."""
    resources = dict(spec.worker_resources())
    return {"num_cpus": resources.pop("CPU", 0), "num_gpus": resources.pop("GPU", 0), "resources": resources,
            "max_restarts": 0}


def reserve(spec: ClusterSpec) -> tuple[Any, Callable[[], None]]:
    """Reserves one bundle per host (PACK, as Ray Train did); on TPU with `tpu_type` and `tpu_topology` whole
    slices through `ray.util.tpu`. Returns the placement group and what releases it; the group may not be
    ready yet. Raises ClusterError for a multi-host TPU run without a slice named, or hosts that are not
    whole slices; GroupNotStarted when no slice came free in time."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if spec.accelerator == "tpu" and spec.hosts > 1 and not (spec.tpu_type and spec.tpu_topology):
        raise ClusterError("a TPU run on several hosts needs cluster.tpu_type and cluster.tpu_topology, so that "
                           "its workers take the hosts of one slice")
    slices, _ = tpu_slices(spec)
    if spec.accelerator == "tpu" and spec.tpu_type and spec.tpu_topology:
        from ray.util.tpu import get_tpu_version_from_type, slice_placement_group

        try:
            reserved = slice_placement_group(topology=spec.tpu_topology,
                                             accelerator_version=get_tpu_version_from_type(spec.tpu_type),
                                             resources_per_bundle=spec.worker_resources(), num_slices=slices,
                                             strategy="PACK", head_reservation_timeout_s=placement_timeout_s(spec))
        except ValueError as error:  # a topology that is no slice of that TPU: no restart mends it
            raise ClusterError(f"cluster.tpu_type={spec.tpu_type}, cluster.tpu_topology={spec.tpu_topology}: "
                               f"{error}") from None
        except (TimeoutError, RuntimeError) as error:  # no slice came free in time: a start to retry
            raise GroupNotStarted(f"no {slices} {spec.tpu_type} slice(s) of topology {spec.tpu_topology} could be "
                                  f"reserved ({type(error).__name__}: {error})") from error
        return reserved.placement_group, reserved.shutdown
    group = placement_group([spec.worker_resources()] * spec.hosts, strategy="PACK")
    return group, lambda: remove_placement_group(group)


def run_group(spec: ClusterSpec, work: dict, between: Callable[[], None], poll_s: float = 0.2) -> None:
    """Runs `run_worker(work, rank, spec.hosts)` in one actor per host and returns once every one has
    returned; calls `between()` every `poll_s` meanwhile (the driver's messages and stops). Raises
    GroupFailed once a worker failed (with those of its peers that failed within PEERS_GRACE_S),
    GroupNotStarted when the placement is not ready within `placement_timeout_s`, and ClusterError for a
    TPU run whose hosts are no whole slices. The group's actors are ended and its placement released on
    every way out."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actors, release = [], lambda: None
    try:
        group, release = reserve(spec)
        ready, deadline = group.ready(), time.monotonic() + placement_timeout_s(spec)
        while not ray.wait([ready], timeout=poll_s)[0]:
            between()
            if time.monotonic() > deadline:
                raise GroupNotStarted(f"its {spec.hosts} worker(s) of {spec.worker_resources()} each found no room "
                                      f"in {placement_timeout_s(spec):g} s")
        worker_class, options = ray.remote(GroupWorker), actor_options(spec)
        for rank in range(spec.hosts):
            placed = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            actors.append(worker_class.options(scheduling_strategy=placed, **options).remote())
        # the driver's count of slices, not each worker's own: Ray's reads its process's environment
        work = {**work, "tpu_slices": tpu_slices(spec)}
        running = {actor.run.remote(work, rank, spec.hosts): rank for rank, actor in enumerate(actors)}
        failures: dict[int, BaseException] = {}
        failed_at = None
        while running and (failed_at is None or time.monotonic() - failed_at < PEERS_GRACE_S):
            done, _ = ray.wait(list(running), num_returns=len(running), timeout=poll_s)
            for ref in done:
                rank = running.pop(ref)
                try:
                    ray.get(ref)
                except Exception as error:  # the worker's own error, or its process's death
                    failures[rank] = error
                    failed_at = failed_at or time.monotonic()
            between()
        if failures:
            raise GroupFailed(failures)
    finally:
        # with Ray gone, its actors and placement went with it
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            release()
