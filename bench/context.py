"""Context parallelism: step time and memory of rows split over `mesh.context`, against whole rows.

On 8 devices a model with long rows trains on `mesh.data=8` (each device
holds whole rows) and on meshes that split each row over C context devices
(`mesh.context=C`, `mesh.data=8/C`): the same tokens per device, the same
global batch. For each, both attention strategies (all_gather, ring), and for
C = 8 the contiguous layout beside the balanced one. Steps of every
configuration are interleaved round by round and each row reports the median
step time and its ratio to the whole-row step's, with XLA's temporaries per
device and the bytes of the step's collectives (compile only).

    python -m bench.context --steps 5   # prints the table, writes its section of docs/benchmarks.md

Simulated CPU devices share the host's cores, so a ratio measures total work
and per-collective overhead, not the overlap of a ring step's transfer with
its compute, nor the cost of imbalance (an idle device's time goes to the
busy ones). Whole rows run `jax.nn.dot_product_attention`, which computes every
(query, key) score and masks half; split rows skip the key chunks after a
query chunk.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench.pipeline import Stepper
from bench.report import provenance, write_section

MODEL = ["model.preset=tiny", "model.embed_dim=128", "model.mlp_dim=512", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=32", "train.seq_len=2048", "train.global_batch=8",
         "data.source=synthetic"]
BASE = MODEL + ["run.dir=/tmp/nestor-bench-context", "cluster.devices_per_host=8", "mesh.fsdp=1", "mesh.tensor=1",
                "mesh.expert=1", "mesh.pipeline=1", "run.compile_cache=null"]
COMMAND = "python -m bench.context"
# (name, overrides): whole rows first, the baseline of every ratio
CONFIGS = [("data8, whole rows", ["mesh.data=8", "mesh.context=1"])] + [
    (f"context{c} x data{8 // c}, {strategy}", [f"mesh.context={c}", f"mesh.data={8 // c}",
                                               f"model.context_attention={strategy}"])
    for c in (2, 8) for strategy in ("all_gather", "ring")] + [
    (f"context8, {strategy}, contiguous", ["mesh.context=8", "mesh.data=1", f"model.context_attention={strategy}",
                                           "model.context_balance=false"]) for strategy in ("all_gather", "ring")]
HEADER = ("| mesh, attention | step (ms) | ratio to whole rows | temporaries / device | collectives / step |\n"
          "|---|---:|---:|---:|---|")


def _config(*overrides: str):
    from nestor.orchestrator.loader.config import load

    return load(None, BASE + list(overrides))


def run_bench(steps: int) -> list[dict]:
    """Returns one row per configuration: median step seconds, ratio to whole rows, temporaries, collectives."""
    from nestor.parallel.hlo import collectives

    steppers = [(name, Stepper(_config(*overrides))) for name, overrides in CONFIGS]
    for _, stepper in steppers:
        stepper.seconds()  # warm-up
    times: dict[str, list[float]] = {name: [] for name, _ in steppers}
    for round_index in range(steps):
        order = steppers if round_index % 2 == 0 else steppers[::-1]
        for name, stepper in order:
            times[name].append(stepper.seconds())
    baseline = statistics.median(times[CONFIGS[0][0]])
    rows = []
    for name, stepper in steppers:
        moved = collectives(stepper.compiled.as_text())
        rows.append({"name": name, "step_s": statistics.median(times[name]),
                     "ratio": statistics.median(times[name]) / baseline, "temp_bytes": stepper.temp_bytes,
                     "collectives": {kind: value for kind, value in moved.items() if value["count"]}})
    return rows


def format_row(row: dict) -> str:
    """Returns one markdown table row."""
    moved = ", ".join(f"{kind} {value['count']} x {value['bytes'] / 2**20:.1f} MiB"
                      for kind, value in row["collectives"].items()) or "none"
    return (f"| {row['name']} | {row['step_s'] * 1e3:.0f} | {row['ratio']:.2f} | {row['temp_bytes'] / 2**20:.1f} MiB "
            f"| {moved} |")


def write_markdown(rows: list[dict], steps: int) -> None:
    """Writes the table, the setup and the command to the context section of docs/benchmarks.md."""
    lines = ["## Context parallelism (rows split over `mesh.context`)", "",
             f"Command: `{COMMAND} --steps {steps}` ({provenance()}; 8 simulated CPU devices of a 2-core host; "
             f"{steps} interleaved rounds after a warm-up, medians).", "",
             f"Model: {' '.join(MODEL)} (float32, remat full on CPU).", "", HEADER, *map(format_row, rows), "",
             "Simulated CPU devices share the host's cores: the ratio is total work and per-collective overhead, "
             "not the overlap of a ring step's transfer with its compute, nor the cost of imbalance (an idle "
             "device's time goes to the busy ones; tests/test_context.py counts it instead: each device's chunk "
             "pairs times one pair's FLOPs in XLA's cost analysis, and the compiled program shown to skip the "
             "pairs the causal mask hides). Whole rows run jax.nn.dot_product_attention, which computes every "
             "score and masks the later half; split rows skip the key chunks after each query chunk. No GPU was "
             "lent for this measurement; a single GPU cannot run the ring (it needs C > 1 devices), so the "
             "accelerator numbers wait for a multi-GPU host."]
    write_section("context", "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    from nestor.orchestrator.job.processes import configure_jax

    configure_jax(_config())
    rows = run_bench(args.steps)
    print(HEADER)
    for row in rows:
        print(format_row(row), flush=True)
    if not args.no_write:
        write_markdown(rows, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
