"""run.dir/nestor.lock: one run at a time; a lock whose holder is gone is taken over."""

import json
import os
import socket
import subprocess
import sys

import pytest

from nestor.orchestrator.config import ConfigError
from nestor.orchestrator.run_lock import LOCK_NAME, RunDirLock, _start_ticks
from tests.helpers import last_lines_of_two_processes


def _write_lock(run_dir, pid: int, **more) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = {"pid": pid, "host": socket.gethostname(), "started": "then", **more}
    (run_dir / LOCK_NAME).write_text(json.dumps(holder))


def test_a_held_lock_refuses_a_second_holder_naming_pid_and_host(tmp_path):
    with RunDirLock(tmp_path / "run", log=lambda line: None):
        with pytest.raises(ConfigError) as refused:
            RunDirLock(tmp_path / "run").__enter__()
    [(key, message)] = refused.value.problems
    assert key == "run.dir" and LOCK_NAME in message
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released on exit
    with RunDirLock(tmp_path / "run"):  # and free again
        assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_stale_lock_of_a_dead_pid_is_taken_over_saying_whose(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(tmp_path / "run", dead.pid)
    said = []
    with RunDirLock(tmp_path / "run", log=said.append):
        holder = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid()
    assert len(said) == 1 and f"pid {dead.pid} on host {socket.gethostname()} (since then)" in said[0]


def test_a_live_pid_on_this_host_is_refused_even_without_a_flock(tmp_path):
    # A file system that ignores flock: the pid of a live process on this host still holds the run.dir.
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path / "run", alive.pid)
        with pytest.raises(ConfigError, match=f"pid {alive.pid} on host"):
            RunDirLock(tmp_path / "run").__enter__()
    finally:
        alive.kill()
        alive.wait()
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == alive.pid  # left as it was


def test_a_lock_whose_pid_now_names_another_process_is_taken_over(tmp_path):
    # A run killed with -9 left its file; its pid now belongs to a live process that started later.
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path / "run", later.pid, start_ticks=_start_ticks(later.pid) - 1)
        said = []
        with RunDirLock(tmp_path / "run", log=said.append):
            assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        later.kill()
        later.wait()
    assert len(said) == 1 and "took over" in said[0] and f"pid {later.pid}" in said[0]


def test_a_run_dir_that_cannot_hold_a_lock_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "run").write_text("a file where the run directory should be")
    with pytest.raises(ConfigError) as refused:
        RunDirLock(tmp_path / "run").__enter__()
    [(key, message)] = refused.value.problems
    assert key == "run.dir" and str(tmp_path / "run" / LOCK_NAME) in message


AGREE_ON_THE_LOCK = """
    from nestor.orchestrator.config import ConfigError
    from nestor.orchestrator.run_lock import holding_run_dir
    try:
        with holding_run_dir(Path(run_dir), True, print):
            print("held")
    except ConfigError as error:
        print(error.problems[0][0], error.problems[0][1])
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_process_of_a_multi_process_run_stops_when_process_0_is_refused(tmp_path):
    with RunDirLock(tmp_path / "run", log=lambda line: None):
        last = last_lines_of_two_processes(AGREE_ON_THE_LOCK, [tmp_path / "run"] * 2)
    assert last[0].startswith("run.dir ") and f"pid {os.getpid()} on host" in last[0]  # process 0 says whose
    assert last[1].startswith("run.dir ") and "in use by another run" in last[1]  # process 1 stops as well
