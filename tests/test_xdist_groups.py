"""The suite's share-out between pytest-xdist workers (tests/xdist_groups.py), run on a small suite of its own:
the Ray files go to one worker, before anything else it runs; the other files are shared out by file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.settings import ROOT

# Each test notes its file and worker, in the order the tests run.
TESTS = '''
import os
import pytest

def note():
    with open(os.environ["NOTES"], "a") as notes:
        notes.write(f"{{os.path.basename(__file__)}} {{os.environ.get('PYTEST_XDIST_WORKER', 'main')}}\\n")

{tests}
'''
PLAIN = "def test_{i}():\n    note()\n"
RAY = "@pytest.mark.ray\ndef test_ray_{i}():\n    note()\n"
CRASH = "def test_crash():\n    note()\n    os.abort()\n"  # ends its worker each time it runs
SLOW = "@pytest.mark.slow\ndef test_slow_{i}():\n    note()\n"
MULTIPROCESS = "@pytest.mark.multiprocess\ndef test_processes_{i}():\n    note()\n"


def small_suite(directory: Path, files: dict[str, str]) -> Path:
    """Writes a suite whose conftest takes the hooks of tests/xdist_groups.py; returns its directory."""
    directory.mkdir()
    (directory / "pytest.ini").write_text("[pytest]\nmarkers =\n    ray: starts a local Ray cluster\n"
                                          "    slow: slow\n    multiprocess: several processes\n")
    (directory / "conftest.py").write_text("from tests.xdist_groups import fast_tier_files, "
                                           "pytest_collection_modifyitems, pytest_runtest_setup, "
                                           "pytest_terminal_summary, pytest_xdist_make_scheduler  # noqa\n")
    for name, tests in files.items():
        (directory / name).write_text(TESTS.format(tests=tests))
    return directory


def run_pytest(suite: Path, notes: Path, *args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env.update(PYTHONPATH=str(ROOT), NOTES=str(notes))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--basetemp={suite.parent / 'basetemp'}", *args], cwd=suite, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_ray_files_run_on_one_worker_before_anything_else_it_runs(tmp_path):
    # Two plain files hold more tests than the Ray files together: xdist's own order (the largest unit of
    # work first) would hand those out first.
    plain, larger = ("\n".join(PLAIN.format(i=i) for i in range(count)) for count in (3, 7))
    ray = "\n".join(RAY.format(i=i) for i in range(2)) + "\n" + PLAIN.format(i=9)
    suite = small_suite(tmp_path / "suite", {"test_a.py": larger, "test_b.py": larger, "test_c.py": plain,
                                             "test_cluster.py": ray, "test_docs.py": ray, "test_d.py": plain})
    notes = tmp_path / "notes"
    done = run_pytest(suite, notes, "-n", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = [line.split() for line in notes.read_text().splitlines()]
    assert len(ran) == 26
    ray_workers = {worker for file, worker in ran if file in ("test_cluster.py", "test_docs.py")}
    assert len(ray_workers) == 1, ran
    [ray_worker] = ray_workers
    on_it = [file for file, worker in ran if worker == ray_worker]
    assert on_it[:6] == ["test_cluster.py"] * 3 + ["test_docs.py"] * 3, ran
    other = {file for file, worker in ran if worker != ray_worker}
    assert other and not other & {"test_cluster.py", "test_docs.py"}, ran  # both workers worked
    for file in ("test_a.py", "test_b.py", "test_c.py", "test_d.py"):  # a file stays on one worker
        assert len({worker for name, worker in ran if name == file}) == 1, ran


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two workers"])
def test_a_ray_test_outside_the_ray_files_fails_before_it_runs(tmp_path, workers):
    suite = small_suite(tmp_path / "suite", {"test_a.py": PLAIN.format(i=0) + "\n" + RAY.format(i=1),
                                             "test_b.py": PLAIN.format(i=0)})
    notes = tmp_path / "notes"
    done = run_pytest(suite, notes, *workers)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test_a.py::test_ray_1 is marked `ray` but its file is not in tests/xdist_groups.py's RAY_FILES" \
        in done.stdout, done.stdout[-3000:]
    assert sorted(line.split()[0] for line in notes.read_text().splitlines()) == ["test_a.py", "test_b.py"]


def test_a_test_that_crashes_its_worker_twice_fails_once_run_again_passes_and_the_rest_still_run(tmp_path):
    # Each worker is handed two of the five files at once, then told to shut down; the crashes come in the second
    # file of a worker, after a file it finished and before more tests (the hang this guards against: xdist
    # re-queued the finished file too, and the replacement worker, handed it, waited forever).
    plain = "\n".join(PLAIN.format(i=i) for i in range(2))
    crash = PLAIN.format(i=0) + "\n" + CRASH + "\n" + "\n".join(PLAIN.format(i=i) for i in (2, 3))
    # Its first run ends the worker, its second passes (the marker file says which run it is).
    once = PLAIN.format(i=0) + textwrap.dedent("""
        def test_crash_once():
            note()
            marker = os.environ["NOTES"] + ".crashed"
            if not os.path.exists(marker):
                open(marker, "w").close()
                os.abort()
        """) + "\n" + PLAIN.format(i=2)
    suite = small_suite(tmp_path / "suite", {"test_a.py": plain, "test_b.py": plain, "test_c.py": crash,
                                             "test_d.py": plain, "test_e.py": once})
    notes = tmp_path / "notes"
    done = run_pytest(suite, notes, "-n", "2", "-rA")  # the helper's timeout: the run must end
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    outcomes = [line.split(" - ")[0].split() for line in done.stdout.splitlines()
                if line.startswith(("PASSED ", "FAILED ", "ERROR "))]
    passed = [f"{file}::test_{i}" for file in ("test_a.py", "test_b.py", "test_d.py") for i in (0, 1)] + \
        [f"test_c.py::test_{i}" for i in (0, 2, 3)] + ["test_e.py::test_0", "test_e.py::test_crash_once",
                                                         "test_e.py::test_2"]
    expected = [["FAILED", "test_c.py::test_crash"]] + [["PASSED", test] for test in passed]
    assert sorted(outcomes) == sorted(expected), done.stdout[-3000:]
    assert "crashed while running 'test_c.py::test_crash'" in done.stdout, done.stdout[-3000:]
    for test in ("test_c.py::test_crash", "test_e.py::test_crash_once"):
        assert re.search(rf"{test} ended worker gw\d: it runs once more on another", done.stdout), done.stdout[-3000:]
    summary = done.stdout.split("tests that ended their worker")[1]
    assert "test_c.py::test_crash: 2 time(s)" in summary and "test_e.py::test_crash_once: 1 time(s)" in summary
    ran = sorted(line.split()[0] for line in notes.read_text().splitlines())  # the crashing tests twice
    assert ran == ["test_a.py"] * 2 + ["test_b.py"] * 2 + ["test_c.py"] * 5 + ["test_d.py"] * 2 + \
        ["test_e.py"] * 4, ran


@pytest.mark.slow
def test_a_crash_when_xdist_starts_no_more_workers_fails_its_test(tmp_path):
    # With --max-worker-restart=0 the first death ends the run: a test left to run once more would never run,
    # and the run would pass without it.
    crash = PLAIN.format(i=0) + "\n" + CRASH + "\n" + PLAIN.format(i=2)
    suite = small_suite(tmp_path / "suite", {"test_a.py": crash, "test_b.py": PLAIN.format(i=0)})
    done = run_pytest(suite, tmp_path / "notes", "-n", "2", "--max-worker-restart=0", "-rA")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FAILED test_a.py::test_crash" in done.stdout, done.stdout[-3000:]
    assert "runs once more" not in done.stdout and "test_a.py::test_crash: 1 time(s)" in done.stdout


def test_the_fast_tier_leaves_out_slow_ray_and_multiprocess_tests_and_knows_each_files_share(tmp_path):
    # A test of the small suite notes which of its files have a fast test, as the collection hook saw them.
    files = textwrap.dedent("""
        def test_files(request):
            from conftest import fast_tier_files
            with open(os.environ["NOTES"] + ".files", "w") as out:
                for path, fast in sorted(fast_tier_files(request.config).items()):
                    out.write(f"{path.name} {fast}\\n")
        """)
    suite = small_suite(tmp_path / "suite", {"test_a.py": PLAIN.format(i=0) + "\n" + SLOW.format(i=1),
                                             "test_b.py": SLOW.format(i=0) + "\n" + MULTIPROCESS.format(i=1),
                                             "test_cluster.py": RAY.format(i=0), "test_files.py": files})
    notes = tmp_path / "notes"
    done = run_pytest(suite, notes, "-m", "not slow", "-rA")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(line.split()[0] for line in notes.read_text().splitlines()) == ["test_a.py"]
    assert re.search(r"\b2 passed, 4 deselected\b", done.stdout), done.stdout[-3000:]
    shares = dict(line.split() for line in Path(f"{notes}.files").read_text().splitlines())
    assert shares == {"test_a.py": "True", "test_b.py": "False", "test_cluster.py": "False", "test_files.py": "True"}
    # a file whose tests were named one by one was not collected whole: it is not judged
    done = run_pytest(suite, notes, "test_b.py::test_slow_0", "test_files.py", "test_a.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shares = dict(line.split() for line in Path(f"{notes}.files").read_text().splitlines())
    assert shares == {"test_a.py": "True", "test_files.py": "True"}


class _Worker:
    """What the scheduler asks of an xdist worker: the tests it is sent, and whether it was told to stop."""

    def __init__(self, name: str):
        self.gateway = type("Gateway", (), {"id": name})()
        self.shutting_down, self.sent = False, []

    def send_runtest_some(self, indexes):
        self.sent.extend(indexes)

    def shutdown(self):
        self.shutting_down = True


def test_a_replacement_worker_still_collecting_is_handed_no_work_until_it_has_collected():
    """Two workers crashing close together leave one replacement collecting while the other's collection
    reschedules every worker: the scheduler must wait for the first's collection (it raised KeyError, an
    INTERNALERROR that ended the run)."""
    from types import SimpleNamespace

    from tests.xdist_groups import pytest_xdist_make_scheduler

    options = {"tx": ["2*popen"], "dist": "loadscope", "numprocesses": 2, "maxworkerrestart": None}
    config = SimpleNamespace(getvalue=options.get, option=SimpleNamespace(loadscopereorder=False), stash={})
    scheduler = pytest_xdist_make_scheduler(config, log=None)
    collection = [f"test_{file}.py::test_{i}" for file in "abcdef" for i in range(4)]
    first, second, late, collected = (_Worker(f"gw{i}") for i in range(4))
    for worker in (first, second):
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    assert first.sent and second.sent
    for worker in (late, collected):  # two replacements start; `collected` finishes collecting first
        scheduler.add_node(worker)
    scheduler.add_node_collection(collected, collection)
    scheduler.schedule()
    assert late.sent == [] and collected.sent
    scheduler.add_node_collection(late, collection)
    scheduler.schedule()
    assert late.sent
