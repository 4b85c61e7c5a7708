"""Checksums of a checkpoint's files: Orbax's compressed array files carry none.

A flipped bit in an array file would restore as a wrong number and training
would go on from garbage. `nestor_manifest.json` in a step directory holds
the size and SHA-256 of each file of its items, written by process 0 once
every process's files are on disk, and every file is checked against it
before a restore reads any array.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax

MANIFEST = "nestor_manifest.json"


class CorruptCheckpoint(Exception):
    """A checkpoint's files differ from the sizes and digests recorded when it was saved."""


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(step_dir: Path, items: tuple[str, ...]) -> None:
    """Records the size and SHA-256 of every file in the `items` directories of `step_dir` in its
    `nestor_manifest.json` (Orbax's own step metadata beside them changes after the manifest is written).

    Written to a temporary name, synced and renamed, so the manifest is either
    whole or absent.
    """
    files = {str(path.relative_to(step_dir)): {"bytes": path.stat().st_size, "sha256": _sha256(path)}
             for item in items for path in sorted((step_dir / item).rglob("*")) if path.is_file()}
    partial = step_dir / f"{MANIFEST}.partial"
    with partial.open("w") as f:
        json.dump({"files": files}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, step_dir / MANIFEST)


def _file_problem(step_dir: Path, name: str, recorded: dict) -> str | None:
    """Returns how file `name` differs from what the manifest recorded, or None when it matches."""
    path = step_dir / name
    if not path.is_file():
        return f"{name} is missing"
    if (size := path.stat().st_size) != recorded["bytes"]:
        return f"{name} has {size} bytes, {recorded['bytes']} when saved"
    if _sha256(path) != recorded["sha256"]:
        return f"{name} has another SHA-256 than when saved (its bytes changed)"
    return None


def verify_manifest(step_dir: Path) -> None:
    """Checks this process's share of the files of `step_dir` (every process_count-th) against its
    manifest; raises CorruptCheckpoint naming the first that differs.

    Waits for no other process: the caller shares each process's verdict
    (`Checkpointer._judged`), so a mismatch seen by one process moves the
    checkpoint aside on all while each reads only its share.
    """
    try:
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpoint(f"{MANIFEST} is unreadable ({type(error).__name__}: {error})") from None
    names = sorted(files)
    for name in names[jax.process_index()::jax.process_count()]:
        if problem := _file_problem(step_dir, name, files[name]):
            raise CorruptCheckpoint(problem)
