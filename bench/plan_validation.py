"""The plan's ranking against measured steps: six models, every candidate of a bounded space trained.

For each model on 8 simulated CPU devices (1 host x 8, in this process), `nestor plan`'s search ranks every
candidate of a space bounded by pins (the KEY=VALUE pins `nestor plan` takes), with a budget that leaves none
undecided; then every ranked candidate is trained for a few steps as `nestor plan --measure` trains them
(orchestrator/planning/measure.py: the median step past the first), in `--rounds` rounds, each round through
every candidate, in the search's order and then in reverse, so a slow spell of the host falls on all of them
alike. A candidate's measured step is the median of its rounds. Per model it reports the measured step of the
plan's #1 over the best measured step (the top-1 ratio), that ratio in each round, Spearman's rank correlation
of the predicted and measured steps, how many ranked candidates failed to run, and the spread of the #1's and
the best's rounds (the host's noise beside the ratio). The rounds after the first load the steps compiled in
the first from a compilation cache of the run's own (JAX keeps those that took over 1 s).

    python -m bench.plan_validation --out validation.json   # about 30 minutes on 2 cores

It prints one row per model, writes its section of docs/plan.md (`--no-write`: print only) and, with
`--out`, every measurement as JSON; `--from FILE...` prints and writes the table of earlier runs' JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench.report import provenance, write_section

ROOT = Path(__file__).resolve().parent.parent
PLAN_DOC = ROOT / "docs" / "plan.md"
MODELS_DOC = ROOT / "docs" / "models.md"
DEVICES = 8
SIMULATED = ("cluster.launcher=inprocess", "cluster.hosts=1", f"cluster.devices_per_host={DEVICES}")
ONE_RUNG = ("model.remat=none", "train.grad_accum=1", "optimizer.shard_update=false")  # one rung per layout
TARGET_RATIO = 1.10


@dataclasses.dataclass(frozen=True)
class Case:
    """A model validated: its config (a YAML path from the repository's root, None: the defaults, or
    USER_MODEL), the overrides that size it, and the pins that bound its space."""

    name: str
    config: str | None
    size: tuple[str, ...]
    bound: tuple[str, ...]

    @property
    def overrides(self) -> list[str]:
        return [*SIMULATED, *self.size, *self.bound, *ONE_RUNG]


USER_MODEL = "docs/models.md"  # the classifier of its complete example, its files written from the doc's block
TINY_LM = ("model.preset=tiny", "data.source=synthetic")
CASES = (
    Case("dense LM", None, (*TINY_LM, "train.global_batch=16", "train.seq_len=32"),
         ("mesh.pipeline=1", "mesh.context=1")),
    Case("MoE LM", "configs/quickstart.yaml", ("data.source=synthetic",),
         ("mesh.pipeline=1", "mesh.context=1", "mesh.tensor=1")),
    Case("long sequences", None, (*TINY_LM, "train.global_batch=8", "train.seq_len=1024"),
         ("mesh.pipeline=1", "mesh.tensor=1")),
    Case("ViT", "configs/vit-digits.yaml", (),
         ("mesh.tensor=1", "pipeline.schedule=1f1b", "pipeline.microbatches=4")),
    Case("user model", USER_MODEL, (), ("mesh.pipeline=1",)),
    Case("GShard enc-dec", "configs/gshard-m4.yaml", (), ("mesh.pipeline=1",)),  # last: the longest compiles
)
COLUMNS = ("model", "ranked", "top-1 ratio", "by round", "Spearman rho", "failed", "#1's rounds", "best's rounds",
           "s")


def ranks(values) -> np.ndarray:
    """Returns each value's rank from 1 (smallest first), tied values given their mean rank."""
    values = np.asarray(values, dtype=float)
    found = np.empty(len(values))
    found[values.argsort(kind="stable")] = np.arange(1, len(values) + 1)
    for value in np.unique(values):
        found[values == value] = found[values == value].mean()
    return found


def spearman(first, second) -> float:
    """Returns Spearman's rank correlation of two equally long sequences; nan for fewer than 2 pairs or a
    constant one."""
    a, b = ranks(first), ranks(second)
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


@contextlib.contextmanager
def loaded(case: Case, more: list[str]):
    """Yields `case`'s config as `nestor plan` loads it (`load_for_plan`), with the overrides `more`. The user
    model's files are written from docs/models.md into a temporary directory, nestor's user code directory
    while it is used."""
    from nestor.cluster.connect import USER_CODE_ENV
    from nestor.orchestrator.planning.candidates import load_for_plan

    overrides = [*case.overrides, *more]
    with tempfile.TemporaryDirectory(prefix="nestor-plan-validation-") as directory:
        path = None if case.config is None else str(ROOT / case.config)
        before = os.environ.get(USER_CODE_ENV)
        if case.config == USER_MODEL:
            path = str(_write_user_model(Path(directory)))
            overrides = [*overrides, f"data.paths=[{Path(directory) / 'train.npz'}]",
                         f"eval.paths=[{Path(directory) / 'heldout.npz'}]"]
            os.environ[USER_CODE_ENV] = directory
        try:
            yield load_for_plan(path, overrides)
        finally:
            if before is None:
                os.environ.pop(USER_CODE_ENV, None)
            else:
                os.environ[USER_CODE_ENV] = before


def _write_user_model(directory: Path) -> Path:
    """Writes docs/models.md's complete example into `directory` (its heredoc files, and the data its python
    block makes); returns its config's path."""
    body = MODELS_DOC.read_text().split("## A complete example", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    for name, text in re.findall(r"cat > (\S+) <<'EOF'\n(.*?)\nEOF", body, re.S):
        (directory / name).write_text(text + "\n")
    (script,) = re.findall(r"python - <<'EOF'\n(.*?)\nEOF", body, re.S)
    subprocess.run([sys.executable, "-"], input=script, text=True, cwd=directory, check=True)
    return directory / "my.yaml"


def validate(case: Case, steps: int, rounds: int, budget_s: float, cache: str, say, command: str = "") -> dict:
    """Returns `case`'s record (`_record`): its search, then every ranked candidate trained `steps` steps in each
    of `rounds` rounds (the search's order, then the reverse, and so on); `say` is told each candidate. Steps
    compile into `cache` (a run.compile_cache), so a candidate's later rounds load its step (where its compile
    took over JAX's threshold for keeping one)."""
    from nestor.orchestrator.planning.candidates import pinned_keys
    from nestor.orchestrator.planning.measure import measure
    from nestor.orchestrator.planning.search import search

    start = time.monotonic()
    with loaded(case, [f"run.compile_cache={cache}"]) as config:
        plan = search(config, pinned_keys(case.overrides), budget_s, lambda line: say(f"{case.name}: planning {line}"))
        measured = []
        for index in range(rounds):
            order = plan.ranked if index % 2 == 0 else plan.ranked[::-1]
            measured.append(measure(config, order, steps,
                                    lambda line, i=index: say(f"{case.name}: round {i + 1}/{rounds} {line}")))
    return _record(case, plan, measured) | {"command": command, "steps": steps, "rounds": rounds,
                                            "seconds": time.monotonic() - start}


def _record(case: Case, plan, rounds: list[list]) -> dict:
    """Returns what a case's search and runs found, as JSON: the search's verdicts and what it did not rank,
    and each ranked candidate's predicted step and its step in each round (fastest predicted first); its
    measured step is the median of its rounds, None where a round failed (the first error kept)."""
    from nestor.orchestrator.planning.candidates import pinned_keys
    from nestor.orchestrator.planning.search import DOMINATED, RANKED, label

    by_round = [{id(m.judged): m for m in measured} for measured in rounds]
    candidates = []
    for j in plan.ranked:
        runs = [found[id(j)] for found in by_round]
        errors = [m.error for m in runs if m.error is not None]
        steps = [m.step_s for m in runs]
        candidates.append({"settings": label(j.candidate), "predicted_s": j.predicted["step_s"],
                           "compute_s": j.predicted["compute_s"],
                           "communication_s": j.predicted["within_host_s"] + j.predicted["across_hosts_s"],
                           "rounds_s": steps, "measured_s": None if errors else statistics.median(steps),
                           "error": errors[0] if errors else None})
    return {"model": case.name, "config": case.config, "size": case.size, "bound": case.bound,
            "pins": sorted(pinned_keys(case.overrides)), "verdicts": dict(Counter(j.verdict for j in plan.judged)),
            "rejections": [{"settings": label(j.candidate), "verdict": j.verdict, "reason": j.reason}
                           for j in plan.judged if j.verdict not in (RANKED, DOMINATED)],
            "compiles": plan.compiles, "search_s": plan.elapsed_s, "candidates": candidates}


def summary(record: dict) -> dict:
    """Returns a record's figures: ranked candidates, the top-1 ratio (the plan's #1's measured step over the
    best measured one) overall and in each round, Spearman's rho, failures, undecided candidates, and the
    spread (slowest round over fastest) of the #1's and the best's rounds."""
    ran = [c for c in record["candidates"] if c["measured_s"] is not None]
    best = min(ran, key=lambda c: c["measured_s"], default=None)
    first = record["candidates"][0] if record["candidates"] else None
    ratio, by_round = None, []
    if best and first["measured_s"] is not None:
        ratio = first["measured_s"] / best["measured_s"]
        by_round = [first["rounds_s"][i] / min(c["rounds_s"][i] for c in ran) for i in range(len(first["rounds_s"]))]

    def spread(candidate):
        return None if candidate is None or candidate["measured_s"] is None else \
            max(candidate["rounds_s"]) / min(candidate["rounds_s"])

    return {"ranked": len(record["candidates"]), "ratio": ratio, "by_round": by_round,
            "rho": spearman([c["predicted_s"] for c in ran], [c["measured_s"] for c in ran]),
            "failed": len(record["candidates"]) - len(ran), "undecided": record["verdicts"].get("undecided", 0),
            "first_spread": spread(first), "best_spread": spread(best), "seconds": record["seconds"]}


def _figure(value, form: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, form)


def table(records: list[dict]) -> str:
    """Returns the records' summaries as a markdown table, one row per model."""
    rows = []
    for record in records:
        s = summary(record)
        ranked = f"{s['ranked']}" + (f" ({s['undecided']} undecided)" if s["undecided"] else "")
        by_round = " ".join(_figure(r, ".2f") for r in s["by_round"]) or "n/a"
        rows.append((record["model"], ranked, _figure(s["ratio"], ".2f"), by_round, _figure(s["rho"], ".2f"),
                     str(s["failed"]), _figure(s["first_spread"], ".2f"), _figure(s["best_spread"], ".2f"),
                     f"{s['seconds']:.0f}"))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def candidates_table(record: dict) -> str:
    """Returns one model's candidates, fastest predicted first, with both steps in ms, then those the search
    did not rank and why."""
    sized = " ".join([record["config"] or "(the defaults)", *record["size"]])
    lines = [f"**{record['model']}**: `{sized}`, pinned `{' '.join(record['bound'])}`", "",
             "| # | settings | predicted ms | measured ms | rounds ms |", "|---:|---|---:|---:|---|"]
    for index, c in enumerate(record["candidates"], 1):
        measured = f"{c['measured_s'] * 1e3:.1f}" if c["measured_s"] is not None else f"failed: {c['error']}"
        rounds = " ".join("failed" if r is None else f"{r * 1e3:.1f}" for r in c["rounds_s"])
        lines.append(f"| {index} | {c['settings']} | {c['predicted_s'] * 1e3:.1f} | {measured} | {rounds} |")
    if record["rejections"]:
        lines += ["", "Not ranked:", *(f"- {r['settings']} ({r['verdict']}: {r['reason']})" for r in record["rejections"])]
    return "\n".join(lines)


def write_markdown(records: list[dict]) -> None:
    """Writes the table, the commands that measured it and each model's candidates to the plan_validation
    section of docs/plan.md."""
    meeting = sum((summary(r)["ratio"] or math.inf) <= TARGET_RATIO for r in records)
    commands = "; ".join(f"`{command}`" for command in dict.fromkeys(r["command"] for r in records))
    lines = [f"Measured by {commands} ({provenance()}; 2-core CPU, {DEVICES} simulated devices as 1 host x "
             f"{DEVICES}, in one process; {records[0]['steps']} steps per candidate and round, the median past the "
             f"first; {records[0]['rounds']} rounds, the median of them; "
             f"every model also pinned `{' '.join(ONE_RUNG)}`).",
             "", table(records), "",
             f"Top-1 ratio at most {TARGET_RATIO:.2f}: {meeting} of {len(records)} models.", "",
             "<details><summary>Every candidate</summary>", "",
             *("\n".join([candidates_table(r), ""]) for r in records), "</details>"]
    write_section("plan_validation", "\n".join(lines), PLAN_DOC)


def main(argv: list[str] | None = None) -> int:
    """Runs the validation (or reads earlier runs' JSON with --from), prints the table; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per candidate and round; the first is not timed")
    parser.add_argument("--rounds", type=int, default=3, help="rounds through every candidate; the median counts")
    parser.add_argument("--budget-s", type=float, default=3600.0, help="each search's budget (none undecided)")
    parser.add_argument("--models", nargs="+", choices=[case.name for case in CASES], help="a subset (default: all)")
    parser.add_argument("--out", type=Path, help="write every measurement here as JSON")
    parser.add_argument("--from", dest="sources", nargs="+", type=Path, help="tabulate earlier runs' --out")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/plan.md alone")
    args = parser.parse_args(argv)
    if args.sources:
        records = [record for source in args.sources for record in json.loads(source.read_text())]
    else:
        command = shlex.join(["python", "-m", "bench.plan_validation", *(argv if argv is not None else sys.argv[1:])])
        records = run(args, command)
    print(table(records))
    for record in records:
        print("\n" + candidates_table(record))
    if not args.no_write:
        write_markdown(records)
    return 0


def run(args, command: str) -> list[dict]:
    """Returns the record of each model `args` names, written to `args.out` after each one."""
    from nestor.cluster.cpu_devices import simulate_cpu_devices_before_import

    simulate_cpu_devices_before_import(DEVICES)
    from nestor.orchestrator.job.processes import configure_jax

    cases = [case for case in CASES if not args.models or case.name in args.models]
    records = []
    with tempfile.TemporaryDirectory(prefix="nestor-plan-validation-cache-") as cache:
        with loaded(cases[0], [f"run.compile_cache={cache}"]) as config:
            configure_jax(config)
        for case in cases:
            records.append(validate(case, args.steps, args.rounds, args.budget_s, cache, _say, command))
            if args.out:
                args.out.write_text(json.dumps(records, indent=1))
    return records


_STARTED = time.monotonic()


def _say(line: str) -> None:
    print(f"plan_validation [{time.monotonic() - _STARTED:5.0f} s] {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
