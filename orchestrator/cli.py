"""The `nestor` command: train, explain."""

from __future__ import annotations

import argparse
import json
import sys

from orchestrator.config import Config, ConfigError, load


def configure_jax(config: Config) -> None:
    """Points jax at the configured platform; on CPU, simulates `cluster.devices_per_host` devices.

    Must run before jax creates its backends (the first device query).
    """
    import jax

    if config.cluster.accelerator == "cpu":
        jax.config.update("jax_platforms", "cpu")
        if config.cluster.devices_per_host > 0:
            jax.config.update("jax_num_cpu_devices", config.cluster.devices_per_host)


def _train(config: Config, args) -> int:
    from orchestrator.train import TrainingDiverged, train

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


def parser() -> argparse.ArgumentParser:
    """Returns the argument parser of the `nestor` command."""
    main = argparse.ArgumentParser(prog="nestor", description="Train large Flax models on nested device meshes.")
    commands = main.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model")
    explain = commands.add_parser("explain", help="compile the train step and report layout, memory, collectives, FLOPs")
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    for command, handler in ((train, _train), (explain, _explain)):
        command.add_argument("config", help="run YAML, e.g. configs/quickstart.yaml")
        command.add_argument("overrides", nargs="*", metavar="KEY=VALUE|FILE.yaml",
                             help="dotted overrides (mesh.tensor=2) or further YAML files layered in order")
        command.set_defaults(handler=handler)
    return main


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (2 for a config error, 1 for a diverged run, 128 + signal when stopped)."""
    args = parser().parse_args(argv)
    try:
        config = load(args.config, args.overrides)
        return args.handler(config, args)
    except ConfigError as error:
        print(f"nestor: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
