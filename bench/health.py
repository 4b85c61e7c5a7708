"""The health gate's margin (`checkpoint.health_factor`) from runs: how far healthy runs stray from their
best, and how soon a blow-up passes each factor.

Trains the quickstart model in process on 8 CPU devices with the gate off (`checkpoint.health_factor=0`),
logging every step, and follows the gate's two figures as `orchestrator.loop.health.StateHealth` computes them:
the median loss of the last 20 steps over the run's best, and the parameter norm over the best state's.
Runs: the quickstart as it is, and on the synthetic data; from its step-50 checkpoint with
`optimizer.lr=0.3`; from scratch with `optimizer.lr=1`. Prints one table row per run, and writes the
table with its date and commit into docs/benchmarks.md.

    python -m bench.health
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

FACTORS = (1.5, 2.0, 3.0)
QUICKSTART = ("configs/quickstart.yaml", "cluster.launcher=inprocess", "cluster.hosts=1", "cluster.devices_per_host=8",
              "train.log_every=1", "checkpoint.health_factor=0", "metrics.tensorboard=false")


def ratios(history: list[dict], best=None, start_norm: float | None = None) -> tuple[list[float], list[float], object]:
    """Returns each step's (median loss / best, norm / best state's norm) as the gate computes them,
    and the best at the end; `best` continues a run's best from before a resume, `start_norm` is a fresh
    run's initial parameter norm."""
    from nestor.orchestrator.loop.health import StateHealth

    gate = StateHealth(factor=0.0, best=best, start_param_norm=start_norm)
    loss_ratios, norm_ratios = [], []
    for record in history:
        gate.judge(record["step"], record)
        median = float(np.median(gate.losses))
        loss_ratios.append(median / gate.best.loss if len(gate.losses) >= 5 else float("nan"))
        norm_ratios.append(record["param_norm"] / gate.best.param_norm)
    return loss_ratios, norm_ratios, gate.best


def first_past(values: list[float], factor: float, steps: list[int]) -> str:
    """Returns the first step whose value is past `factor`, or "-"."""
    return next((str(step) for step, value in zip(steps, values) if value > factor), "-")


def row(name: str, history: list[dict], best=None, start_norm: float | None = None) -> tuple[str, object]:
    """Returns the table row of a run and its best."""
    loss_ratios, norm_ratios, end = ratios(history, best, start_norm)
    steps = [record["step"] for record in history]
    trips = " | ".join(f"{first_past(loss_ratios, f, steps)} / {first_past(norm_ratios, f, steps)}" for f in FACTORS)
    losses = [record["loss"] for record in history]
    return (f"| {name} | {steps[0]}..{steps[-1]} | {losses[0]:.2f} -> {losses[-1]:.2f} (max {max(losses):.2f}) "
            f"| {np.nanmax(loss_ratios):.3f} | {max(norm_ratios):.3f} | {trips} |"), end


def main() -> None:
    from nestor.cluster.cpu_devices import simulate_cpu_devices_before_import

    simulate_cpu_devices_before_import(8)
    import optax

    from nestor.orchestrator.loader.config import load
    from nestor.orchestrator.job.build import build_job
    from nestor.orchestrator.loop.console import Console
    from nestor.orchestrator.job.state import init_state
    from nestor.orchestrator.loop.train import TrainingDiverged, train

    quiet = Console(log=lambda line: None)

    def run(run_dir: Path, *overrides: str, after: int = 0) -> list[dict]:
        """Returns the per-step records of a run (metrics.jsonl, steps past `after`); a NaN ends it."""
        try:
            train(load(None, [*QUICKSTART, f"run.dir={run_dir}", *overrides]), console=quiet)
        except TrainingDiverged:
            pass
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r for r in records if "loss" in r and r["step"] > after and np.isfinite(r["loss"])]

    config = load(None, list(QUICKSTART))
    layout = build_job(config, with_data=False).layout
    start = float(optax.tree.norm(init_state(config, layout)["params"]))  # every run starts from this state
    work = Path(tempfile.mkdtemp(prefix="nestor-bench-health-"))
    try:
        rows = [row("quickstart", run(work / "quickstart"), start_norm=start)[0],
                row("quickstart, synthetic data", run(work / "synthetic", "data.source=synthetic"), start_norm=start)[0]]
        _, best = row("", run(work / "half", "train.steps=50"), start_norm=start)
        rows.append(row("resumed at 50 with lr=0.3", run(work / "half", "optimizer.lr=0.3", after=50), best)[0])
        rows.append(row("from scratch with lr=1", run(work / "lr1", "optimizer.lr=1"), start_norm=start)[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    factors = " | ".join(f"first past {f:g} (loss / norm)" for f in FACTORS)
    table = "\n".join([f"| run | steps | loss | max loss / best | max norm / best's | {factors} |",
                       "| --- | --- | --- | ---: | ---: | " + " | ".join("---:" for _ in FACTORS) + " |", *rows])
    print(table)
    from bench.report import provenance, write_section

    write_section("health", f"`python -m bench.health` ({provenance()}, 8 CPU devices; a dash: never past):\n\n"
                            f"{table}")


if __name__ == "__main__":
    main()
