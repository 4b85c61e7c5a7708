"""The top costs of traced steps: device time per operation, read from the Perfetto trace jax writes.

`jax.profiler.trace(dir, create_perfetto_trace=True)` leaves `perfetto_trace.json.gz` (Chrome trace
events) beside the TensorBoard profile. This module sums the duration of every complete event by name
on the device's timelines (`/device:...` processes: a GPU's streams and XLA op lines), or on a CPU
backend on the XLA client threads (not the Python thread), so a benchmark can print where a step's time
goes without TensorBoard. Each timeline (thread) is summed on its own: a GPU trace has a kernel line and
an XLA-op line over the same time, and adding them would count it twice.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

# Kernel and op names by kind, tried in order (cuDNN's attention kernels have "gemm" in their names too).
KINDS = (("attention", re.compile(r"sdpa|fmha|flash|attention", re.I)),
         ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|dot|matmul", re.I)),
         ("collective", re.compile(r"nccl|all-reduce|all-gather|reduce-scatter|all-to-all|collective", re.I)),
         ("copy", re.compile(r"memcpy|memset|copy|transpose|dynamic_update_slice|dynamic-update-slice", re.I)),
         ("sort, gather, scatter", re.compile(r"sort|gather|scatter|dynamic_slice|dynamic-slice", re.I)))


def kind(name: str) -> str:
    """Returns the kind of an op or kernel name: one of KINDS' names, else "elementwise, reductions"."""
    return next((label for label, pattern in KINDS if pattern.search(name)), "elementwise, reductions")


def trace_file(directory: str | Path) -> Path:
    """Returns the newest `perfetto_trace.json.gz` under `directory`; raises FileNotFoundError if none."""
    found = sorted(Path(directory).rglob("perfetto_trace.json.gz"), key=lambda path: path.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    return found[-1]


def device_timelines(path: str | Path) -> dict[str, collections.Counter]:
    """Returns, per device timeline ("process / thread"), microseconds summed per event name."""
    with gzip.open(path, "rt") as handle:
        data = json.load(handle)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"]
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    on_device = any(name.startswith("/device:") for name in processes.values())
    timelines: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        process = processes.get(event["pid"], "")
        thread = threads.get((event["pid"], event["tid"]), str(event["tid"]))
        if on_device:
            wanted = process.startswith("/device:")
        else:  # XLA:CPU runs a program on its client's and Eigen's threads, named so
            wanted = "XLA" in thread
        if wanted:
            timelines[f"{process} / {thread}"][event["name"]] += float(event["dur"])
    return timelines


def summary(directory: str | Path, steps: int, top: int = 12) -> list[str]:
    """Returns printable lines: per device timeline, its busy ms per step, the shares of each kind of
    op, and its `top` operations (ms per step and share of the timeline's busy time). Writes every
    operation's cost to `directory`/costs.tsv (timeline, kind, ms per step, name), costliest first."""
    lines = []
    timelines = device_timelines(trace_file(directory))
    rows = sorted(((micros, timeline, name) for timeline, costs in timelines.items() for name, micros in costs.items()),
                  reverse=True)
    (Path(directory) / "costs.tsv").write_text("".join(
        f"{timeline}\t{kind(name)}\t{micros / steps / 1e3:.4f}\t{name}\n" for micros, timeline, name in rows))
    for timeline, costs in sorted(timelines.items()):
        busy = sum(costs.values())
        if busy == 0:  # only instantaneous events: nothing to share out
            continue
        kinds = collections.Counter()
        for name, micros in costs.items():
            kinds[kind(name)] += micros
        lines.append(f"{timeline}: {busy / steps / 1e3:.2f} ms busy per step; "
                     + ", ".join(f"{label} {micros / busy:.1%}" for label, micros in kinds.most_common()))
        for name, micros in costs.most_common(top):
            lines.append(f"  {micros / steps / 1e3:9.3f} ms {micros / busy:6.1%}  {name[:110]}")
    return lines
