"""Shared pieces of the tests: train on a mesh, compare runs."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import psutil

from nestor.cluster.cpu_devices import without_device_count
from nestor.orchestrator.loader.config import Config
from nestor.orchestrator.data.prepare import Options, prepare
from nestor.orchestrator.loop.console import Console
from nestor.orchestrator.loop.train import TrainResult, train
from tests.settings import ROOT

# The meshes the foundation is tested on (tensor4 needs 4 kv heads).
TESTED_MESHES = {
    "data8": dict(data=8),
    "fsdp8": dict(fsdp=8),
    "fsdp4_tensor2": dict(fsdp=4, tensor=2),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "tensor4_data2": dict(tensor=4, data=2),
}

ONE_DEVICE = {"mesh.data": 1, "mesh.fsdp": 1, "mesh.context": 1, "mesh.tensor": 1, "mesh.expert": 1, "mesh.pipeline": 1,
              "cluster.devices_per_host": 1}


def child_env(**extra: str) -> dict[str, str]:
    """Returns the environment for a JAX process a test starts from this checkout: this process's
    XLA_FLAGS (the suite's compile flag among them: its results are compared with this process's)
    without the 8-device count, no JAX_PLATFORMS, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return {**env, "XLA_FLAGS": without_device_count(env.get("XLA_FLAGS", "")), "PYTHONPATH": str(ROOT), **extra}


def mesh_overrides(**degrees: int) -> dict:
    """Returns dotted overrides for a mesh given as e.g. data=2, fsdp=2, tensor=2 (others 1)."""
    dotted = {f"mesh.{axis}": 1 for axis in ("data", "fsdp", "context", "tensor", "expert", "pipeline")}
    dotted.update({f"mesh.{axis}": size for axis, size in degrees.items()})
    return dotted


def prepared_stdlib(out: Path, pattern: str = "[a-c]*.py", tokenizer: str = "bytes") -> Path:
    """Prepares the standard library's sources matching `pattern` as token shards in `out` (bytes by
    default, 10% held out, shards of about 0.25 MiB); returns `out`."""
    sources = [str(Path(sysconfig.get_paths()["stdlib"]) / pattern)]
    prepare(sources, Options(tokenizer=tokenizer, out=out, eval_fraction=0.1, shard_mb=0.25), log=lambda line: None)
    return out


def equations(jaxpr, primitive: str) -> list:
    """Returns the equations of `jaxpr` that bind the primitive named `primitive`, nested jaxprs' included
    (a checkpoint's, a custom_vjp's, a scan's body)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found.append(eqn)
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += equations(inner, primitive)
    return found


def relative_error(got, want) -> float:
    """Returns ||got - want|| / ||want|| over all elements, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def ended(process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Returns (stdout, stderr) of `process` once it has ended; one still running after `timeout` seconds is
    killed (a long run left behind would load the machine for the rest of the suite) and TimeoutExpired raised."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate(timeout=30)  # what it printed, for the failure
        raise subprocess.TimeoutExpired(process.args, timeout, out, err) from None


def kill_session(process: subprocess.Popen, timeout: float = 30) -> None:
    """Kills `process`, started in a session of its own (`start_new_session=True`), and every process left
    in that session (an embedded Ray cluster's daemons and workers, which may have process groups of their
    own); raises AssertionError if any outlives `timeout` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=timeout)
    deadline = time.monotonic() + timeout
    while left := [p for p in psutil.process_iter(["status"]) if _in_session(p, process.pid)]:
        assert time.monotonic() < deadline, f"{len(left)} process(es) of a killed session outlived it"
        for other in left:
            with contextlib.suppress(psutil.Error):
                other.kill()
        time.sleep(0.2)


def _in_session(process: psutil.Process, session: int) -> bool:
    """Whether `process` lives on (not a zombie) in `session`."""
    try:
        return process.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(process.pid) == session
    except OSError:  # gone already
        return False


def run(config: Config) -> TrainResult:
    """Trains quietly in config.run.dir (resuming from a checkpoint there); returns the result."""
    return train(config, console=Console.silent())


def run_fresh(config: Config) -> TrainResult:
    """Trains quietly from scratch in a new run dir (removed when the tests end), so no other run's
    checkpoint is resumed."""
    run_dir = tempfile.mkdtemp(prefix="nestor-run-")
    atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
    return run(config.replace(**{"run.dir": run_dir}))


def assert_same_training(result: TrainResult, reference: TrainResult, loss_rtol=1e-5, param_tol=1e-4) -> None:
    """Asserts equal losses (rtol) and final parameters (abs + rel tolerance) of two runs."""
    np.testing.assert_allclose(result.losses, reference.losses, rtol=loss_rtol)
    got = jax.tree.map(np.asarray, result.state["params"])
    want = jax.tree.map(np.asarray, reference.state["params"])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=param_tol, atol=param_tol, err_msg=jax.tree_util.keystr(path))


_TWO_PROCESSES = textwrap.dedent("""
    import sys
    sys.stdout = open(sys.argv[4], "w")  # Python's prints alone: Gloo's C++ writes to fd 1 mid-line
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(sys.argv[5]))
    coordinator, rank, run_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator, num_processes=2, process_id=rank)
    from nestor.cluster.cpu_devices import share_compiled_programs
    share_compiled_programs(jax)  # as nestor's workers on one machine: process 0 compiles for both
    from pathlib import Path
""")


def last_lines_of_two_processes(body: str, run_dirs: list[Path], devices: int = 2) -> list[str]:
    """Runs `body` in two jax.distributed CPU processes of `devices` devices each (`rank`, `run_dir` =
    run_dirs[rank] and `Path` defined) from this checkout; asserts both exit 0 and returns the last line each printed from Python
    (its prints go to a file of their own: Gloo's C++ "[Gloo] Rank N is connected" lines, written to
    the same stdout from another buffer, once split a printed line in two)."""
    from nestor.cluster.rendezvous import free_port

    coordinator = f"127.0.0.1:{free_port('127.0.0.1')}"
    script = _TWO_PROCESSES + textwrap.dedent(body)
    with tempfile.TemporaryDirectory(prefix="nestor-printed-") as folder:
        printed = [Path(folder) / str(rank) for rank in range(len(run_dirs))]
        processes = [subprocess.Popen([sys.executable, "-c", script, coordinator, str(rank), str(path),
                                       str(printed[rank]), str(devices)], env=child_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for rank, path in enumerate(run_dirs)]
        errors = [process.communicate(timeout=200)[1] for process in processes]
        lines = [[line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
                 for path in printed]
    assert all(process.returncode == 0 for process in processes), [
        ("\n".join(printed_lines[-20:]), error[-2000:]) for printed_lines, error in zip(lines, errors)]
    return [printed_lines[-1] for printed_lines in lines]
