"""Reaching a Ray cluster for a run: the cluster's shape (`ClusterSpec`), connecting (`connect`: local,
by address, with Ray's token where one exists), whether it has room for the workers (`check_capacity`), and
the project files a remote cluster's workers and a submitted job receive (`stage_project`)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Callable

from nestor.cluster.rendezvous import ClusterError
from nestor.cluster.warm_head import CHECKOUT, HeadSpec, checkout_pythonpath, command_env, hold_head, start_local_head

# The directory holding this package and its siblings: what a remote cluster needs of the code.
PROJECT_ROOT = CHECKOUT


# where a worker resolves the user's own code (model.class): the directory the run was started in
USER_CODE_ENV = "NESTOR_USER_CODE"


# What a job needs of the project: its packages and configs, no run dirs, venvs or docs.
JOB_FILES = ("pyproject.toml", "nestor", "configs", "orchestrator", "backend", "parallel", "models", "cluster")


def stage_project(destination: Path, user_code: tuple[str, ...] = ()) -> Path:
    """Copies what a job needs of the project (JOB_FILES) and the user's own code (`user_code`: module
    files and package directories, importable from a job's working directory) into `destination`;
    returns it. Raises ClusterError when the user's code would take one of the project's names."""
    for name in JOB_FILES:
        source, target = PROJECT_ROOT / name, destination / name
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    for path in map(Path, user_code):
        target = destination / path.name
        module = path.stem if path.is_file() else path.name
        if target.exists() or module in JOB_FILES:  # `models.py` would lose to nestor's `models/` package
            raise ClusterError(f"your code {path} would clash with nestor's {module!r} on the cluster; rename it")
        if path.is_dir():
            shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, target)
    return destination


TOKEN_FILE = Path.home() / ".ray" / "auth_token"  # where Ray keeps the token it generated


UPLOAD_EXCLUDES = [".git", ".venv", "venv", "runs", "**/__pycache__", "*.egg-info", ".pytest_cache", "docs", "tests",
                   "bench"]


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """What a launch asks of Ray: workers, their accelerators, restarts, deadlines."""

    hosts: int
    devices_per_host: int
    accelerator: str = "cpu"  # cpu | gpu | tpu
    address: str | None = None  # None: the ambient cluster (RAY_ADDRESS) or an embedded one
    max_failures: int = 3  # failed groups in a row without progress before the run fails; -1: no limit
    min_hosts: int | None = None  # fewest workers a restarted group may start with; None: hosts
    restart_timeout_s: float = 300.0  # how long a restart waits for room for all `hosts` workers
    init_timeout_s: float = 120.0
    tpu_topology: str | None = None  # e.g. "2x2x2" (v4/v5p) or "4x4" (v5e); TPU only
    tpu_type: str | None = None  # e.g. "TPU-V4"; TPU only
    dashboard: bool = True  # embedded cluster: serve the dashboard (and the state API) on 127.0.0.1
    worker_logs: bool = False  # stream every worker's raw output to the driver (Ray-prefixed)
    user_code: tuple[str, ...] = ()  # the user's modules and packages a remote cluster's workers import
    collective_timeout_s: int | None = None  # CPU workers: XLA:CPU's collective timeouts at least this (cpu_devices)
    keep_head_s: float = 0.0  # embedded cluster: keep its head up this long after the command (warm_head); 0: stop it

    def worker_resources(self) -> dict[str, float]:
        """Returns the Ray resources one worker reserves."""
        if self.accelerator == "gpu":
            return {"CPU": 1, "GPU": self.devices_per_host}
        if self.accelerator == "tpu":
            return {"TPU": self.devices_per_host}
        return {"CPU": 1}


def tpu_slices(spec: ClusterSpec) -> tuple[int, int]:
    """Returns (slices, hosts per slice) of a TPU run with `tpu_type` and `tpu_topology`; (1, hosts) else.
    Raises ClusterError when `hosts` is not whole slices of that topology."""
    if not (spec.accelerator == "tpu" and spec.tpu_type and spec.tpu_topology):
        return 1, spec.hosts
    from ray.util.tpu import get_tpu_worker_resources

    try:
        per_slice, _ = get_tpu_worker_resources(spec.tpu_topology, spec.tpu_type, spec.worker_resources())
    except ValueError as error:
        raise ClusterError(f"cluster.tpu_type={spec.tpu_type}, cluster.tpu_topology={spec.tpu_topology}: {error}") \
            from None
    if spec.hosts % per_slice:
        raise ClusterError(f"cluster.hosts={spec.hosts} is not whole {spec.tpu_topology} slices of {per_slice} "
                           f"host(s) each (cluster.tpu_topology): set cluster.hosts to a multiple of {per_slice}")
    return spec.hosts // per_slice, per_slice


def use_token_if_present() -> None:
    """Turns on Ray's token auth for this client when a token is available (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or Ray's token file) and RAY_AUTH_MODE is unset, as `ray start` does for its
    head. Ray itself never does it for an explicit address, so a client of a head that `ray start`
    put under token auth would be refused without it."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or TOKEN_FILE.exists():
        os.environ["RAY_AUTH_MODE"] = "token"
        if "ray" in sys.modules:  # Ray caches its config at import: read the mode again
            from ray._raylet import Config

            Config.initialize("")


def connect(spec: ClusterSpec, on_phase: Callable[[str], None] = lambda text: None) -> Callable[[], None]:
    """Connects this process to Ray: to `spec.address`, else to the surrounding Ray job's cluster, else to this
    user's warm local head (`spec.keep_head_s`, started when none is up; `on_phase` hears which), else to an
    embedded cluster of its own. Returns what to call after `ray.shutdown()`: it lets the next command have the
    kept head. Raises ClusterError when the cluster cannot be reached or does not come up."""
    import ray

    if os.environ.get("RAY_ADDRESS") and not spec.address:
        # inside a Ray job: its runtime env already carries the code
        ray.init(logging_level="ERROR", log_to_driver=spec.worker_logs)
        return lambda: None
    if spec.address:
        _check_reachable(spec.address)
        use_token_if_present()
        # the project and the user's code, staged together as the working dir (a clash refused before Ray)
        staging = tempfile.TemporaryDirectory(prefix="nestor-upload-") if spec.user_code else None
        upload = ({"working_dir": str(stage_project(Path(staging.name) / "project", spec.user_code))} if staging
                  else {"working_dir": str(PROJECT_ROOT), "excludes": UPLOAD_EXCLUDES})
        try:
            ray.init(address=spec.address, logging_level="ERROR", log_to_driver=spec.worker_logs, runtime_env=upload)
        except (ConnectionError, RuntimeError, ValueError, ray.exceptions.AuthenticationError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            # Something answered there (_check_reachable): a GCS that refused us, or not a GCS at all.
            raise ClusterError(f"cluster.address={spec.address}: could not connect to Ray there ({first_line}); "
                               "is it a Ray head's GCS port (6379 by default)? A cluster under token auth needs "
                               "its token here: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token") from None
        finally:
            if staging is not None:
                staging.cleanup()  # ray.init has uploaded it
        return lambda: None
    env_vars = {"PYTHONPATH": checkout_pythonpath(), USER_CODE_ENV: os.environ.get(USER_CODE_ENV) or os.getcwd()}
    head = HeadSpec(cpus=spec.hosts, dashboard=spec.dashboard, worker_logs=spec.worker_logs)
    if spec.keep_head_s > 0:
        lease = hold_head(head, spec.keep_head_s, on_phase)
        if lease is not None:
            use_token_if_present()  # the head's ray.init turned token auth on; Ray does not for an address
            try:
                # the workers get this command's environment, not the one the head was started in
                ray.init(address=lease.address, logging_level="ERROR", log_to_driver=spec.worker_logs,
                         runtime_env={"env_vars": {**command_env(), **env_vars, "RAY_ADDRESS": lease.address}})
            except BaseException:
                lease.release()
                raise
            return lease.release
        on_phase("the kept local Ray head is in use by another command: starting a cluster of this command's own")
    start_local_head(head.cpus, head.dashboard, spec.worker_logs, env_vars)
    return lambda: None


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raises ClusterError unless something accepts TCP connections at `address` ([scheme://]host:port)."""
    # ray.init retries an unreachable GCS for minutes; a plain connect answers in seconds.
    host, _, port = address.split("://")[-1].rpartition(":")
    if not port.isdigit():
        return  # e.g. "auto": Ray resolves it itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ClusterError(f"cluster.address={address}: cannot reach a Ray cluster there ({error.strerror or error}); "
                           "start one with `ray start --head` or fix the address") from None


def room_for_workers(spec: ClusterSpec, nodes: list[dict]) -> int:
    """Returns how many of `spec`'s workers the live nodes of `nodes` (`ray.nodes()`) hold, whole workers per
    node (a host's devices are never split across machines)."""
    need = spec.worker_resources()
    return sum(int(min(node.get("Resources", {}).get(name, 0) // amount for name, amount in need.items()))
               for node in nodes if node.get("Alive"))


def check_capacity(spec: ClusterSpec, nodes: list[dict]) -> None:
    """Raises ClusterError, with the numbers, when no placement of `spec.hosts` workers fits `nodes`.

    `nodes` is `ray.nodes()`; each node must hold whole workers (a host's
    devices are never split across machines).
    """
    need = spec.worker_resources()
    fits = room_for_workers(spec, nodes)
    if fits < spec.hosts:
        totals = {name: sum(n.get("Resources", {}).get(name, 0) for n in nodes if n.get("Alive")) for name in need}
        asked = ", ".join(f"{spec.hosts} x {amount:g} {name}" for name, amount in need.items())
        have = ", ".join(f"{total:g} {name}" for name, total in totals.items())
        device = spec.accelerator.upper()
        fix = (f"it has no {device}: set cluster.accelerator=cpu or add {device} nodes"
               if device in totals and not totals[device] else "lower cluster.hosts/devices_per_host or add nodes")
        raise ClusterError(f"cluster.hosts={spec.hosts} x cluster.devices_per_host={spec.devices_per_host} "
                           f"(cluster.accelerator={spec.accelerator}) asks for {asked}, but the cluster has {have} "
                           f"(room for {fits} worker(s)); {fix}")
