"""`nestor plan --measure K`: the top K candidates trained for a few steps each on the devices present, in
this process or under the Ray launcher's embedded cluster (as the config says), each into a temporary
run.dir removed afterwards, and re-ranked by their measured step time: the median of the loop's own step
times (metrics.jsonl's step_time_s, under Ray process 0's) past the first step, the compile never among them."""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from nestor.cluster.interrupts import Interrupted
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import compile_target
from nestor.orchestrator.loop.console import Console
from nestor.orchestrator.loop.train import train
from nestor.orchestrator.planning.search import Judged, error_line, label

SKIPPED_STEPS = 1  # the first step's time holds one-off work (the first transfers, the first dispatch)


@dataclasses.dataclass
class Measured:
    """A ranked candidate after its run: its median step seconds past the skipped ones, or why it failed."""

    judged: Judged
    step_s: float | None = None
    error: str | None = None


class StepRecords(Console):
    """A Console that shows nothing and keeps the records of the steps it is shown (metrics.jsonl's)."""

    def __init__(self):
        super().__init__(log=lambda line: None)
        self.records: list[dict] = []

    def step(self, record: dict) -> None:
        self.records.append(record)


def train_here(config, console: Console) -> int | None:
    """Trains `config` in this process (`cluster.launcher=inprocess`); returns the signal that stopped it."""
    return train(config, console=console).stopped_by


def check_measurable(config, steps: int) -> None:
    """Raises ConfigError where the plan's candidates cannot be measured here: on a Ray cluster by address
    (each candidate trains into a temporary run.dir of this machine, which its hosts do not share), under
    Ray on GPUs or TPUs (this process opens them for its compiles, before the workers would), where the plan
    compiles for a target whose devices are not present, or over no more `steps` than the untimed ones."""
    if steps <= SKIPPED_STEPS:
        raise ConfigError([("--steps", f"{steps}: the first {SKIPPED_STEPS} step is not timed; give more than "
                                       f"{SKIPPED_STEPS}")])
    if config.cluster.launcher == "ray" and config.cluster.address:
        raise ConfigError([("cluster.address", f"{config.cluster.address}: --measure trains each candidate into a "
                                               "temporary run.dir of this machine, which a cluster's hosts do not "
                                               "see; measure on this machine's devices (no cluster.address) or run "
                                               "nestor plan on a host of the cluster")])
    if config.cluster.launcher == "ray" and config.cluster.accelerator != "cpu":
        raise ConfigError([("cluster.launcher", f"ray: --measure under Ray on {config.cluster.accelerator}s would "
                                                "start workers on the devices the plan's own process holds; add "
                                                "cluster.launcher=inprocess")])
    target = compile_target(config)
    if target.devices is not None:
        raise ConfigError([("cluster.device_kind", f"{config.cluster.device_kind}: the plan compiles for devices "
                                                   f"that are not here ({target.compiler}); --measure runs on "
                                                   "the devices present")])


def measured_config(config, judged: Judged, steps: int, run_dir: Path):
    """Returns the config a candidate is measured with: its settings, `steps` steps each logged, no
    checkpoint but the last, no evaluation, trace or TensorBoard, in `run_dir`; under Ray, a failed worker
    group is not restarted (nor on fewer hosts): its steps would count twice, or on another mesh."""
    return config.replace(**judged.candidate.as_dict(), **{
        "train.steps": steps, "train.log_every": 1, "run.dir": str(run_dir), "checkpoint.every": 0,
        "eval.every": 0, "profile.start_step": 0, "metrics.tensorboard": False, "cluster.max_failures": 0,
        "cluster.min_hosts": None})


def measure(config, ranked: list[Judged], steps: int, progress: Callable[[str], None] | None = None,
            run: Callable[[object, Console], int | None] = train_here) -> list[Measured]:
    """Returns the `ranked` candidates, each trained `steps` steps by `run(config, console)` (which returns the
    signal that stopped it, or None; the Ray launcher's driver under Ray), fastest measured first, then those
    that failed (each with its error's first line). Raises Interrupted when a signal stopped a run."""
    found = []
    for index, judged in enumerate(ranked, 1):
        if progress:
            progress(f"[{index}/{len(ranked)}] {steps} steps of {label(judged.candidate)}")
        records = StepRecords()
        with tempfile.TemporaryDirectory(prefix="nestor-measure-") as directory:
            try:
                stopped_by = run(measured_config(config, judged, steps, Path(directory) / "run"), records)
            except Exception as error:  # noqa: BLE001 - a candidate that does not run is reported, not raised
                found.append(Measured(judged, error=error_line(error)))
                continue
        if stopped_by is not None:
            raise Interrupted(stopped_by)
        times = [record["step_time_s"] for record in records.records if record["step"] > SKIPPED_STEPS]
        found.append(Measured(judged, step_s=statistics.median(times)))
    return sorted(found, key=lambda m: (m.step_s is None, m.step_s or 0.0))
