"""One run at a time on a run.dir that nestor owns: the lock file `run.dir/nestor.lock` and the marker
`run.dir/nestor_run.json`.

A run writes into run.dir freely (config.yaml, checkpoints/, metrics.jsonl,
tb/), so run.dir must be nestor's: new, empty, or holding a nestor run (its
marker, written when a run first takes the directory; or, for runs of a
nestor older than the marker, its lock file or its config.yaml beside its
checkpoints or metrics). Anything else, the user's project directory above
all, is refused before a file is written.

Two runs on one run.dir would interleave metrics.jsonl and fight over the
checkpoints. The process that speaks for a run (the `nestor` process under
the Ray launcher, which outlives worker restarts; process 0 otherwise) holds
an exclusive `flock` on the lock file for as long as the run lasts and writes
its pid, host and start time into it. The kernel drops a flock when its
holder dies, `kill -9` included, so a lock file whose flock is free was left
by a run that is gone: it is taken over, saying whose it was. A file system
that ignores flock still refuses a holder on this host whose pid is alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.paths import shown

LOCK_NAME = "nestor.lock"
MARKER = "nestor_run.json"


def _older_nestor_run(run_dir: Path) -> bool:
    """Whether `run_dir`, without a marker, holds a run of a nestor older than the marker."""
    if (run_dir / LOCK_NAME).exists():
        return True
    if not ((run_dir / "checkpoints").is_dir() or (run_dir / "metrics.jsonl").is_file()):
        return False
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(saved, dict) and {"run", "mesh", "train"} <= set(saved)


def claim_run_dir(run_dir: str | Path) -> None:
    """Makes `run_dir` (created if new) nestor's by writing its marker, unless it holds a nestor run already.

    Raises ConfigError (key run.dir) when it is not a directory, cannot be created or written, or holds
    files of someone else's.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([("run.dir", f"{shown(run_dir)} is a file, not a directory; choose a new or empty directory")])
    try:
        if (run_dir / MARKER).is_file():
            return
        if run_dir.is_dir():
            entries = sorted(entry.name for entry in run_dir.iterdir())
            if entries and not _older_nestor_run(run_dir):
                listed = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
                raise ConfigError([("run.dir", f"{shown(run_dir)} holds files that are not a nestor run ({listed}); "
                                               "choose a new or empty directory")])
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname()}
        (run_dir / MARKER).write_text(json.dumps(record) + "\n")
    except OSError as error:  # a file in the way, a read-only parent, a full disk
        where = f" ({shown(error.filename)})" if error.filename and Path(error.filename) != run_dir else ""
        raise ConfigError([("run.dir", f"cannot make {shown(run_dir)} a run directory: "
                                       f"{error.strerror or error}{where}")]) from None


def _start_ticks(pid: int) -> int | None:
    """Returns when process `pid` started (clock ticks after boot, /proc/PID/stat field 22), or None
    where /proc does not say; with the pid, it names a process even after its pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # the fields after "(command)" start at field 3


def _alive(holder: dict) -> bool:
    """Whether the process the lock file names still runs (not another that got its pid since)."""
    pid = holder["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    recorded = holder.get("start_ticks")
    return recorded is None or _start_ticks(pid) in (None, recorded)


def _holder(fd: int) -> dict | None:
    """Returns what the lock file says about its holder, or None when it says nothing readable."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "a run that left no pid"
    return f"pid {holder['pid']} on host {holder.get('host', '?')} (since {holder.get('started', '?')})"


class RunDirLock:
    """The lock on a run.dir; use as a context manager around the run.

    Raises ConfigError (key run.dir) on entry when another live run holds it, or when run.dir is not
    nestor's (`claim_run_dir`).
    """

    def __init__(self, run_dir: str | Path, log=print):
        self.path = Path(run_dir) / LOCK_NAME
        self.log = log
        self._fd: int | None = None

    def __enter__(self) -> "RunDirLock":
        try:
            return self._acquire()
        except ConfigError:
            raise
        except OSError as error:  # a read-only or full run.dir, a file system without locks
            problem = f"cannot take the lock {shown(self.path)}: {error.strerror or error}"
            raise ConfigError([("run.dir", problem)]) from None

    def _acquire(self) -> "RunDirLock":
        claim_run_dir(self.path.parent)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise self._refusal(holder) from None
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                break
            os.close(fd)  # its holder removed the file between our open and flock: try the new one
        holder = _holder(fd)
        if holder and holder.get("host") == socket.gethostname() and holder["pid"] != os.getpid() \
                and _alive(holder):
            os.close(fd)
            raise self._refusal(holder)
        if holder:
            self.log(f"took over {shown(self.path)} from a run that is gone: {_describe(holder)}")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "start_ticks": _start_ticks(os.getpid())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd
        return self

    def _refusal(self, holder: dict | None) -> ConfigError:
        return ConfigError([("run.dir", f"{shown(self.path.parent)} is in use by another run: {shown(self.path)} is "
                                        f"held by {_describe(holder)}; wait for that run to end, stop it, or "
                                        "choose another run.dir")])

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        # Remove the file before unlocking, so a waiter that opened it sees it replaced and tries again.
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


@contextlib.contextmanager
def holding_run_dir(run_dir: Path, lock: bool, log):
    """Holds run.dir's lock on process 0 for the run (nothing without `lock`). In a multi-process run
    every process learns whether process 0 got it, so none goes on alone; raises ConfigError if not."""
    with contextlib.ExitStack() as stack:
        refusal = None
        if lock and jax.process_index() == 0:
            try:
                stack.enter_context(RunDirLock(run_dir, log))
            except ConfigError as error:
                refusal = error
        if lock and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if multihost_utils.broadcast_one_to_all(np.int32(refusal is not None)) and refusal is None:
                whose = "is in use by another run (process 0 says whose)"
                refusal = ConfigError([("run.dir", f"{shown(run_dir)} {whose}")])
        if refusal is not None:
            raise refusal
        yield
