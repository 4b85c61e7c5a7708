"""Runs a config's training where `cluster.launcher` says: in this process or on Ray workers."""

from __future__ import annotations

from cluster.launcher import ClusterSpec, launch
from orchestrator.config import Config


def cluster_spec(config: Config) -> ClusterSpec:
    """Returns what the run asks of Ray, from the `cluster.*` keys."""
    c = config.cluster
    return ClusterSpec(hosts=c.hosts, devices_per_host=c.devices_per_host, accelerator=c.accelerator,
                       address=c.address, max_failures=c.max_failures, init_timeout_s=c.init_timeout_s,
                       tpu_topology=c.tpu_topology, tpu_type=c.tpu_type, dashboard=c.dashboard)


def train_on_worker(config: Config) -> None:
    """The function each Ray worker runs once jax.distributed is up: the ordinary train loop."""
    import jax

    from orchestrator.train import train

    first = jax.process_index() == 0  # one copy of the progress lines, not one per host
    result = train(config, log=print if first else (lambda *_: None))
    if first and result.losses:  # a run resumed at its last step trains nothing
        print(f"trained {len(result.losses)} steps: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")


def train_on_ray(config: Config) -> None:
    """Trains `config` on `cluster.hosts` Ray workers; returns when they finish.

    Raises cluster.launcher.ClusterError (unreachable cluster, too few devices,
    a rank that never joins, failures past `cluster.max_failures`).
    """
    launch(train_on_worker, config, cluster_spec(config), storage_dir=config.run.dir)
