"""How each mesh lays out a model: bytes per device against the ideal,
collective bytes per step, XLA FLOPs against the analytic count, and step
time as a ratio to the same model on one device, measured in the same run.

    python -m bench.sharding --presets tiny 125m    # prints the tables, writes its section of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from nestor.cluster.cpu_devices import simulate_cpu_devices_before_import  # noqa: E402

simulate_cpu_devices_before_import(8)
import jax  # noqa: E402

from bench.report import write_section  # noqa: E402
from nestor.orchestrator.loader import config as config_lib  # noqa: E402
from nestor.orchestrator.errors import ConfigError  # noqa: E402
from nestor.orchestrator.commands.explain import explain  # noqa: E402
from nestor.orchestrator.job.build import build_job  # noqa: E402
from nestor.orchestrator.job.state import init_state  # noqa: E402

MESHES = {
    "1 device": dict(devices=1),
    "data8": dict(data=8),
    "fsdp8": dict(fsdp=8),
    "fsdp4 x tensor2": dict(fsdp=4, tensor=2),
    "data2 x fsdp2 x tensor2": dict(data=2, fsdp=2, tensor=2),
    "tensor8": dict(tensor=8),
}
SHAPES = {  # batch and length per preset: small enough to time on 2 CPU cores
    "tiny": dict(global_batch=16, seq_len=64),
    "125m": dict(global_batch=8, seq_len=128),
}


def config_for(preset: str, mesh: dict) -> config_lib.Config:
    devices = mesh.get("devices", 8)
    degrees = {axis: mesh.get(axis, 1) for axis in ("data", "fsdp", "tensor", "expert", "pipeline")}
    overrides = [f"model.preset={preset}", f"cluster.devices_per_host={devices}",
                 *(f"mesh.{axis}={size}" for axis, size in degrees.items()),
                 *(f"train.{key}={value}" for key, value in SHAPES[preset].items())]
    return config_lib.load(None, overrides)


def step_seconds(config: config_lib.Config, steps: int) -> float:
    """Returns the median wall time of `steps` train steps after one warm-up step."""
    job = build_job(config)
    state = init_state(config, job.layout)
    times = []
    for step in range(steps + 1):
        batch = job.data.batch(step)
        start = time.perf_counter()
        state, metrics = job.step_fn(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def ideal_state_bytes(report: dict, devices: int) -> float:
    """Params + two Adam moments, with every parameter the mesh shards at all split evenly over all devices."""
    ideal = 0.0
    for row in report["params"]:
        sharded = row["bytes_per_device"] < row["bytes_total"]
        ideal += 3 * (row["bytes_total"] / devices if sharded else row["bytes_total"])
    return ideal


def measure(preset: str, steps: int) -> list[dict]:
    rows, baseline = [], None
    for name, mesh in MESHES.items():
        try:
            config = config_for(preset, mesh)
        except ConfigError as error:
            rows.append({"mesh": name, "skipped": "; ".join(f"{k}: {m.split(',')[0]}" for k, m in error.problems)})
            continue
        report = explain(config)
        memory = report["memory_per_device_bytes"]
        seconds = step_seconds(config, steps) if steps else float("nan")
        baseline = seconds if baseline is None else baseline
        rows.append({
            "mesh": name,
            "state_mib": (memory["params"] + memory["optimizer"]) / 2**20,
            "ideal_mib": ideal_state_bytes(report, report["mesh"]["devices"]) / 2**20,
            "temp_mib": memory["temporaries"] / 2**20,
            "collective_mib": sum(c["bytes"] for c in report["collectives"].values()) / 2**20,
            "collectives": ", ".join(f"{k} {v['count']}" for k, v in report["collectives"].items() if v["count"]),
            "flops_ratio": report["flops_per_step"] / report["model_flops_per_step"],
            "time_ratio": seconds / baseline,
            "seconds": seconds,
        })
        print(f"  {preset} {name}: done", file=sys.stderr, flush=True)
    return rows


def table(preset: str, rows: list[dict]) -> str:
    shape = SHAPES[preset]
    lines = [f"### {preset} (global batch {shape['global_batch']}, seq {shape['seq_len']}, float32)", "",
             "| mesh | params+Adam MiB/device | ideal | temporaries MiB | collective MiB/step | collectives/step "
             "| XLA / model FLOPs | step time vs 1 device |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['mesh']} | not divisible: {r['skipped']} | | | | | | |")
            continue
        lines.append(f"| {r['mesh']} | {r['state_mib']:.2f} | {r['ideal_mib']:.2f} | {r['temp_mib']:.2f} | "
                     f"{r['collective_mib']:.2f} | {r['collectives'] or '-'} | {r['flops_ratio']:.3f} | "
                     f"{r['time_ratio']:.2f} ({r['seconds'] * 1e3:.0f} ms) |")
    return "\n".join(lines)


READING = (
    "Reading: bytes per device are exact (shard shapes; XLA's memory analysis for temporaries); the ideal splits "
    "every parameter a mesh shards at all over every device, so data parallelism, which replicates by design, is "
    "its own ideal and data2 x fsdp2 x tensor2 sits at twice it. Collectives are read from the compiled HLO with "
    "loop bodies counted once per iteration. XLA FLOPs are XLA's cost analysis of the compiled step with each loop "
    "body counted once per iteration (XLA alone counts it once; `nestor explain` scales it by its trip count) and "
    "include the masked half of causal attention and the optimizer, hence the ratio above 1. "
    "Step times are 8 simulated devices sharing 2 cores: the ratio shows the cost of the extra collectives and "
    "smaller matmuls, not a speed-up.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "125m"], choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mesh (0: no timing)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    tables = [table(preset, measure(preset, args.steps)) for preset in args.presets]
    text = "\n\n".join(tables)
    print(text)
    if args.no_write:
        return
    command = "python -m bench.sharding " + " ".join(sys.argv[1:])
    write_section("sharding", f"## Sharding (GSPMD meshes)\n\nCommand: `{command}` ({jax.devices()[0].device_kind}, "
                              f"8 simulated devices on {os.cpu_count()} cores, jax {jax.__version__})\n\n{text}\n\n{READING}")


if __name__ == "__main__":
    main()
