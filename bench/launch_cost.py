"""What one start of a worker group costs: wall seconds and the CPU-seconds of every process it starts, for
nestor's group (cluster.group: a placement group and one actor per host) and, where Ray Train is installed
(`pip install 'ray[train]'`), for Ray Train's `JaxTrainer`, which nestor used before. Each worker imports
jax and returns, so the figures are the launch's alone. The CPU-seconds are sampled from every descendant
of this process every 0.1 s (a process's last sample counts after it exits).

    python -m bench.launch_cost --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import threading
import time

_SEEN: dict[tuple[int, float], float] = {}  # (pid, start time) -> its user + system CPU-seconds, last seen


def _sample_forever() -> None:
    import psutil

    from bench.suite_cpu import cpu_since_seen

    me = psutil.Process()
    while True:
        for process in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                cpu_since_seen(process, _SEEN)
        time.sleep(0.1)


def _cpu_seconds() -> float:
    time.sleep(0.5)  # a sample after the last process of the launch ended
    return sum(_SEEN.values())


def _import_jax(*_) -> None:
    import jax  # noqa: F401


class _Worker:
    def run(self) -> None:
        _import_jax()


def group_launch(hosts: int) -> None:
    """Starts `hosts` actors in a placement group as cluster.group does, each importing jax, and ends them."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from nestor.cluster.connect import ClusterSpec
    from nestor.cluster.group import actor_options, reserve

    spec = ClusterSpec(hosts=hosts, devices_per_host=1)
    group, release = reserve(spec)
    ray.get(group.ready())
    actors = [ray.remote(_Worker).options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank),
                                          **actor_options(spec)).remote() for rank in range(hosts)]
    try:
        ray.get([actor.run.remote() for actor in actors])
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        release()


def ray_train_launch(hosts: int) -> None:
    """One empty `JaxTrainer.fit()` of `hosts` workers, each importing jax."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    with tempfile.TemporaryDirectory() as storage:
        JaxTrainer(_import_jax, scaling_config=ScalingConfig(num_workers=hosts),
                   run_config=RunConfig(name="bench", storage_path=storage,
                                        failure_config=FailureConfig(max_failures=0))).fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray.init(address="local", num_cpus=args.hosts + 1, log_to_driver=False, logging_level="ERROR")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # Ray Train's state API: this cluster
    threading.Thread(target=_sample_forever, daemon=True).start()
    launches = {"nestor's group (cluster.group)": group_launch}
    try:
        import ray.train.v2.jax  # noqa: F401

        launches["Ray Train's JaxTrainer"] = ray_train_launch
    except ImportError:
        print("Ray Train is not installed (pip install 'ray[train]'): nestor's group alone")
    try:
        for repeat in range(args.repeats):
            for name, launch in launches.items():
                before, started = _cpu_seconds(), time.monotonic()
                launch(args.hosts)
                wall = time.monotonic() - started
                print(f"{name}, {args.hosts} workers, launch {repeat + 1}: {wall:.1f} s, "
                      f"{_cpu_seconds() - before:.1f} CPU-seconds", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
