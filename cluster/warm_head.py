"""A local Ray head kept up between commands (`cluster.keep_head_s`): the second and later commands on one
machine skip Ray's start-up.

The head belongs to a keeper process of its own (`python -m nestor.cluster.warm_head`, in a session of its
own, so that a Ctrl-C to the command leaves it up): it starts the head as the embedded launcher always has
(`ray.init(address="local")`, whose daemons share the keeper's fate), writes the head's address to a state
file, and ends it once no command has used it for the `keep_s` the last one gave, or at `nestor stop-head`.
A command holds the head alone while it runs (an exclusive lock on the head's file; a second command at the
same time starts a cluster of its own, as before), so the keeper never ends a head in use, and the workers of
two runs never compete for its CPUs.

A command's workers get its whole environment as their job's (`command_env`), so a head serves any command
of the same interpreter, CPUs, dashboard setting and Ray settings (`RAY_*`, which Ray's own daemons read):
its key. Heads are found only in this user's state directory on this host: someone else's head, or a
`ray start` head, is never joined or stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Callable, Iterator

import psutil

from nestor.cluster.head import kill_if_still_running
from nestor.cluster.rendezvous import ClusterError, free_port

LOCALHOST = "127.0.0.1"
CHECKOUT = Path(__file__).resolve().parent.parent  # the directory holding the rooms: what workers import
POLL_S = 2.0  # how often a keeper asks whether its head is idle
START_TIMEOUT_S = 120.0  # how long a command waits for a new keeper's head to come up
# Ray's settings that are no head's key: the address a client was given, and the auth mode a client turns on
# in its own process once it has connected (connect.use_token_if_present).
_NOT_KEYS = ("RAY_ADDRESS", "RAY_GCS_SERVER_PORT", "RAY_AUTH_MODE")
_HELD: list[float] = []  # the keep_s of each kept head this process held (`kept_after_this_process`)


def heads_dir() -> Path:
    """Returns this user's directory of kept heads on this host: $NESTOR_HEADS_DIR, else nestor/ray-heads/HOST
    under $XDG_CACHE_HOME or ~/.cache (a home shared between hosts keeps each host's apart)."""
    if os.environ.get("NESTOR_HEADS_DIR"):
        return Path(os.environ["NESTOR_HEADS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "nestor" / "ray-heads" / socket.gethostname()


def checkout_pythonpath() -> str:
    """Returns PYTHONPATH with this checkout first: processes import its code, whatever version is installed."""
    return os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))


def command_env() -> dict[str, str]:
    """Returns this command's environment as its workers get it on a kept head: all of it but Ray's own
    settings, which the head's daemons were started with."""
    return {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}


def kept_after_this_process() -> float | None:
    """Returns how long the kept head this process last held stays up after it, or None if it held none."""
    return _HELD[-1] if _HELD else None


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """What a kept head is started with: the CPUs it offers (one per worker), whether it serves the
    dashboard, and whether it streams workers' output to drivers (its log monitor)."""

    cpus: int
    dashboard: bool
    worker_logs: bool = False

    def key(self) -> str:
        """Returns the key of the head this spec asks for, in this process's interpreter and Ray settings."""
        ray_settings = sorted((name, value) for name, value in os.environ.items()
                              if name.startswith("RAY_") and name not in _NOT_KEYS)
        text = json.dumps([sys.executable, self.cpus, self.dashboard, self.worker_logs, ray_settings])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class WarmHead:
    """A kept head as its state file records it."""

    address: str  # its GCS, HOST:PORT
    keeper: int  # the keeper's pid
    keep_s: float
    path: Path  # its state file

    @property
    def used_path(self) -> Path:
        return self.path.with_suffix(".used")

    def idle_s(self) -> float:
        """Returns the seconds since a command last held the head."""
        try:
            return time.time() - self.used_path.stat().st_mtime
        except FileNotFoundError:
            return time.time() - self.path.stat().st_mtime

    def idle_limit_s(self) -> float:
        """Returns the keep_s the last command that held the head gave (else the first one's)."""
        try:
            return float(self.used_path.read_text())
        except (OSError, ValueError):
            return self.keep_s

    def keeper_alive(self) -> bool:
        """Returns whether its keeper runs (a pid of another program is not)."""
        try:
            process = psutil.Process(self.keeper)
            return process.status() != psutil.STATUS_ZOMBIE and "nestor.cluster.warm_head" in " ".join(process.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False


def read_head(path: Path) -> WarmHead | None:
    """Returns the head `path` records, or None when the file is gone or torn."""
    try:
        record = json.loads(path.read_text())
        return WarmHead(record["address"], int(record["keeper"]), float(record["keep_s"]), path)
    except (OSError, ValueError, KeyError):
        return None


def warm_heads() -> list[WarmHead]:
    """Returns this user's kept heads whose keepers still run."""
    found = [read_head(path) for path in sorted(heads_dir().glob("*.json"))]
    return [head for head in found if head is not None and head.keeper_alive()]


def _try_lock(path: Path, wait_s: float) -> IO | None:
    """Returns an open handle of `path` (created) holding its exclusive lock, or None when another process
    held it for all of `wait_s`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() >= deadline:
                handle.close()
                return None
            time.sleep(0.1)


@contextlib.contextmanager
def _locked(path: Path, wait_s: float) -> Iterator[bool]:
    """Holds `path`'s exclusive lock while the block runs; yields False when another process held it for all
    of `wait_s`."""
    handle = _try_lock(path, wait_s)
    try:
        yield handle is not None
    finally:
        if handle is not None:
            handle.close()  # closing the last handle releases the lock


@dataclasses.dataclass
class HeadLease:
    """A kept head held by this command alone until `release`."""

    address: str
    head: WarmHead
    keep_s: float
    handle: IO | None  # the open lock file

    def release(self) -> None:
        """Lets the next command have the head, which stays up `keep_s` from now if none comes."""
        if self.handle is not None:
            self.head.used_path.write_text(f"{self.keep_s:g}")
            self.handle.close()
            self.handle = None


def hold_head(spec: HeadSpec, keep_s: float, on_phase: Callable[[str], None] = lambda text: None
              ) -> HeadLease | None:
    """Returns this user's warm head for `spec`, held by this command until its `release` (or this process's
    end), starting its keeper when none runs; None when another command holds it (then start a cluster of
    your own). `on_phase` hears whether it starts one or reuses one. Raises ClusterError when it does not come up."""
    path = heads_dir() / f"{spec.key()}.json"
    handle = _try_lock(path.with_suffix(".lock"), wait_s=1.0)
    if handle is None:
        return None
    try:
        head = read_head(path)
        if head is not None and head.keeper_alive() and not _answers(head.address):
            _end(head.keeper)  # a keeper whose head no longer answers (its daemons killed): a new one
            head = None
        if head is None or not head.keeper_alive():
            on_phase("starting a local Ray head on 127.0.0.1")
            head = _start_keeper(spec, keep_s, path)
        else:
            on_phase(f"using the local Ray head an earlier command kept up ({head.address})")
        head.used_path.write_text(f"{keep_s:g}")
    except BaseException:
        handle.close()
        raise
    _HELD.append(keep_s)
    return HeadLease(head.address, head, keep_s, handle)


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _start_keeper(spec: HeadSpec, keep_s: float, path: Path) -> WarmHead:
    path.unlink(missing_ok=True)
    log = path.with_suffix(".log")
    # this checkout's keeper, in a directory that outlives the command's
    env = dict(os.environ, PYTHONPATH=checkout_pythonpath())
    with log.open("w") as output:
        keeper = subprocess.Popen(
            [sys.executable, "-m", "nestor.cluster.warm_head", str(path), str(spec.cpus), str(int(spec.dashboard)),
             str(keep_s), str(int(spec.worker_logs))], stdin=subprocess.DEVNULL, stdout=output,
            stderr=subprocess.STDOUT, start_new_session=True,
            env=env, cwd=path.parent)
    deadline = time.monotonic() + START_TIMEOUT_S
    while (head := read_head(path)) is None or head.keeper != keeper.pid:
        if keeper.poll() is not None or time.monotonic() > deadline:
            _end(keeper.pid)
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
            how = f"exited {keeper.returncode}" if keeper.returncode is not None else f"took over {START_TIMEOUT_S:g} s"
            raise ClusterError(f"the local Ray head did not come up (its keeper {how}); {log}:\n{tail}")
        time.sleep(0.1)
    return head


def _end(pid: int, grace_s: float = 15.0) -> None:
    try:
        process = psutil.Process(pid)
        process.terminate()
    except psutil.NoSuchProcess:
        return
    kill_if_still_running([process], grace_s)


def stop_warm_heads(wait_s: float = 0.0) -> tuple[list[str], list[str]]:
    """Ends this user's kept heads that no command holds (waiting up to `wait_s` for one that is held);
    returns (the addresses stopped, the addresses left up because a command holds them)."""
    stopped, busy = [], []
    for head in warm_heads():
        with _locked(head.path.with_suffix(".lock"), wait_s) as mine:
            if not mine:
                busy.append(head.address)
                continue
            if read_head(head.path) != head or not head.keeper_alive():
                continue  # it ended, or another keeper took its place, while this waited
            _end(head.keeper)
            head.path.unlink(missing_ok=True)
            stopped.append(head.address)
    return stopped, busy


def _keep(path: Path, cpus: int, dashboard: bool, keep_s: float, worker_logs: bool) -> None:
    """The keeper: starts the head, records it in `path`, and ends it once idle for `keep_s` or told to."""
    def ended(signum, frame):
        raise SystemExit(0)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep 127.0.0.1 (read at Ray's import; driver.launch)
    import ray

    address = start_local_head(cpus, dashboard, worker_logs)
    # after ray.init, which sets a SIGTERM handler of its own; the daemons it started keep the defaults
    signal.signal(signal.SIGTERM, ended)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # in a session of its own; a stray one is not a stop
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"address": address, "keeper": os.getpid(), "keep_s": keep_s}))
    temporary.replace(path)
    head = read_head(path)
    try:
        while True:
            time.sleep(POLL_S)
            if read_head(path) != head:
                break  # its file was removed or taken over: no command can find it any more
            with _locked(path.with_suffix(".lock"), wait_s=0) as mine:
                if mine and head.idle_s() >= head.idle_limit_s():
                    path.unlink(missing_ok=True)
                    break
    finally:
        if read_head(path) == head:
            path.unlink(missing_ok=True)
        ray.shutdown()


@contextlib.contextmanager
def _agent_on_a_free_port() -> Iterator[None]:
    """While the block runs, a Ray head started by `ray.init` puts its dashboard agent on a free port.

    Ray's agent listens on 52365 unless told otherwise, and `ray.init` has no option for it. A head of ours
    holding that port would leave a `ray start --head` on the machine without an agent, and its job
    submissions fail ("No available agent to submit job"). So the port is given to Ray's RayParams, which
    `ray.init` builds, as `ray start --dashboard-agent-listen-port` gives it."""
    from ray._private import parameter

    original = parameter.RayParams.__init__
    if "dashboard_agent_listen_port" not in inspect.signature(original).parameters:
        yield  # a Ray without the setting: its default
        return

    def with_a_free_agent_port(self, *args, **kwargs):
        kwargs.setdefault("dashboard_agent_listen_port", free_port(LOCALHOST))
        original(self, *args, **kwargs)

    parameter.RayParams.__init__ = with_a_free_agent_port
    try:
        yield
    finally:
        parameter.RayParams.__init__ = original


def start_local_head(cpus: int, dashboard: bool, worker_logs: bool = False, env_vars: dict | None = None) -> str:
    """Starts a Ray cluster on 127.0.0.1 whose daemons share this process's fate, connected as its driver;
    returns its GCS address. Its processes get that address as RAY_ADDRESS. Without `worker_logs` it runs
    no log monitor (what streams workers' output to drivers). Raises ClusterError when it comes up elsewhere."""
    import ray

    # Token auth stays at Ray's default (on); everything binds to loopback. Workers
    # import the code from this checkout (PYTHONPATH), whatever version is installed.
    # Ray's state API and a process that joins "auto" find their cluster through
    # RAY_ADDRESS or else the newest `ray start` cluster on the machine, which may be
    # another one. So the embedded GCS gets a port chosen here, and its processes get
    # it as RAY_ADDRESS.
    # A GCS port free a moment ago can be taken before the GCS binds it; a second try draws others.
    for attempt in range(2):
        gcs_address = f"{LOCALHOST}:{free_port(LOCALHOST)}"
        try:
            _init_local(gcs_address, cpus, dashboard, worker_logs, env_vars)
            break
        except RuntimeError as error:
            if attempt or not LOST_PORT.search(str(error)):
                raise
    actual = ray.get_runtime_context().gcs_address
    if actual != gcs_address:
        raise ClusterError(f"the embedded Ray cluster came up at {actual}, not {gcs_address}; run again")
    return gcs_address


def _stop_log_monitor() -> None:
    """Ends the log monitor of the head `ray.init` just started here (a Ray internal: where it is not, the
    monitor stays)."""
    with contextlib.suppress(Exception):
        from ray._private import worker

        worker._global_node.kill_log_monitor(check_alive=False)


LOST_PORT = re.compile(r"Address already in use|Failed to start the grpc server")


def _init_local(gcs_address: str, cpus: int, dashboard: bool, worker_logs: bool, env_vars: dict | None) -> None:
    """`ray.init` of a local head whose GCS listens at `gcs_address` (a port of 127.0.0.1)."""
    import ray

    previous_port = os.environ.get("RAY_GCS_SERVER_PORT")
    os.environ["RAY_GCS_SERVER_PORT"] = gcs_address.rpartition(":")[2]
    try:
        with _agent_on_a_free_port():
            # No idle workers started ahead of the first driver's tasks: nestor's actors run in processes
            # of their own, and a kept head's first driver is its keeper, which runs none (docs/cluster.md).
            ray.init(address="local", _node_ip_address=LOCALHOST, include_dashboard=dashboard,
                     dashboard_host=LOCALHOST, dashboard_port=free_port(LOCALHOST), num_cpus=cpus,
                     logging_level="ERROR", log_to_driver=worker_logs,
                     runtime_env={"env_vars": {**(env_vars or {}), "RAY_ADDRESS": gcs_address}},
                     _system_config={"prestart_worker_first_driver": False})
        if not worker_logs:  # it polls every worker's log files for a driver that reads none
            _stop_log_monitor()
    finally:
        if previous_port is None:
            os.environ.pop("RAY_GCS_SERVER_PORT")
        else:
            os.environ["RAY_GCS_SERVER_PORT"] = previous_port


if __name__ == "__main__":
    _keep(Path(sys.argv[1]), int(sys.argv[2]), bool(int(sys.argv[3])), float(sys.argv[4]), bool(int(sys.argv[5])))
