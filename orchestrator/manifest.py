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
import numpy as np
from jax.experimental import multihost_utils

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
    """Checks every file of `step_dir` against its manifest; raises CorruptCheckpoint naming the first
    that differs.

    Each process checks every process_count-th file and all agree on the
    first mismatch, so every process reaches the same verdict while reading
    only its share of the checkpoint.
    """
    try:
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpoint(f"{MANIFEST} is unreadable ({type(error).__name__}: {error})") from None
    names = sorted(files)
    mine = range(jax.process_index(), len(names), jax.process_count())
    problems = {index: problem for index in mine
                if (problem := _file_problem(step_dir, names[index], files[names[index]]))}
    first = min(problems, default=len(names))
    if jax.process_count() > 1:
        first = int(np.min(multihost_utils.process_allgather(np.int32(first))))
    if first < len(names):
        raise CorruptCheckpoint(problems.get(first) or f"{names[first]} differs from when it was saved")
