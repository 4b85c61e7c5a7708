"""The commands the docs show, run as written, in a fresh copy of the repository.

Each fenced ```bash and ```python block of README.md and docs/*.md is run by
`tests/test_docs.py`, and other tests read what a block printed and wrote
(`run_block`): the README's main command is run once per suite, not once per
test that looks at it.

A block's commands run in order, in one shell; `.venv/bin/` means the test's
virtual environment, whose installation (`python3 -m venv .venv &&
.venv/bin/pip install ...`) CI has already done, and `source
.venv/bin/activate` puts it on PATH for that block and the later blocks of its
doc, as in a user's terminal; without it, bare `nestor` or `python` is not
found, as after the README's commands. To stay within CI's time, every `train.steps=K` becomes
K // 10 and a `nestor train` without one trains 5 steps. A block preceded by
`<!-- doc-test: skip: REASON -->` needs what a test cannot have (a cloud
project, accelerators) and is skipped with that reason; one preceded by
`<!-- doc-test: free-ports -->` starts a server, and its well-known ports
(6379, 8265) become free ones.
The commands get the suite's quicker XLA:CPU code generation (`user_env`), nothing else of its settings.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from nestor.cluster.rendezvous import free_port
from tests.settings import FAST_COMPILE

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
_FENCE = re.compile(r"(?:<!-- doc-test: (?P<marker>[^>]*?) -->\n)?```(?P<language>bash|python)\n(?P<body>.*?)```",
                    re.S)
THIS_SUITE = "python -m pytest"
ACTIVATE = "source .venv/bin/activate"
_INSTALL = re.compile(r"python3 -m venv \.venv && \.venv/bin/pip install -e [^&]+ && ")


def fresh_copy(destination: Path) -> Path:
    """Copies the repository's tracked and untracked-but-not-ignored files to `destination` (a user's clone)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for name in files:
        if (ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, destination / name)
    return destination


# Set in this process by the suite (conftest) or by an earlier test (a Ray client turns token auth on with
# RAY_AUTH_MODE): a user's shell has none of them.
SUITE_SETTINGS = ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH", "PJRT_NPROC")
SESSION_SETTINGS = ("RAY_AUTH_MODE",)


def user_env() -> dict[str, str]:
    """The environment of a user's shell: none of the test suite's settings but XLA:CPU's quicker code
    generation (settings.FAST_COMPILE): a block's few steps spend most of their time compiling."""
    env = {k: v for k, v in os.environ.items() if k not in SUITE_SETTINGS + SESSION_SETTINGS}
    return {**env, "XLA_FLAGS": FAST_COMPILE}


def ray_daemons() -> set[int]:
    """Returns the pids of raylet and gcs_server processes on this machine."""
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in ("raylet", "gcs_server")}


def kept_head_daemons() -> set[int]:
    """Returns the pids of the processes of this user's local Ray heads kept warm between commands
    (`cluster.keep_head_s`, which `nestor stop-head` ends; tests/test_warm_head.py)."""
    from nestor.cluster.head import head_processes
    from nestor.cluster.warm_head import warm_heads

    return {process.pid for head in warm_heads() for process in head_processes(head.address)}


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

    @property
    def skip_reason(self) -> str | None:
        """Why the block cannot run here, or None."""
        if self.marker and self.marker.startswith("skip:"):
            return f"{self.id}: {self.marker.removeprefix('skip:').strip()}"
        if not runnable(self).strip():
            return f"{self.id}: runs this test suite, which CI runs as .ci/run"
        return None


def blocks() -> list[Block]:
    """Returns the runnable fenced blocks of every doc, in order."""
    found = []
    for doc in DOCS:
        for index, match in enumerate(_FENCE.finditer(doc.read_text())):
            found.append(Block(str(doc.relative_to(ROOT)), index, match["language"], match["body"], match["marker"]))
    return found


def fewer_steps(command: str) -> str:
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
        line = _INSTALL.sub("", line).replace(ACTIVATE, f"export PATH={VENV_BIN}:$PATH")
        line = line.replace(".venv/bin/", f"{VENV_BIN}/")
        lines.append(fewer_steps(line))
    text = "\n".join(lines)
    if block.marker == "free-ports":
        for port in ("6379", "8265"):
            text = text.replace(port, str(free_port("127.0.0.1")))
    return text


@dataclass(frozen=True)
class BlockRun:
    block: Block
    text: str                        # what ran (see `runnable`)
    clone: Path                      # the doc's fresh copy it ran in
    process: subprocess.CompletedProcess
    seconds: float
    leftover_daemons: set[int]       # Ray daemons it started that still ran 20 s after it ended, but a kept head's


_CLONES: dict[str, Path] = {}
_RUNS: dict[str, BlockRun] = {}


def run_block(block_id: str, tmp_path_factory) -> BlockRun:
    """Runs the doc block `block_id` (e.g. "README.md#0") once per test session, after the earlier
    blocks of its doc, in that doc's fresh copy; returns its run (also every later call)."""
    every = {block.id: block for block in blocks()}
    block = every[block_id]
    for earlier in range(block.index):  # later blocks see what earlier ones made
        previous = every[f"{block.doc}#{earlier}"]
        if previous.skip_reason is None and previous.id not in _RUNS:
            run_block(previous.id, tmp_path_factory)
    if block_id not in _RUNS:
        if block.doc not in _CLONES:
            _CLONES[block.doc] = fresh_copy(tmp_path_factory.mktemp(Path(block.doc).stem))
            shared = _CLONES[block.doc].parent / "shared"  # ../shared beside the copy, as beside a checkout
            if not shared.exists() and (ROOT.parent / "shared").is_dir():
                shared.symlink_to(ROOT.parent / "shared")
        _RUNS[block_id] = _run(block, _CLONES[block.doc])
    return _RUNS[block_id]


def activated(block: Block) -> bool:
    """Returns whether the block, or an earlier block of its doc, activates the environment (`ACTIVATE`)."""
    return any(ACTIVATE in other.body for other in blocks() if other.doc == block.doc and other.index <= block.index)


def _run(block: Block, clone: Path) -> BlockRun:
    text = runnable(block)
    if block.language == "bash" and activated(block) and ACTIVATE not in block.body:
        text = f"export PATH={VENV_BIN}:$PATH\n{text}"  # the doc's terminal, activated by an earlier block
    env = user_env()
    command = [sys.executable, "-"] if block.language == "python" else ["bash", "-euo", "pipefail", "-c", text]
    before = ray_daemons()
    started = time.perf_counter()
    try:
        process = subprocess.run(command, input=text if block.language == "python" else None, cwd=clone, env=env,
                                 capture_output=True, text=True, timeout=840)
    finally:
        # a block that failed half-way must not leave its head to later tests; other heads on the machine stay
        for port in re.findall(r"ray start --head .*?--port=(\d+)", text):
            subprocess.run([str(VENV_BIN / "nestor"), "stop-head", "--address", f"127.0.0.1:{port}"], env=env,
                           capture_output=True, timeout=120)
    seconds = time.perf_counter() - started
    deadline = time.monotonic() + 20  # daemons exit a moment after ray.shutdown returns
    while ray_daemons() - before - kept_head_daemons() and time.monotonic() < deadline:
        time.sleep(0.5)
    return BlockRun(block, text, clone, process, seconds, ray_daemons() - before - kept_head_daemons())
