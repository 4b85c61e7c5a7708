"""Every command the docs show, run as written, in a fresh copy of the repository.

Each fenced ```bash and ```python block of README.md and docs/*.md is a test.
Its commands run in order, in one shell with the test's virtual environment
on PATH (an activated venv); `.venv/bin/` means that environment, whose
installation (`python3 -m venv .venv && .venv/bin/pip install ...`) CI has
already done. To stay within CI's time, every `train.steps=K` becomes
K // 10 and a `nestor train` without one trains 5 steps. A block preceded by
`<!-- doc-test: skip: REASON -->` needs what a test cannot have (a cloud
project, accelerators) and is skipped with that reason; one preceded by
`<!-- doc-test: free-ports -->` starts a server, and its well-known ports
(6379, 8265) become free ones.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.rendezvous import free_port
from tests.conftest import ROOT
from tests.test_user_path import fresh_copy, user_env

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
_FENCE = re.compile(r"(?:<!-- doc-test: (?P<marker>[^>]*?) -->\n)?```(?P<language>bash|python)\n(?P<body>.*?)```",
                    re.S)
THIS_SUITE = "python -m pytest"
_INSTALL = re.compile(r"python3 -m venv \.venv && \.venv/bin/pip install -e [^&]+ && ")


@dataclass(frozen=True)
class Block:
    doc: str          # path relative to the repository root
    index: int        # the block's position among the runnable blocks of its doc
    language: str     # bash | python
    body: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"{self.doc}#{self.index}"


def blocks() -> list[Block]:
    """Returns the runnable fenced blocks of every doc, in order."""
    found = []
    for doc in DOCS:
        for index, match in enumerate(_FENCE.finditer(doc.read_text())):
            found.append(Block(str(doc.relative_to(ROOT)), index, match["language"], match["body"], match["marker"]))
    return found


def _fewer_steps(command: str) -> str:
    command = re.sub(r"\btrain\.steps=(\d+)", lambda m: f"train.steps={max(int(m[1]) // 10, 1)}", command)
    if re.search(r"\bnestor (train|submit) ", command) and "train.steps=" not in command:
        command = re.sub(r"(\bnestor (?:train|submit) \S+)", r"\1 train.steps=5", command, count=1)
    return command


def runnable(block: Block) -> str:
    """Returns the block's text as the test runs it (see the module docstring)."""
    if block.language == "python":
        return block.body
    lines = []
    for line in block.body.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#") or THIS_SUITE in line:
            continue  # the line that runs this suite is what CI runs (.ci/run)
        line = _INSTALL.sub("", line).replace(".venv/bin/", f"{VENV_BIN}/")
        lines.append(_fewer_steps(line))
    text = "\n".join(lines)
    if block.marker == "free-ports":
        for port in ("6379", "8265"):
            text = text.replace(port, str(free_port("127.0.0.1")))
    return text


@pytest.mark.ray
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", blocks(), ids=lambda block: block.id)
def test_doc_block_runs_as_written(block, tmp_path_factory):
    if block.marker and block.marker.startswith("skip:"):
        pytest.skip(f"{block.id}: {block.marker.removeprefix('skip:').strip()}")
    text = runnable(block)
    if not text.strip():
        pytest.skip(f"{block.id}: runs this test suite, which CI runs as .ci/run")
    clone = _clone_for(block.doc, tmp_path_factory)
    env = dict(user_env(), PATH=f"{VENV_BIN}:{user_env()['PATH']}")
    if block.language == "python":
        command = [sys.executable, "-"]
    else:
        command = ["bash", "-euo", "pipefail", "-c", text]
    try:
        process = subprocess.run(command, input=text if block.language == "python" else None, cwd=clone, env=env,
                                 capture_output=True, text=True, timeout=840)
    finally:
        if "ray start" in text:  # a block that failed half-way must not leave its head to later tests
            subprocess.run([str(VENV_BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)
    assert process.returncode == 0, (f"{block.id} failed (exit {process.returncode}):\n{text}\n--- stdout\n"
                                     f"{process.stdout[-3000:]}\n--- stderr\n{process.stderr[-3000:]}")


_CLONES: dict[str, Path] = {}


def _clone_for(doc: str, tmp_path_factory) -> Path:
    """Returns the fresh copy a doc's blocks run in: one per doc, so later blocks see what earlier ones made."""
    if doc not in _CLONES:
        _CLONES[doc] = fresh_copy(tmp_path_factory.mktemp(Path(doc).stem))
    return _CLONES[doc]


def test_doc_commands_are_found_and_rewritten_as_documented():
    found = {block.id: block for block in blocks()}
    assert "README.md#0" in found and found["README.md#0"].language == "bash"
    first = runnable(found["README.md#0"]).splitlines()[0]
    assert first == f"{VENV_BIN}/nestor train configs/quickstart.yaml train.steps=5"
    assert _fewer_steps("nestor train c.yaml run.dir=a train.steps=50") == "nestor train c.yaml run.dir=a train.steps=5"
    assert any(block.language == "python" for block in found.values())
