"""One start of a run's worker group on Ray's own primitives (`run_group`): a placement group of one bundle
per host (a TPU slice's, when `cluster.tpu_type` and `cluster.tpu_topology` name one), one `GroupWorker`
actor in each bundle, and how the group ended. The worker in each actor is cluster.worker's `run_worker`.

DESIGN.md's step 8 names Ray Train's `JaxTrainer` "or an equivalent on Ray's own primitives". nestor
already did the parts that matter: joining jax.distributed, its restarts and their causes, the mailbox.
Ray Train added a controller and five helper processes to every start of the group, each importing Ray
Train, so every launch and every restart cost about 14 more CPU-seconds (docs/cluster.md).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from nestor.cluster.connect import ClusterSpec

# After a worker fails, how long its peers have to fail too before the group is ended (a peer's
# save that failed because the first worker died is reported with that death).
PEERS_GRACE_S = 1.0


@dataclasses.dataclass
class GroupFailed(Exception):
    """A group whose workers failed: rank -> the worker's failure (Ray's RayTaskError around the error it
    raised, or ActorDiedError when its process died)."""

    worker_failures: dict[int, BaseException]


class GroupNotStarted(Exception):
    """The group's placement could not be reserved in time: the cluster has no room for it."""


class GroupWorker:
    """A worker process of the group (a Ray actor: `ray::GroupWorker` in its process title)."""

    def run(self, work: dict, rank: int, world: int) -> None:
        from nestor.cluster.worker import run_worker

        run_worker(work, rank, world)


def actor_options(spec: ClusterSpec) -> dict[str, Any]:
    """Returns the Ray actor options that take one bundle of `spec.worker_resources()`, exactly."""
    resources = dict(spec.worker_resources())
    return {"num_cpus": resources.pop("CPU", 0), "num_gpus": resources.pop("GPU", 0), "resources": resources,
            "max_restarts": 0, "max_concurrency": 1}


def reserve(spec: ClusterSpec) -> tuple[Any, Callable[[], None]]:
    """Reserves one bundle per host (PACK: as Ray Train did); on TPU with `tpu_type` and `tpu_topology` a
    whole slice through `ray.util.tpu` (worker 0 on the slice's head host). Returns the placement group
    and what releases it; the group may not be ready yet."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if spec.accelerator == "tpu" and spec.tpu_type and spec.tpu_topology:
        from ray.util.tpu import get_tpu_version_from_type, slice_placement_group

        try:
            reserved = slice_placement_group(topology=spec.tpu_topology,
                                             accelerator_version=get_tpu_version_from_type(spec.tpu_type),
                                             resources_per_bundle=spec.worker_resources(), strategy="PACK",
                                             head_reservation_timeout_s=spec.init_timeout_s)
        except TimeoutError as error:
            raise GroupNotStarted(f"no {spec.tpu_type} slice of topology {spec.tpu_topology} came free in "
                                  f"{spec.init_timeout_s:g} s (cluster.init_timeout_s)") from error
        return reserved.placement_group, reserved.shutdown
    group = placement_group([spec.worker_resources()] * spec.hosts, strategy="PACK")
    return group, lambda: remove_placement_group(group)


def run_group(spec: ClusterSpec, work: dict, between: Callable[[], None], poll_s: float = 0.2) -> None:
    """Runs `run_worker(work, rank, spec.hosts)` in one actor per host and returns once every one has
    returned; calls `between()` every `poll_s` meanwhile (the driver's messages and stops). Raises
    GroupFailed once a worker failed (with those of its peers that failed within PEERS_GRACE_S), and
    GroupNotStarted when the placement is not ready within `max(spec.init_timeout_s, 60)` seconds. The
    group's actors are ended and its placement released on every way out."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group, release = reserve(spec)
    actors = []
    try:
        ready, deadline = group.ready(), time.monotonic() + max(spec.init_timeout_s, 60.0)
        while not ray.wait([ready], timeout=poll_s)[0]:
            between()
            if time.monotonic() > deadline:
                raise GroupNotStarted(f"its {spec.hosts} worker(s) of {spec.worker_resources()} each found no room "
                                      f"in {max(spec.init_timeout_s, 60.0):g} s")
        worker_class, options = ray.remote(GroupWorker), actor_options(spec)
        for rank in range(spec.hosts):
            placed = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            actors.append(worker_class.options(scheduling_strategy=placed, **options).remote())
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
        for actor in actors:
            ray.kill(actor, no_restart=True)
        release()
