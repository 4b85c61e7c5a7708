"""The hang watchdog (orchestrator/loop/hang.py): its limit and clock, its stacks, and a hung run in one process.
The Ray launcher's case (a worker stopped with SIGSTOP) is tests/test_cluster.py's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nestor.orchestrator.loop import hang
from nestor.orchestrator.loop.hang import AUTO_FLOOR_S, AUTO_STEPS, POLL_S, HangWatchdog, native_stacks_text
from tests.settings import ROOT
from tests.helpers import child_env, ended


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watchdog(tmp_path, timeout_s, clock) -> HangWatchdog:
    return HangWatchdog(timeout_s, tmp_path / "hangs" / "attempt", 0, 1, clock=clock, watch=False,
                        preamble=hang.xla_cpu_patience("cpu"))


def test_a_wait_past_the_limit_is_overdue_and_says_what_it_waited_for(tmp_path):
    clock = Clock()
    dog = watchdog(tmp_path, 30, clock)
    dog.beat("step 7")
    clock.now += 30
    assert dog.overdue() is None
    clock.now += 1
    assert dog.overdue() == "waited 31 s for step 7 (run.hang_timeout_s: 30 s)"
    dog.beat("step 8", step_done=True)
    assert dog.overdue() is None


def test_the_automatic_limit_is_a_multiple_of_the_median_step_with_a_floor(tmp_path):
    clock = Clock()
    dog = watchdog(tmp_path, None, clock)
    assert dog.limit_s() == AUTO_FLOOR_S  # no step yet: the first steps after a compile
    for seconds in (40.0, 50.0, 45.0, 1.0):  # a step interval, each
        clock.now += seconds
        dog.beat("the next step", step_done=True)
    assert dog.limit_s() == AUTO_STEPS * 42.5
    clock.now += 1.0
    dog.beat("the save", step_done=False)  # not a step's interval: the median stays
    assert dog.limit_s() == AUTO_STEPS * 42.5
    assert watchdog(tmp_path, 0, clock).overdue() is None and watchdog(tmp_path, 0, clock)._thread is None


def test_paused_blocks_are_not_watched_and_restart_the_clock(tmp_path):
    clock = Clock()
    dog = watchdog(tmp_path, 10, clock)
    with dog.paused():
        clock.now += 100  # a compile
        assert dog.overdue() is None
    assert dog.overdue() is None
    clock.now += 11
    assert dog.overdue() is not None


def test_the_stacks_file_holds_every_threads_stack(tmp_path):
    blocked = threading.Event()

    def waits_for_a_peer():
        blocked.wait()

    thread = threading.Thread(target=waits_for_a_peer, name="peer-waiter", daemon=True)
    thread.start()
    path = watchdog(tmp_path, 10, Clock()).write_stacks("hung: waited 11 s for step 3")
    blocked.set()
    text = path.read_text()
    assert path == tmp_path / "hangs" / "attempt" / "process-0.txt"
    assert text.startswith("process 0 of 1, pid ") and "hung: waited 11 s for step 3" in text.splitlines()[0]
    # how long XLA:CPU lets this process's collectives wait (the suite's XLA_FLAGS: a day); nothing on a GPU
    assert text.splitlines()[1] == ("XLA:CPU's collective timeouts: xla_cpu_collective_call_terminate_timeout_seconds="
                                    "86400 s, xla_cpu_collective_timeout_seconds=86400 s")
    assert hang.xla_cpu_patience("cuda") == ""
    assert "--- thread peer-waiter" in text and "in waits_for_a_peer" in text
    assert "--- thread MainThread" in text and "in test_the_stacks_file_holds_every_threads_stack" in text


def test_native_stacks_show_the_c_frames_under_a_waiting_thread_and_name_a_missing_tool(tmp_path, monkeypatch):
    original_tool = hang._tool
    blocked = threading.Event()
    thread = threading.Thread(target=lambda: blocked.wait(), name="native-waiter", daemon=True)
    thread.start()
    # py-spy alone (a test dependency): gdb on this process would load jaxlib's symbols for a minute
    monkeypatch.setattr(hang, "_tool", lambda name: original_tool(name) if name == "py-spy" else None)
    try:
        text = native_stacks_text()
    finally:
        blocked.set()
    assert text.startswith("=== py-spy ") and "=== gdb" not in text
    waiter = next(block for block in text.split("\nThread ") if '"native-waiter"' in block.splitlines()[0])
    # the waiting thread's Python frame and, under it, the C call it waits in
    assert "Event.wait" in waiter and re.search(r"\((?:libc|libpython)[^)]*\)", waiter), waiter
    assert "test_native_stacks_show_the_c_frames" in text
    monkeypatch.setattr(hang, "_tool", original_tool)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # no py-spy beside it
    monkeypatch.setenv("PATH", str(tmp_path))
    assert native_stacks_text().startswith("neither py-spy nor gdb was found")


@pytest.mark.skipif(not shutil.which("timeout"), reason="coreutils `timeout` ends a dump past its time")
def test_a_native_dump_that_fails_is_tried_again_then_the_python_frames_alone_are_dumped(tmp_path, monkeypatch):
    """py-spy's --native dump fails now and then ("Failed to merge native and python frames"): each failure
    is named, and after NATIVE_TRIES the plain dump still shows the threads; a --native dump past its time
    goes straight to the plain one, in the time kept for it; a tool past its limit is named as timed out."""
    def tool(name: str, script: str) -> None:
        (tmp_path / name).write_text(f"#!/bin/sh\n{script}\n")
        (tmp_path / name).chmod(0o755)

    plain = "echo 'Thread 7 (idle): \"MainThread\"'"
    tool("py-spy", f'case "$*" in *--native*) echo "Error: Failed to merge native and python frames"; exit 1;; '
                   f"esac\n{plain}")
    tool("gdb", "sleep 30")
    monkeypatch.setattr(hang, "_tool", lambda name: str(tmp_path / name))
    text = native_stacks_text(timeout_s=4)
    py_spy, gdb = text.split("=== gdb ")
    assert py_spy.count("(py-spy --native exited 1)") == hang.NATIVE_TRIES
    assert py_spy.count("Failed to merge") == hang.NATIVE_TRIES and py_spy.rstrip().endswith('"MainThread"')
    assert "(gdb timed out after 4 s)" in gdb

    tool("py-spy", f'case "$*" in *--native*) sleep 30;; esac\n{plain}')
    monkeypatch.setattr(hang, "_tool", lambda name: str(tmp_path / name) if name == "py-spy" else None)
    started = time.monotonic()
    text = native_stacks_text(timeout_s=4)
    assert time.monotonic() - started < 4 + 2, text  # the tries share the tool's limit
    assert text.count("(py-spy --native timed out after 3 s)") == 1 and text.rstrip().endswith('"MainThread"'), text


# A run whose batch of step 4 never comes: the watchdog ends it with its stacks.
HUNG_RUN = textwrap.dedent("""
    import sys, threading
    from nestor.orchestrator.loop import train as train_module
    from nestor.orchestrator.loader.config import load
    from nestor.orchestrator.job.processes import configure_jax

    config = load(None, ["model.preset=tiny", "data.source=synthetic", "train.steps=50", "train.global_batch=8",
                         "train.seq_len=32", "cluster.launcher=inprocess", "run.hang_timeout_s=4",
                         "checkpoint.every=0", f"run.dir={sys.argv[1]}", "mesh.data=-1"])
    configure_jax(config)
    build_job = train_module.build_job

    def with_a_stuck_batch(*args):
        job = build_job(*args)
        batch = job.data.batch

        def stuck_at_step_4(step):
            if step == 3:
                print("stuck", flush=True)
                threading.Event().wait()  # a read that never returns
            return batch(step)

        job.data.batch = stuck_at_step_4
        return job

    train_module.build_job = with_a_stuck_batch
    train_module.train(config)
""")


@pytest.mark.slow
def test_a_step_past_hang_timeout_ends_the_run_with_its_stacks_in_run_dir_hangs(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", HUNG_RUN, str(run_dir)], cwd=ROOT, env=child_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:  # the run's own lines, then the marker
        if line == "stuck\n":
            break
    stuck = time.monotonic()
    while not list((run_dir / "hangs").glob("*/process-0.txt")) and time.monotonic() - stuck < 60:
        time.sleep(0.1)
    seconds = time.monotonic() - stuck
    out, err = ended(process, 300)
    assert process.returncode == 1, err[-3000:]
    # values are read one step late: when step 4's batch is made, step 3 is the one not yet seen to end
    line = re.search(r"nestor: process 0 hung: waited (\d+) s for step 3 \(run.hang_timeout_s: 4 s\); the stacks "
                     r"of every thread are in (\S+) and native-0.txt", err)
    assert line, err[-3000:]
    # the limit, then at most one poll of the watchdog (and a loaded machine's scheduling)
    assert 4 <= seconds <= 4 + POLL_S + 3, seconds
    stacks = (run_dir / "hangs").glob("*/process-0.txt")
    path = next(stacks)
    assert str(path) == line.group(2) and "in stuck_at_step_4" in path.read_text()
    native = (path.parent / "native-0.txt").read_text()  # the same wait, its C frames with it
    assert native.startswith("process 0 of 1, pid ") and "=== py-spy" in native and "stuck_at_step_4" in native
    if shutil.which("gdb"):  # every thread's backtrace, XLA's pool threads among them
        assert "=== gdb" in native
        assert len(re.findall(r"^Thread \d+ \(Thread ", native, re.M)) > 8, native[-3000:]


def test_xla_cpus_collective_timeouts_are_set_past_the_watchdogs_limit(tiny_config, monkeypatch):
    """XLA:CPU ends a process whose collective waits 40 s ("Aborted", no stacks): a run's CPU processes wait
    past run.hang_timeout_s so that the watchdog reports the hang; XLA's own limits where the watchdog is off."""
    from nestor.cluster.cpu_devices import (COLLECTIVE_TIMEOUTS, collective_timeouts, simulate_cpu_devices,
                                            with_collective_timeouts)
    from nestor.orchestrator.commands.ray_driver import cluster_spec
    from nestor.orchestrator.job.processes import AUTO_LIMIT_COLLECTIVE_S, WATCHDOG_MARGIN_S, collective_timeout_s

    # one value up to a day (XLA_FLAGS key jax's compilation cache: a resume with another limit loads its programs)
    for limit in ("45", "null", "3600"):
        assert collective_timeout_s(tiny_config(f"run.hang_timeout_s={limit}")) == AUTO_LIMIT_COLLECTIVE_S
    assert collective_timeout_s(tiny_config("run.hang_timeout_s=90000")) == 90000 + WATCHDOG_MARGIN_S
    assert collective_timeout_s(tiny_config("run.hang_timeout_s=1e12")) == 2**31 - 1  # XLA's flags are int32
    assert collective_timeout_s(tiny_config("run.hang_timeout_s=0")) is None
    assert cluster_spec(tiny_config("run.hang_timeout_s=45")).collective_timeout_s == AUTO_LIMIT_COLLECTIVE_S
    flags = with_collective_timeouts("--a=1 --xla_cpu_collective_timeout_seconds=9000", 645)
    assert flags == ("--a=1 --xla_cpu_collective_call_terminate_timeout_seconds=645 "
                     "--xla_cpu_collective_timeout_seconds=9000")  # a larger one set before is kept
    assert "--xla_cpu_collective_timeout_seconds=1800" in with_collective_timeouts("", 645)  # XLA's default kept
    assert collective_timeouts(flags) == {"xla_cpu_collective_call_terminate_timeout_seconds": 645,
                                          "xla_cpu_collective_timeout_seconds": 9000}
    assert collective_timeouts("--a=1") == COLLECTIVE_TIMEOUTS  # XLA's own: 40 s, then "Aborted"

    class Jax:  # what simulate_cpu_devices asks of jax
        config = type("Config", (), {"update": staticmethod(lambda name, value: None)})

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("PJRT_NPROC", os.environ.get("PJRT_NPROC", "1"))  # restored after: it sizes the pool
    monkeypatch.setattr("nestor.cluster.cpu_devices.one_program_at_a_time", lambda jax: None)
    simulate_cpu_devices(Jax, 4, 645)
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=645" in os.environ["XLA_FLAGS"]
