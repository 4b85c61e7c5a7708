"""The `nestor` command: train, explain, submit, status, stop."""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from cluster.rendezvous import ClusterError
from orchestrator.config import Config, ConfigError, load


def configure_jax(config: Config) -> None:
    """Points this (single) process's jax at the configured platform; on CPU, simulates the
    devices of all `cluster.hosts` hosts, so the mesh has the shape it will have on the cluster.

    Must run before jax creates its backends (the first device query).
    """
    import jax

    if config.cluster.accelerator == "cpu":
        jax.config.update("jax_platforms", "cpu")
        if config.cluster.devices_per_host > 0:
            jax.config.update("jax_num_cpu_devices", config.cluster.hosts * config.cluster.devices_per_host)


def _train(config: Config, args) -> int:
    from orchestrator.train import TrainingDiverged, train

    if config.cluster.launcher == "ray":
        from orchestrator.launch import train_on_ray

        train_on_ray(config)
        print(f"trained on {config.cluster.hosts} Ray worker(s); run dir {config.run.dir}")
        return 0
    configure_jax(config)
    try:
        result = train(config)
    except TrainingDiverged as error:
        print(f"nestor: training diverged: {error}", file=sys.stderr)
        return 1
    if result.losses:
        print(f"trained steps {result.first_step + 1}..{result.first_step + len(result.losses)}: "
              f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; run dir {config.run.dir}")
    else:
        print(f"nothing to train: the checkpoint in {config.run.dir} is at train.steps={config.train.steps}")
    # A preempted run exits as the signal would have made it (128 + signal), after its checkpoint.
    return 0 if result.stopped_by is None else 128 + result.stopped_by


def _explain(config: Config, args) -> int:
    from orchestrator.explain import explain, format_report

    configure_jax(config)
    report = explain(config)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _submit(config: Config, args) -> int:
    from cluster import jobs

    job_id = jobs.submit(args.address, yaml.safe_dump(config.to_dict(), sort_keys=False))
    print(job_id, flush=True)
    if not args.follow:
        return 0
    final = jobs.follow(args.address, job_id)
    print(f"nestor: job {job_id} {final}", file=sys.stderr)
    return 0 if final == "SUCCEEDED" else 1


def _job_command(args) -> int:
    from cluster import jobs

    if args.command == "status":
        print(jobs.status(args.address, args.job_id))
    else:
        print("stopped" if jobs.stop(args.address, args.job_id) else "not running")
    return 0


def parser() -> argparse.ArgumentParser:
    """Returns the argument parser of the `nestor` command."""
    main = argparse.ArgumentParser(prog="nestor", description="Train large Flax models on nested device meshes.")
    commands = main.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model")
    explain = commands.add_parser("explain", help="compile the train step and report layout, memory, collectives, FLOPs")
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    submit = commands.add_parser("submit", help="submit a training job to a running Ray cluster (Jobs API)")
    submit.add_argument("--follow", action="store_true", help="stream the logs; exit non-zero if the job fails")
    for command, handler in ((train, _train), (explain, _explain), (submit, _submit)):
        command.add_argument("config", help="run YAML, e.g. configs/quickstart.yaml")
        command.add_argument("overrides", nargs="*", metavar="KEY=VALUE|FILE.yaml",
                             help="dotted overrides (mesh.tensor=2) or further YAML files layered in order")
        command.set_defaults(handler=handler)
    for name, text in (("status", "print a submitted job's status"), ("stop", "stop a submitted job")):
        command = commands.add_parser(name, help=text)
        command.add_argument("job_id", help="the submission id `nestor submit` printed")
        command.set_defaults(handler=None)
    for command in (submit, commands.choices["status"], commands.choices["stop"]):
        command.add_argument("--address", required=True, help="the cluster's dashboard URL, e.g. http://127.0.0.1:8265")
    return main


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit code: 2 for a config error, 1 for a cluster error or a diverged run
    (printed as one message, no trace), 128 + signal when stopped by one."""
    args = parser().parse_args(argv)
    try:
        if args.handler is None:
            return _job_command(args)
        config = load(args.config, args.overrides)
        return args.handler(config, args)
    except ConfigError as error:
        print(f"nestor: {error}", file=sys.stderr)
        return 2
    except ClusterError as error:
        print(f"nestor: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
