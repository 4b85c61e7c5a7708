"""Compile time of a real-size train step against its depth: the layer stack is a scan, so
`model.num_layers` should not change it. Depths are compiled alternately in one process, and both
wall and process CPU time are printed (on a shared host, CPU time is the steadier of the two).

    python -m bench.compile_depth --layers 8 32 --repeats 2    # llama3-8b, seq 8192, fsdp8, remat full, for an H100
"""

from __future__ import annotations

import argparse
import time

from nestor.cluster.cpu_devices import simulate_cpu_devices_before_import  # noqa: E402

simulate_cpu_devices_before_import(8)

from nestor.orchestrator.loader.config import load  # noqa: E402
from nestor.orchestrator.commands.explain import compile_step  # noqa: E402
from nestor.orchestrator.job.build import build_job  # noqa: E402
from nestor.orchestrator.loader.memory_fit import GIB  # noqa: E402

# llama3-8b at seq 8192, one sequence per device on fsdp8 (the quickstart's pipeline and MoE off), compiled
# for an H100 as docs/scaling.md's explain commands compile it (the backend's choices for that target).
OVERRIDES = ["model.preset=llama3-8b", "model.dtype=bfloat16", "train.seq_len=8192", "train.global_batch=8",
             "mesh.fsdp=8", "mesh.data=1", "mesh.pipeline=1", "mesh.expert=1", "mesh.tensor=1", "moe.num_experts=0",
             "moe.every=0", "pipeline.microbatches=1", "run.compile_cache=null", "cluster.device_kind=h100"]


def measure(layers: int, remat: str) -> tuple[float, float, int]:
    """Returns (wall seconds, process CPU seconds, temporaries bytes per device) of one compile."""
    config = load("configs/quickstart.yaml", [*OVERRIDES, f"model.num_layers={layers}", f"model.remat={remat}"])
    job = build_job(config, with_data=False)
    wall, cpu = time.perf_counter(), time.process_time()
    compiled = compile_step(job)
    return time.perf_counter() - wall, time.process_time() - cpu, compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--remat", default="full")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("| layers | repeat | compile wall | compile CPU | temporaries |\n| --- | --- | --- | --- | --- |")
    for repeat in range(args.repeats):
        for layers in args.layers:
            wall, cpu, temporaries = measure(layers, args.remat)
            print(f"| {layers} | {repeat} | {wall:.1f} s | {cpu:.1f} s | {temporaries / GIB:.2f} GiB |", flush=True)


if __name__ == "__main__":
    main()
