"""Tests run on 8 simulated CPU devices; the flag must be set before jax starts."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # test this checkout, whatever is installed

from tests.settings import DEFAULT_CPU_BUILD, FAST_COMPILE, FUSION_EMITTERS, PATIENT_COLLECTIVES, TINY  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), FAST_COMPILE, PATIENT_COLLECTIVES]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The local Ray heads the suite's commands keep up between them (cluster.keep_head_s) are recorded apart from
# the developer's own (~/.cache/nestor/ray-heads), which the suite never joins or stops; every process a test
# starts inherits it. Each process of the suite (pytest-xdist's controller and workers) makes its own and
# removes it at its end.
HEADS_DIR = os.environ["NESTOR_HEADS_DIR"] = tempfile.mkdtemp(prefix="nestor-heads-")

from nestor.cluster.cpu_devices import one_program_at_a_time, simulate_cpu_devices_before_import  # noqa: E402

simulate_cpu_devices_before_import(8)

import jax  # noqa: E402

one_program_at_a_time(jax)
import pytest  # noqa: E402

from nestor.orchestrator.loader import config as config_lib  # noqa: E402
# The suite's order, how it is shared between pytest-xdist workers, and a crashed worker's test run once more
# (hooks of this conftest).
from tests.xdist_groups import (pytest_collection_modifyitems, pytest_runtest_setup,  # noqa: E402,F401
                                 pytest_terminal_summary, pytest_xdist_make_scheduler)

jax.config.update("jax_num_cpu_devices", 8)


def pytest_unconfigure(config):
    """Removes this process's directory of kept heads: the Ray files' heads ended with their files
    (`_kept_heads_end_with_their_file`)."""
    shutil.rmtree(HEADS_DIR, ignore_errors=True)


@pytest.fixture
def tiny_config(tmp_path):
    """Returns a loader: tiny_config(*overrides) -> Config for the tiny model in a temp run dir."""

    def make(*overrides: str, **dotted):
        config = config_lib.load(None, [*TINY, f"run.dir={tmp_path / 'run'}", *overrides])
        return config.replace(**dotted) if dotted else config

    return make


@pytest.fixture(scope="session")
def unrelated_ray_head(tmp_path_factory):
    """A Ray head of someone else's on this machine, started before the first Ray test's body and up until
    the suite ends, beside every Ray test and doc block (which start and stop heads of their own): yields its
    GCS address and its GCS server's and raylet's (pid, start time)."""
    import time

    from nestor.cluster.head import head_processes
    from tests.test_cluster import PYTHON, start_ray_head, stop_ray_head, user_shell

    env = dict(user_shell(), PATH=f"{Path(PYTHON).parent}:{os.environ['PATH']}", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    # Its own sessions directory: a Ray job's driver joins the newest cluster of /tmp/ray ("auto"), so one
    # started there after a test's own head would take that test's submitted jobs (a short path: Ray's
    # sockets live under it)
    sessions = tempfile.mkdtemp(prefix="nestor-ray-", dir="/tmp")
    head, _, gcs_address = start_ray_head(env, tmp_path_factory.mktemp("unrelated-head") / "head.log", sessions)

    def daemons() -> set[tuple[int, float]]:
        return {(process.pid, process.create_time()) for process in head_processes(gcs_address)
                if process.name() in ("gcs_server", "raylet")}

    deadline = time.monotonic() + 60  # the raylet may come up after the dashboard answers
    while len(daemons()) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)

    stopped = []

    def stop() -> None:
        if not stopped:
            stopped.append(True)
            stop_ray_head(head)
            shutil.rmtree(sessions, ignore_errors=True)

    _UNRELATED_HEAD_STOPS.append(stop)
    try:
        yield gcs_address, daemons()
    finally:
        stop()


# An idle head still costs its machine CPU (docs/cluster.md): the unrelated head ends after the last Ray file.
_UNRELATED_HEAD_STOPS: list = []


@pytest.fixture(scope="module", autouse=True)
def _kept_heads_end_with_their_file(request):
    """The local Ray heads a Ray file's commands kept warm (`cluster.keep_head_s`) end with that file: its
    tests share them, later files start from none; `unrelated_ray_head` ends with the last Ray file."""
    from tests.xdist_groups import RAY_FILES

    yield
    if Path(request.module.__file__).name in RAY_FILES:
        from nestor.cluster.warm_head import stop_warm_heads

        stop_warm_heads(wait_s=60)
        ray_files = [item.path for item in request.session.items if item.path.name in RAY_FILES]
        if ray_files and Path(request.module.__file__) == ray_files[-1]:  # no Ray test runs after this file
            for stop in _UNRELATED_HEAD_STOPS:
                stop()


@pytest.fixture(autouse=True)
def _ray_tests_run_beside_an_unrelated_head(request):
    """Every Ray test runs with `unrelated_ray_head` up (tests/test_user_path.py checks it is untouched)."""
    if request.node.get_closest_marker("ray"):
        request.getfixturevalue("unrelated_ray_head")


# The marks whose tests compile as outside the suite, the fuller build first, and the compiler options each restores.
CPU_BUILD_MARKS = {"default_cpu_build": DEFAULT_CPU_BUILD, "default_cpu_codegen": FUSION_EMITTERS}


@pytest.fixture(autouse=True)
def _cpu_build_of_marked_tests(request, monkeypatch):
    """A test marked `default_cpu_codegen` compiles with XLA:CPU's fusion emitters, as outside the suite
    (FAST_COMPILE turns them off), one marked `default_cpu_build` with LLVM's default optimizations too: every
    `Lowered.compile` it makes gets them as compiler options."""
    options = next((options for mark, options in CPU_BUILD_MARKS.items() if request.node.get_closest_marker(mark)),
                   None)
    if options is None:
        return
    compile_lowered = jax.stages.Lowered.compile

    def compile_as_outside_the_suite(self, compiler_options=None, **kwargs):
        return compile_lowered(self, {**options, **(compiler_options or {})}, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_as_outside_the_suite)
