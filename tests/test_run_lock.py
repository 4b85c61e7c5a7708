"""run.dir/nestor.lock: one run at a time; a lock whose holder is gone is taken over; run.dir is nestor's."""

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nestor.orchestrator.commands.cli import main
from nestor.orchestrator.loader.config import load
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.checkpoint.run_lock import LOCK_NAME, MARKER, RunDirLock, _start_ticks, claim_run_dir
from tests.helpers import last_lines_of_two_processes
from tests.test_checkpoint import BASE


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
    assert key == "run.dir" and message.endswith("run is a file, not a directory; choose a new or empty directory")


AGREE_ON_THE_LOCK = """
    from nestor.orchestrator.errors import ConfigError
    from nestor.orchestrator.checkpoint.run_lock import holding_run_dir
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


def _contents(directory: Path) -> dict[str, str]:
    """Maps every file under `directory` to its SHA-256 (directories by name)."""
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
            for path in sorted(directory.rglob("*"))}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project directory, the working directory, with files of its own (a config.yaml among them)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("model:\n  preset: tiny\n")
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "checkpoints").mkdir()  # a framework of theirs keeps these
    (tmp_path / "checkpoints" / "model.pt").write_bytes(b"\0weights")
    return tmp_path


def test_an_empty_run_dir_is_a_config_error_and_the_working_directory_is_unchanged(project, capsys):
    before = _contents(project)
    assert main(["train", "config.yaml", *BASE, "run.dir="]) == 2
    assert "run.dir: expected a non-empty string" in capsys.readouterr().err
    assert _contents(project) == before


@pytest.mark.parametrize("key", ["data.tokenizer", "cluster.address", "model.preset", "run.compile_cache",
                                 "model.init_from", "data.paths"])
def test_no_path_key_takes_an_empty_string(key):
    with pytest.raises(ConfigError) as refused:
        load(None, [f"{key}="])
    assert [problem[0] for problem in refused.value.problems] == [key]


@pytest.mark.parametrize("launcher", ["inprocess", "ray"])
def test_a_directory_of_the_users_is_refused_as_run_dir_before_anything_is_written(project, capsys, launcher):
    before = _contents(project)
    assert main(["train", "config.yaml", *BASE, "run.dir=.", f"cluster.launcher={launcher}"]) == 2
    err = capsys.readouterr().err
    assert "run.dir: . holds files that are not a nestor run (checkpoints, config.yaml, notes.txt)" in err, err
    assert _contents(project) == before


def test_a_run_dir_that_is_a_file_or_under_one_or_unwritable_is_one_config_error(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    cases = [(tmp_path / "file", "is a file, not a directory"), (tmp_path / "file" / "run", "Not a directory"),
             (tmp_path / "readonly" / "run", "Permission denied")]
    real_mkdir = Path.mkdir

    def mkdir(path, *args, **kwargs):  # a read-only parent (chmod does not stop root, who runs CI)
        if path.parent.name == "readonly":
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    for run_dir, said in cases:
        with pytest.raises(ConfigError) as refused:
            claim_run_dir(run_dir)
        [(key, message)] = refused.value.problems
        assert key == "run.dir" and said in message, message
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_new_an_empty_and_an_older_nestor_run_dir_are_taken_and_marked(tmp_path):
    older = tmp_path / "older"  # a run of a nestor from before the marker
    (older / "checkpoints").mkdir(parents=True)
    (older / "config.yaml").write_text("run: {dir: older}\nmesh: {data: 1}\ntrain: {steps: 2}\n")
    (tmp_path / "empty").mkdir()
    for run_dir in (tmp_path / "new" / "run", tmp_path / "empty", older):
        claim_run_dir(run_dir)
        assert json.loads((run_dir / MARKER).read_text())["host"] == socket.gethostname()
    (older / "notes.txt").write_text("added by hand")  # once marked, the run's directory stays the run's
    claim_run_dir(older)


def test_a_file_as_run_dir_is_one_config_error_through_the_cli(project, capsys):
    before = _contents(project)
    assert main(["train", "config.yaml", *BASE, "run.dir=notes.txt"]) == 2
    assert "run.dir: notes.txt is a file, not a directory" in capsys.readouterr().err
    assert _contents(project) == before
