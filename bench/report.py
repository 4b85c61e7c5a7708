"""Each benchmark owns one section of docs/benchmarks.md, between markers, and rewrites only that."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(name: str, text: str, path: Path = BENCHMARKS) -> None:
    """Replaces the `name` section of `path` (between its markers) with `text`, appending it if absent."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{text.strip()}\n{end}"
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in current and end in current:
        head, rest = current.split(begin, 1)
        current = head + block + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(current)


def provenance() -> str:
    """Returns "<today>, commit <short hash>": when and on what a benchmark measured."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=BENCHMARKS.parent).stdout.strip()
    return f"{datetime.date.today()}, commit {commit}"
