"""The XLA:CPU pipeline hang under stress: how many fresh pipeline4 x fsdp2 1F1B runs hang.

Each run builds and compiles the suite's `pipeline4_fsdp2_1f1b` case (tests/test_pipeline.py) afresh and
trains its 5 steps in this process, beside `--hogs` busy processes (the other xdist worker of a suite). A
run that stalls past `--hang-s` is ended by nestor's hang watchdog, which writes every thread's Python and
native stacks (orchestrator/loop/hang.py) to the run's `hangs/` folder; the stress loop counts it, keeps the
folder under `--out` and goes on in a fresh process.

    python -m bench.pipeline_hang --runs 100 --hogs 2 --out /tmp/pipeline-hang
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from nestor.cluster.cpu_devices import simulate_cpu_devices_before_import
from nestor.orchestrator.loop.hang import GRACE_S

CASE = ["model.preset=tiny", "train.steps=5", "train.global_batch=16", "train.seq_len=32",
        "optimizer.warmup_steps=2", "optimizer.eps=1e-6", "data.source=synthetic", "checkpoint.every=0",
        "mesh.pipeline=4", "mesh.fsdp=2", "mesh.data=1", "mesh.tensor=1", "mesh.expert=1", "mesh.context=1",
        "pipeline.microbatches=8", "pipeline.schedule=1f1b", "run.compile_cache=null"]
STUCK_MARGIN_S = 300.0  # past a hang's limit and the watchdog's grace: longer than any compile of this case
# The compile flags the hang was seen with (the suite's until it also turned XLA:CPU's fusion emitters off).
SUITE_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_collective_call_terminate_timeout_seconds=900 "
               "--xla_cpu_collective_timeout_seconds=900")


def _hog() -> None:
    while True:
        pass


def child(runs: int, hang_s: float, out: Path, extra: list[str]) -> None:
    """Trains `runs` fresh runs one after another, printing `ok <seconds>` after each."""
    simulate_cpu_devices_before_import(8)
    import jax

    from nestor.cluster.cpu_devices import one_program_at_a_time
    from nestor.orchestrator.loader.config import load
    from nestor.orchestrator.loop.console import Console
    from nestor.orchestrator.loop.train import train

    one_program_at_a_time(jax)
    for _ in range(runs):
        run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=out))
        config = load(None, [*CASE, f"run.hang_timeout_s={hang_s:g}", f"run.dir={run_dir}", *extra])
        started = time.perf_counter()
        train(config, console=Console.silent())
        jax.clear_caches()  # the next run compiles its step afresh, as each test does
        shutil.rmtree(run_dir)
        print(f"ok {time.perf_counter() - started:.1f}", flush=True)


def stress(runs: int, hogs: int, hang_s: float, out: Path, extra: list[str]) -> tuple[int, int, float]:
    """Returns (runs done, hangs, seconds): fresh processes train until `runs` runs ended, each hang's
    folder kept in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    busy = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(hogs)]
    for process in busy:
        process.start()
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {SUITE_FLAGS}".strip())
    done = hangs = 0
    started = time.monotonic()
    try:
        while done < runs:
            command = [sys.executable, "-m", "bench.pipeline_hang", "--child", str(runs - done),
                       "--hang-s", str(hang_s), "--out", str(out), *extra]
            process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True,
                                       cwd=Path(__file__).resolve().parent.parent)
            lines: queue.Queue = queue.Queue()
            reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True)
            reader.start()
            last = time.monotonic()
            while reader.is_alive() or not lines.empty():  # until the child's output ends
                try:
                    line = lines.get(timeout=1.0)
                except queue.Empty:  # a run stuck where the watchdog does not look (its compile) is ended here
                    if time.monotonic() - last > hang_s + GRACE_S + STUCK_MARGIN_S:
                        process.kill()
                        raise SystemExit(f"run {done + 1} made no progress in {time.monotonic() - last:.0f} s and "
                                         "its watchdog did not end it: killed")
                    continue
                last = time.monotonic()
                if line.startswith("ok "):
                    done += 1
                    print(f"run {done}/{runs}: {line.split()[1]} s ({hangs} hang(s) so far)", flush=True)
            if process.wait() != 0:
                hung = sorted(out.glob("run-*/hangs/*"))
                if not hung:
                    raise SystemExit(f"a run failed without a hang (exit {process.returncode})")
                done, hangs = done + 1, hangs + 1
                kept = out / f"hang-{hangs}"
                shutil.move(str(hung[0]), kept)
                print(f"run {done}/{runs}: HUNG, stacks in {kept}", flush=True)
            for left in out.glob("run-*"):
                shutil.rmtree(left, ignore_errors=True)
    finally:
        for process in busy:
            process.terminate()
    return done, hangs, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside the runs")
    parser.add_argument("--hang-s", type=float, default=60.0, help="a step stalled this long has hung")
    parser.add_argument("--out", type=Path, default=Path("/tmp/nestor-pipeline-hang"))
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE on top of the case, e.g. a remedy to try")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.hang_s, args.out, args.overrides)
        return
    done, hangs, seconds = stress(args.runs, args.hogs, args.hang_s, args.out, args.overrides)
    print(f"{done} runs, {hangs} hang(s), {seconds / 60:.1f} min, {args.hogs} hog(s), overrides {args.overrides}")


if __name__ == "__main__":
    main()
