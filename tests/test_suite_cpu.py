"""bench/suite_cpu.py counts where a command's CPU goes (docs/testing.md's table)."""

import sys
import time

import psutil

from bench.suite_cpu import cpu_since_seen, kind_of, sample


def test_a_process_is_counted_once_from_its_first_sample_and_a_pid_used_again_is_a_new_one():
    me, seen = psutil.Process(), {}
    first = cpu_since_seen(me, seen)
    busy = time.process_time()
    while time.process_time() - busy < 0.2:
        pass
    # psutil reads user and system time in clock ticks (10 ms), each rounded down: 0.2 s may read as 0.18
    assert first == seen[(me.pid, me.create_time())] and 0.175 <= cpu_since_seen(me, seen) < 5
    seen[(me.pid, me.create_time() - 1)] = 1e6  # an earlier process of the same pid
    assert 0 <= cpu_since_seen(me, seen) < 1


def test_a_busy_child_is_counted_under_its_kind_with_its_exit_code(monkeypatch):
    import bench.suite_cpu

    # a kind of its own, first: no other process of the machine is counted with it
    monkeypatch.setattr(bench.suite_cpu, "KINDS", (("the busy child", ("busy-child",)), *bench.suite_cpu.KINDS))
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\nraise SystemExit(3)"
    by_kind, wall_s, code = sample([sys.executable, "-c", busy, "busy-child"], 0.1)
    assert code == 3 and wall_s >= 1.0
    assert 0.8 <= by_kind["the busy child"] <= 1.5  # the last 0.1 s before its exit may fall between samples
    assert kind_of(psutil.Process()) in ("pytest", "pytest worker")  # this test's own process, however started
