"""How the suite's tests are ordered and shared between pytest-xdist workers (the README's `-n 2`,
docs/testing.md); the hooks are tests/conftest.py's, kept here without jax so that a test can run them on a
small suite.

A worker takes a whole file at a time (its module fixtures, compiled steps among them, are built once), and
the files whose tests start Ray clusters all go to one worker, first (they take longest): they count the
machine's Ray daemons before and after, so they must never run beside each other.
xdist's own `--dist loadgroup` cannot do this under pytest 9.2 (it renames `item._nodeid`, which pytest
no longer reads).

A test whose worker dies (an in-process run's hang watchdog ends a process stuck in XLA:CPU, docs/cluster.md)
runs once more on the replacement worker; a second death fails it. Each rerun is said when it happens and
again at the end of the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The fast tier, the loop a developer runs after every change (README, docs/testing.md): `pytest -m "not slow"`.
# A test that starts Ray or several JAX processes is slow whatever its own marks say.
FAST_TIER = "not slow"
SLOW_WHATEVER_ELSE = ("ray", "multiprocess")
# The files whose tests start Ray clusters (the `ray` mark).
RAY_FILES = ("test_cluster.py", "test_docs.py", "test_user_path.py", "test_warm_head.py")
# How many times a test may end its worker before it is reported failed.
RERUNS_AFTER_A_CRASH = 1


FAST_FILES = pytest.StashKey[dict]()  # test file -> whether it has a test in the fast tier


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marks added here count
def pytest_collection_modifyitems(config, items):
    """Runs the Ray files first, each file's tests in their order; marks `slow` every test of
    SLOW_WHATEVER_ELSE; keeps the collection's files, each with whether it has a test in the fast tier
    (`fast_tier_files`)."""
    items.sort(key=lambda item: item.path.name not in RAY_FILES)  # a stable sort
    fast: dict[Path, bool] = {}
    # a file whose tests were named one by one (`file.py::test`) was not collected whole: it is not judged
    named = {Path(arg.split("::")[0]).name for arg in config.args if "::" in arg}
    for item in items:
        if not item.get_closest_marker("slow") and any(item.get_closest_marker(m) for m in SLOW_WHATEVER_ELSE):
            item.add_marker("slow")
        if item.path.name not in named:
            fast[item.path] = fast.get(item.path, False) or not item.get_closest_marker("slow")
    config.stash[FAST_FILES] = fast



def fast_tier_files(config) -> dict[Path, bool]:
    """Returns every test file collected whole -> whether one of its tests is in the fast tier."""
    return config.stash.get(FAST_FILES, {})


def pytest_runtest_setup(item):
    """Fails a `ray` test outside RAY_FILES before it starts anything: it could run beside the Ray files.
    (A collection error would do under one process, but breaks xdist's controller: its workers have
    already sent their collections.)"""
    if item.get_closest_marker("ray") and item.path.name not in RAY_FILES:
        pytest.fail(f"{item.nodeid} is marked `ray` but its file is not in tests/xdist_groups.py's RAY_FILES, "
                    "so it could run beside the tests that start Ray clusters", pytrace=False)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Returns xdist's scheduler by file, with the Ray files as one unit of work, handed out first."""
    from xdist.scheduler import LoadScopeScheduling

    class RayFilesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "ray" if Path(file).name in RAY_FILES else file

        def schedule(self) -> None:
            self.config.option.loadscopereorder = False  # collection order: the Ray files first
            super().schedule()

        def _reschedule(self, node) -> None:
            """Gives `node` more work once it has collected. xdist's `schedule` reschedules every node when
            a replacement worker finishes collecting, also a second replacement still collecting (after two
            crashes close together), and raised KeyError for it (INTERNALERROR, the run ended with exit 3);
            such a node is scheduled by the `schedule` its own collection calls."""
            if node in self.registered_collections:
                super()._reschedule(node)

        def remove_node(self, node) -> str | None:
            """Hands a crashed worker's unfinished tests to the others; returns the test it crashed in when that
            test has now crashed more than RERUNS_AFTER_A_CRASH times (xdist reports it failed), else None (it
            runs again, first of what is left of its file).

            xdist's LoadScopeScheduling re-queues every unit the dead worker had, finished ones too, and its
            crashed test as still to run: a worker handed a finished unit is sent no test, so never asks for
            more, and the run waited forever on the units behind it; and a test that always crashes its worker
            ran again on each replacement."""
            workload = self.assigned_work.pop(node)
            pending = [(scope, nodeid) for scope, unit in workload.items() for nodeid, done in unit.items()
                       if not done]
            if not pending:
                return None
            scope, crashitem = pending[0]  # a worker runs its tests in the order it was sent them
            crashes = self.config.stash.setdefault(CRASHES, {})
            crashes[crashitem] = crashes.get(crashitem, 0) + 1
            failed = crashes[crashitem] > RERUNS_AFTER_A_CRASH or not _replaced(self.config)
            workload[scope][crashitem] = failed
            self.workqueue.update((scope, unit) for scope, unit in workload.items() if not all(unit.values()))
            # A worker whose collection has not come yet gets its work from schedule() when it comes.
            for other in self.assigned_work:
                if other in self.registered_collections:
                    self._reschedule(other)
            if not failed:
                _say(self.config, f"{crashitem} ended worker {node.gateway.id}: it runs once more on another")
            return crashitem if failed else None

    return RayFilesTogether(config, log)


CRASHES = pytest.StashKey[dict]()  # test id -> how many workers it ended


def _replaced(config) -> bool:
    """Whether xdist starts a worker in place of the one that just died: not once `--max-worker-restart`
    workers have died (it then ends the run, and a test left to rerun would never run)."""
    session = config.pluginmanager.get_plugin("dsession")
    deaths, limit = getattr(session, "_failed_nodes_count", None), getattr(session, "_max_worker_restart", None)
    return deaths is not None and (limit is None or deaths + 1 <= limit)  # xdist counts this death after us


def _say(config, line: str) -> None:
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        terminal.write_line(line)


def pytest_terminal_summary(terminalreporter, config):
    """Lists the tests that ended a worker, with how many times (a rerun that passed is still listed)."""
    crashes = config.stash.get(CRASHES, {})
    if crashes:
        terminalreporter.section("tests that ended their worker")
        for nodeid, times in crashes.items():
            terminalreporter.write_line(f"{nodeid}: {times} time(s)")
