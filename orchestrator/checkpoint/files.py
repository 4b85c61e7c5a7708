"""A run's checkpoints on disk: where they live, which step directories are whole, and moving torn ones aside.

A step directory `run.dir/checkpoints/<step>/` is finalized with Orbax's
`_CHECKPOINT_METADATA` (written last, before the rename that finalizes a
save) and its three items. One that is not (copied half, hand-edited) is
moved aside to `run.dir/torn_checkpoints/` with a warning before the owner's
manager counts it, so it neither gets restored nor pushes a good checkpoint
out of the `keep` window.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import jax

from nestor.orchestrator.job.processes import VERDICT_TIMEOUT_S, wait_for_every_process
from nestor.orchestrator.paths import shown

# Orbax writes this file last into a finalized step directory.
METADATA_FILE = "_CHECKPOINT_METADATA"
ITEMS = ("state", "data", "config")
# Orbax writes a step into `<step>.orbax-checkpoint-tmp[-<suffix>]` and renames it when it is complete.
TEMPORARY = ".orbax-checkpoint-tmp"
# The key of nestor's record in a step's Orbax metadata: {"manifest": its file name, "health": ...}.
RECORD = "nestor"


def checkpoint_dir(run_dir: str | Path) -> Path:
    """Returns the directory that holds a run's checkpoints."""
    return Path(run_dir).resolve() / "checkpoints"


def is_finalized(step_dir: Path) -> bool:
    """Returns whether `step_dir` holds Orbax's metadata and every item (a manifest or not)."""
    return (step_dir / METADATA_FILE).is_file() and all((step_dir / item).is_dir() for item in ITEMS)


def finalized_steps(directory: Path) -> list[int]:
    """Returns the steps of the finalized checkpoints in `directory` (a run's `checkpoints/`), oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and is_finalized(p))


def quarantine(step_dir: Path, reason: str, log=print) -> Path:
    """Moves a broken step directory to `run.dir/torn_checkpoints/`; returns where it went.

    `reason` completes "checkpoint <dir> is ...", e.g. "incomplete (missing metadata)".
    """
    target = step_dir.parent.parent / "torn_checkpoints" / f"{step_dir.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(step_dir), str(target))
    log(f"warning: checkpoint {shown(step_dir)} is {reason}; skipped and moved to {shown(target)}")
    return target


def quarantine_incomplete(directory: Path, log=print) -> list[Path]:
    """Moves aside every `<step>` directory that lacks Orbax's metadata or an item and deletes the
    temporary directories of saves that never finished; returns the moved ones. Only for the run that
    holds run.dir (another's save may be in flight).

    Process 0 moves; every process waits for it before going on, so none lists a
    step directory that is about to go.
    """
    moved = []
    if directory.is_dir() and jax.process_index() == 0:
        for unfinished in directory.glob(f"*{TEMPORARY}*"):
            shutil.rmtree(unfinished, ignore_errors=True)
            log(f"removed {shown(unfinished)}: a save that never finished")
        steps = [p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()]
        moved = [quarantine(p, "incomplete (missing Orbax's metadata or an item)", log)
                 for p in steps if not is_finalized(p)]
    wait_for_every_process("incomplete checkpoints moved aside", VERDICT_TIMEOUT_S)
    return moved
