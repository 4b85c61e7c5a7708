"""The fast tier (`pytest -m "not slow"`, README and docs/testing.md): every test file and every room of the
code has a test in it, so the loop a developer runs after each change touches everything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.settings import ROOT
from tests.xdist_groups import FAST_TIER, fast_tier_files

TOP_ROOMS = ("backend", "models", "parallel", "cluster", "orchestrator")


def rooms() -> set[str]:
    """Returns the code's rooms as modules: each top folder, and each package inside orchestrator/."""
    found = {f"nestor.{top}" for top in TOP_ROOMS}
    found |= {f"nestor.orchestrator.{package.parent.name}" for package in (ROOT / "orchestrator").glob("*/__init__.py")}
    return found


def rooms_imported(test_file: Path, every_room: set[str]) -> set[str]:
    """Returns the rooms whose modules `test_file` imports (the innermost room of each `nestor.` import)."""
    imported = set()
    for node in ast.walk(ast.parse(test_file.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                 else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            parts = name.split(".")
            inside = [".".join(parts[:n]) for n in range(len(parts), 1, -1) if ".".join(parts[:n]) in every_room]
            imported.update(inside[:1])
    return imported


def test_every_test_file_has_a_test_in_the_fast_tier(request):
    files = fast_tier_files(request.config)
    assert files, "the collection hook of tests/xdist_groups.py did not run"
    only_slow = sorted(path.name for path, fast in files.items() if not fast)
    assert only_slow == [], (f"these files have no test in the fast tier (-m {FAST_TIER!r}): give each a test that "
                             f"runs in seconds, unmarked: {only_slow}")


def test_every_room_of_the_code_has_a_test_file_in_the_fast_tier(request):
    every_room = rooms()
    assert {"nestor.backend", "nestor.orchestrator.data", "nestor.orchestrator.hf"} <= every_room
    files = fast_tier_files(request.config)
    if not {path.name for path in files} >= {path.name for path in (ROOT / "tests").glob("test_*.py")}:
        pytest.skip("judged only when the whole tests/ folder is collected")
    covered = set().union(*(rooms_imported(path, every_room) for path, fast in files.items() if fast))
    assert covered == every_room, f"no test file with a fast test imports {sorted(every_room - covered)}"
