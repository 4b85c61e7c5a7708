"""The hang watchdog: a step, a save or a restore that takes longer than `run.hang_timeout_s` on any process
stops the run, with every process's Python and native stacks in `run.dir/hangs/<attempt>/`.

A thread per process watches the time since the loop last made progress (`beat`). Past the limit, it writes
`process-<i>.txt` (what the process waited for, since when, on CPU XLA's collective timeouts
(`xla_cpu_patience`), and the stack of every thread: the main one's
ends in the jax call that never returned), says so (`last_words`: to the Ray driver, which then continues
any worker stopped with SIGSTOP so that it writes its own), writes `native-<i>.txt` (`native_stacks_text`:
where XLA's own threads wait, which no Python stack shows), waits up to GRACE_S for the other processes'
native files and ends the process (`os._exit`: its main thread is stuck in a collective or a device wait). Each
process also looks for the attempt's hang directory once a second: a process whose peers declared a hang
writes its stacks and ends too. Under Ray the launcher then restarts the group (docs/cluster.md); in one
process, `nestor train` exits 1 with one line naming the file. Compiles and evaluations are not watched
(`paused`): their time grows with the model, not with the step.

The limit, unless `run.hang_timeout_s` sets it: AUTO_STEPS times the median of the last steps' intervals,
at least AUTO_FLOOR_S (the first steps after a compile, a large checkpoint's restore or save).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Callable

from nestor.cluster.cpu_devices import collective_timeouts

AUTO_STEPS = 20
AUTO_FLOOR_S = 600.0
NATIVE_TIMEOUT_S = 60.0  # the most one tool (py-spy, gdb) may take for its dumps, its tries together
GRACE_S = 15.0 + 2 * NATIVE_TIMEOUT_S  # how long a hung process waits for the others' stacks before it ends
POLL_S = 1.0
HANG_EXIT_CODE = 1
BEFORE_EXIT_S = 10.0  # how long a hung process gives `before_exit` (removing a hung save's temporary files)
_INTERVALS = 20  # the step intervals the automatic limit takes the median of


def stacks_text() -> str:
    """Returns the stack of every thread of this process, the innermost call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def xla_cpu_patience(platform: str) -> str:
    """Returns a line (with its newline) saying how long XLA:CPU lets a collective wait before it ends the
    process, which must be past the watchdog's limit for a hang to be reported (orchestrator.job.processes
    .collective_timeout_s); '' off the CPU. Read once the backend has started: XLA read XLA_FLAGS then."""
    if platform != "cpu":
        return ""
    timeouts = collective_timeouts(os.environ.get("XLA_FLAGS", ""))
    return "XLA:CPU's collective timeouts: " + ", ".join(f"{flag}={seconds} s" for flag, seconds in timeouts.items()) \
        + "\n"


def _tool(name: str) -> str | None:
    """Returns the path of command `name`: on PATH, or beside this Python (a virtual environment's bin/,
    which a user's PATH may not hold)."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.is_file() else None)


def _allow_children_to_trace() -> None:
    """Lets a child process attach to this one, where Linux's Yama (ptrace_scope 1) allows only a parent to
    attach to its descendants."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY


# py-spy's --native dump fails now and then ("Failed to merge native and python frames"): it is tried this many
# times, then the Python frames alone are dumped.
NATIVE_TRIES = 3


def native_stacks_text(pid: int | None = None, timeout_s: float = NATIVE_TIMEOUT_S) -> str:
    """Returns the native stacks of every thread of process `pid` (this one by default): `py-spy dump
    --native` (Python threads, their C and C++ frames under the Python ones; after NATIVE_TRIES failures, or
    one past its time, the Python frames alone, in the quarter of `timeout_s` kept for them) and gdb's
    backtrace of every thread (XLA's pool threads, where a collective waits, run no Python), each where
    installed; else a line saying that neither was found. Never raises: a tool that fails or takes over
    `timeout_s` is named."""
    pid = os.getpid() if pid is None else pid
    tries = {"py-spy": [["dump", "--native", "--pid", str(pid)]] * NATIVE_TRIES + [["dump", "--pid", str(pid)]],
             "gdb": [["--batch", "--nx", "-p", str(pid), "-ex", "set pagination off", "-ex", "thread apply all bt"]]}
    found = {name: path for name in tries if (path := _tool(name)) is not None}
    if not found:
        return ("neither py-spy nor gdb was found, so no native stacks: install py-spy (pip install py-spy) "
                "or gdb to have them with the next hang\n")
    if pid == os.getpid():
        _allow_children_to_trace()
    parts = []
    for name, path in found.items():
        text, deadline, left = "", time.monotonic() + timeout_s, list(tries[name])
        while left:
            arguments = left.pop(0)
            kept = timeout_s / 4 if left else 0  # the last try's time, kept back by the tries before it
            output, failed = _dump(pid, [path, *arguments], deadline - time.monotonic() - kept)
            text += output
            if failed is None:
                break
            native = "--native" in arguments
            text += f"\n({name}{' --native' if native else ''} {failed})\n"
            if native and failed.startswith(("timed out", "not run")):  # no time for another: the plain dump
                left = [later for later in left if "--native" not in later]
        parts.append(f"=== {name} ({path})\n{text}")
    return "\n".join(parts)


def _dump(pid: int, command: list[str], timeout_s: float) -> tuple[str, str | None]:
    """Runs a dump command against `pid` for at most `timeout_s`; returns (its output, None) or (its output,
    how it failed)."""
    # A tool that stops this process also stops the thread reading its output and timing it: it writes to a
    # file (a full pipe would block it for good), and `timeout`, a process it does not stop, ends it; a shell
    # then continues the process, which a tool killed while attached can leave stopped.
    limit = (["sh", "-c", f'timeout -s KILL "$0" "$@"; status=$?; kill -CONT {pid}; exit $status',
              f"{timeout_s:.1f}"] if shutil.which("timeout") and shutil.which("sh") else [])
    if timeout_s < 0.5:
        return "", "not run: no time left"
    timed_out = f"timed out after {timeout_s:.0f} s"
    try:
        with tempfile.TemporaryFile("w+", errors="replace") as output:
            done = subprocess.run([*limit, *command], stdout=output, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=timeout_s + 5)
            output.seek(0)
            text = output.read()
    except subprocess.TimeoutExpired:  # no `timeout` command: subprocess's own limit ended it
        return "", timed_out
    except Exception as error:  # a full disk, a tool that cannot start: named, never raised
        return "", f"failed: {type(error).__name__}: {error}"
    if limit and done.returncode == 128 + 9:  # `timeout -s KILL` ended it
        return text, timed_out
    return text, (f"exited {done.returncode}" if done.returncode else None)


class HangWatchdog:
    """Watches one process of one attempt. `beat(waiting_for)` marks progress and says what comes next;
    `paused()` stops the clock inside a block; `close()` ends the watch. `watch=False` starts no thread
    (`overdue` is still asked)."""

    def __init__(self, timeout_s: float | None, hang_dir: Path, process_index: int, processes: int,
                 last_words: Callable[[str], None] = lambda text: None,
                 on_hang: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
                 clock: Callable[[], float] = time.monotonic, watch: bool = True, preamble: str = ""):
        self.timeout_s, self.hang_dir, self.preamble = timeout_s, Path(hang_dir), preamble  # lines under the first
        self.process_index, self.processes = process_index, processes
        self.last_words, self.on_hang, self.clock = last_words, on_hang, clock
        self.waiting_for, self.since = "the start", clock()
        self.intervals: deque[float] = deque(maxlen=_INTERVALS)
        self._paused = 0
        self._stopping = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.before_exit: Callable[[], None] = lambda: None  # what to clean up as a hung process ends
        if watch and timeout_s != 0:  # 0: never
            self._thread = threading.Thread(target=self._watch, name="nestor-hang-watchdog", daemon=True)
            self._thread.start()

    def limit_s(self) -> float:
        """The seconds one wait may take now."""
        if self.timeout_s is not None:
            return self.timeout_s
        median = statistics.median(self.intervals) if self.intervals else 0.0
        return max(AUTO_FLOOR_S, AUTO_STEPS * median)

    def beat(self, waiting_for: str, step_done: bool = False) -> None:
        """Marks progress: the loop now waits for `waiting_for` (e.g. "step 31"). `step_done`: the time
        since the last beat was one step's, which the automatic limit learns from."""
        with self._lock:
            now = self.clock()
            if step_done:
                self.intervals.append(now - self.since)
            self.waiting_for, self.since = waiting_for, now

    @contextlib.contextmanager
    def paused(self):
        """Leaves the block unwatched (a compile, an evaluation); the clock starts again after it."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self.since = self.clock()

    def overdue(self) -> str | None:
        """Returns what this process has waited for past the limit (one line), or None."""
        with self._lock:
            if self._paused or self.timeout_s == 0:
                return None
            waited, limit = self.clock() - self.since, self.limit_s()
            if waited <= limit:
                return None
            return f"waited {waited:.0f} s for {self.waiting_for} (run.hang_timeout_s: {limit:g} s)"

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            if (why := self.overdue()) is not None:
                self._stop(f"hung: {why}")
                return
            if self.hang_dir.is_dir():  # a peer declared a hang: this process is stuck in the same step
                self._stop(f"stopped with its hung peers, while it waited for {self.waiting_for}")
                return

    def _stop(self, why: str) -> None:
        """Writes this process's stacks, says why, waits for the others' native files, runs `before_exit`
        and ends the process, whatever of that fails (a full disk, a driver that does not answer); not once
        `close` was called (the attempt ended as the hang was seen)."""
        with self._lock:
            if self._closed.is_set():
                return
            self._stopping = True
        where = "could not be written"
        try:
            path = self.write_stacks(why)
            where = f"are in {path}"
            with contextlib.suppress(Exception):  # a driver that does not answer keeps no native stacks from disk
                self.last_words(f"{why}; stacks in {path.parent}")  # before the native ones: a stopped peer goes on
            where = f"are in {path} and {self.write_native_stacks().name}"
            # Every process waits for the others' native files: one that ended first would have the group
            # ended, a peer still dumping with it.
            deadline = time.monotonic() + GRACE_S
            while len(list(self.hang_dir.glob("native-*.txt"))) < self.processes and time.monotonic() < deadline:
                time.sleep(0.2)
        except Exception as error:  # the process ends all the same: it is stuck
            why = f"{why} ({type(error).__name__}: {error})"
        finally:
            with contextlib.suppress(Exception):  # a closed stderr: the process ends all the same
                self.on_hang(f"nestor: process {self.process_index} {why}; the stacks of every thread {where}")
            # in a thread of its own, for at most BEFORE_EXIT_S: a save that hung may sit on a file system that
            # hangs too, and the process must end all the same
            cleanup = threading.Thread(target=_quietly, args=(self.before_exit,), name="nestor-before-exit",
                                       daemon=True)
            cleanup.start()
            cleanup.join(BEFORE_EXIT_S)
            os._exit(HANG_EXIT_CODE)

    def write_stacks(self, why: str) -> Path:
        """Writes `process-<i>.txt` in the hang directory; returns its path."""
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        path = self.hang_dir / f"process-{self.process_index}.txt"
        header = (f"process {self.process_index} of {self.processes}, pid {os.getpid()} on {socket.gethostname()}, "
                  f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {why}\n")
        path.write_text(f"{header}{self.preamble}\n{stacks_text()}")
        return path

    def write_native_stacks(self) -> Path:
        """Writes `native-<i>.txt` in the hang directory (`native_stacks_text`); returns its path."""
        path = self.hang_dir / f"native-{self.process_index}.txt"
        path.write_text(f"process {self.process_index} of {self.processes}, pid {os.getpid()} on "
                        f"{socket.gethostname()}\n\n{native_stacks_text()}")
        return path

    def close(self) -> None:
        """Ends the watch; a hang already being declared goes on (the process ends)."""
        with self._lock:
            self._closed.set()
            stopping = self._stopping
        if stopping:
            threading.Event().wait()  # the watchdog's os._exit comes


def _quietly(action: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):  # a hung process ends all the same
        action()
