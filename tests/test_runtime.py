"""XLA:CPU's thread pool for simulated devices, in each kind of process that simulates them, and its one
program at a time.

A pipeline4 x fsdp2 step aborted the suite ("Fatal Python error: Aborted", no message) when every thread
of XLA:CPU's pool (8 threads for 8 devices on 2 cores) waited in a collective for a device that had no
thread left to join it; `cluster.cpu_devices.size_cpu_thread_pool` gives the pool THREADS_PER_DEVICE
threads per device.
These tests read the pool's threads from /proc, so they also check that the installed XLA reads the size.
With asynchronous dispatch two train steps were in flight, each with its waiters, and the same step still
hung once a suite run: nestor's processes and the suite's dispatch one CPU program at a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from nestor.cluster.cpu_devices import THREADS_PER_DEVICE
from tests.settings import ROOT
from tests.doc_blocks import user_env

COUNT_POOL_THREADS = textwrap.dedent("""
    import jax
    import jax.numpy as jnp
    from pathlib import Path
    assert float(jnp.arange(4.0).sum()) == 6.0  # the backend is up and has run a program
    names = [path.read_text().strip() for path in Path("/proc/self/task").glob("*/comm")]
    print(jax.device_count(), names.count("tf_XLAEigen"), jax.config.values["jax_cpu_enable_async_dispatch"])
""")
SETUPS = {
    "nestor train": "from nestor.orchestrator.loader.config import load\nfrom nestor.orchestrator.job.processes import configure_jax\n"
                    "configure_jax(load(None, []))",
    "ray worker": "import jax\nfrom nestor.cluster.cpu_devices import simulate_cpu_devices\nsimulate_cpu_devices(jax, 8)",
    "bench script": "from nestor.cluster.cpu_devices import simulate_cpu_devices_before_import\n"
                    "simulate_cpu_devices_before_import(8)",
}


# The child runs on 2 cores, as on this project's machines: XLA's own pool there (max(cores, devices)
# threads) is 8 for 8 devices, so a pool of THREADS_PER_DEVICE x 8 shows nestor sized it, whatever the host's cores.
TWO_CORES = "import os\nos.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])\n"


def devices_and_pool_threads(setup: str, tmp_path: Path, **env: str) -> tuple[int, int]:
    """Runs `setup` in a fresh process from a user's shell, on 2 cores; returns its device count and pool
    threads (and asserts it dispatches one program at a time where jax was imported before the setup)."""
    done = subprocess.run([sys.executable, "-c", TWO_CORES + setup + "\n" + COUNT_POOL_THREADS], cwd=tmp_path,
                          text=True, capture_output=True, timeout=120,
                          env={**user_env(), "PYTHONPATH": str(ROOT), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    devices, threads, asynchronous = done.stdout.split()
    assert asynchronous == str("before_import" in setup), setup  # a script before jax's import cannot set it
    return int(devices), int(threads)


@pytest.mark.slow
@pytest.mark.parametrize("process", list(SETUPS))
def test_every_process_that_simulates_devices_gives_the_pool_its_threads_per_device(process, tmp_path):
    assert devices_and_pool_threads(SETUPS[process], tmp_path) == (8, THREADS_PER_DEVICE * 8)


def test_a_larger_pool_the_user_set_is_kept_and_a_smaller_one_raised(tmp_path):
    larger = THREADS_PER_DEVICE * 8 + 8
    assert devices_and_pool_threads(SETUPS["nestor train"], tmp_path, PJRT_NPROC=str(larger)) == (8, larger)
    assert devices_and_pool_threads(SETUPS["nestor train"], tmp_path, PJRT_NPROC="11") == (8, THREADS_PER_DEVICE * 8)


def test_the_suites_own_process_has_the_pool_it_needs():
    assert not jax.config.values["jax_cpu_enable_async_dispatch"]
    devices = jax.device_count()  # starts the backend, if no test has yet
    names = [path.read_text().strip() for path in Path("/proc/self/task").glob("*/comm")]
    # The size the suite asked for (so not XLA's own, whatever the host's cores) and THREADS_PER_DEVICE per device.
    assert names.count("tf_XLAEigen") == int(os.environ["PJRT_NPROC"]) >= THREADS_PER_DEVICE * devices
