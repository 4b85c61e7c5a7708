"""Where a command's CPU goes, by kind of process: the test suite's xdist workers, nestor's command-line runs,
Ray's workers and daemons, the tools the hang watchdog starts. Every process of the machine is sampled each
`--every` seconds while the command runs (Ray's kept heads leave their commands' process trees, so
descendants alone would miss them): on a quiet machine, the figures are the command's. A process's CPU
after its last sample is lost, so short-lived ones count a little low.

    python -m bench.suite_cpu --out suite-cpu.json -- python -m pytest -q -n 2 -p no:cacheprovider
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

# (kind, the words of a process's name or command line that make it one), the first that matches
KINDS = (
    ("pytest worker", ("import sys;exec(eval(sys.stdin.readline()))",)),
    ("nestor command", ("bin/nestor ", "nestor.orchestrator.commands.cli", "-m nestor")),
    ("Ray worker group", ("ray::GroupWorker",)),
    ("Ray's board and mailbox", ("ray::Board", "ray::Mailbox")),
    ("Ray idle worker", ("ray::IDLE", "default_worker.py")),
    ("Ray dashboard", ("ray-dashboard", "ray/dashboard", "ray::DashboardAgent")),
    ("Ray daemons", ("gcs_server", "raylet", "log_monitor.py", "monitor.py", "ray::RuntimeEnvAgent",
                     "ray.util.client.server", "bin/ray ")),
    ("pytest", ("-m pytest", "bin/pytest ")),
    ("native stacks (py-spy, gdb)", ("py-spy", "gdb")),
    ("other Python", ("python",)),
)


def kind_of(process: psutil.Process) -> str:
    """Returns the kind of `process` (KINDS), else `other: NAME`."""
    words = f"{process.name()} {' '.join(process.cmdline())}"
    return next((kind for kind, marks in KINDS if any(mark in words for mark in marks)), f"other: {process.name()}")


def cpu_since_seen(process: psutil.Process, seen: dict[tuple[int, float], float]) -> float:
    """Returns the CPU-seconds (user + system) `process` used since `seen` last recorded it, all of them at
    first sight, and records them: `seen` is keyed by (pid, start time), so a pid used again is a new process
    and a process's last sample counts after it exits. Raises psutil.Error for a process that is gone."""
    key, times = (process.pid, process.create_time()), process.cpu_times()
    used = times.user + times.system - seen.get(key, 0.0)
    seen[key] = times.user + times.system
    return used


def sample(command: list[str], every_s: float) -> tuple[dict[str, float], float, int]:
    """Runs `command` and returns (CPU-seconds by kind, its wall seconds, its exit code)."""
    seen: dict[tuple[int, float], float] = {}
    for process in psutil.process_iter():  # what ran before the command counts from now
        with contextlib.suppress(psutil.Error):
            cpu_since_seen(process, seen)
    by_kind: collections.Counter = collections.Counter()
    started = time.monotonic()
    child = subprocess.Popen(command)
    while True:
        done = child.poll() is not None
        for process in psutil.process_iter():
            if process.pid == os.getpid():
                continue
            with contextlib.suppress(psutil.Error):
                by_kind[kind_of(process)] += cpu_since_seen(process, seen)
        if done:
            return dict(by_kind.most_common()), time.monotonic() - started, child.returncode
        time.sleep(every_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON")
    parser.add_argument("command", nargs="+", help="the command, after --")
    args = parser.parse_args(argv)
    by_kind, wall_s, code = sample(args.command, args.every)
    total = sum(by_kind.values())
    print(f"{wall_s:.0f} s wall, {total:.0f} CPU-seconds ({total / wall_s:.2f} cores busy on average), exit {code}")
    for kind, seconds in by_kind.items():
        if seconds >= 0.5:
            print(f"{seconds:8.1f}  {seconds / total:6.1%}  {kind}")
    if args.out:
        args.out.write_text(json.dumps({"command": args.command, "wall_s": wall_s, "exit": code,
                                        "cpu_s_by_kind": by_kind}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
