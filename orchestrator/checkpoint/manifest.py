"""Checksums of a checkpoint's files: Orbax's compressed array files carry none.

A flipped bit in an array file would restore as a wrong number and training
would go on from garbage. `nestor_manifest.json` in a step directory holds
the size and SHA-256 of each file of its items, and every file is checked
against it before a restore reads any array. Each process hashes the array
files it wrote itself, once they are on disk (`written_by`, `records`); process
0 hashes the rest (what Orbax writes when it finalizes a save, a few small
files) and writes the manifest (`write_manifest`). Orbax writes the step's own files
(`_CHECKPOINT_METADATA`, `commit_success.txt`) once more when it finalizes the
save, after the manifest is written: process 0 adds them to the manifest once
the save is final (`seal`), and from then on the manifest lists every file of
the step directory. A step directory whose save finished but whose manifest was
not sealed yet (a kill in between) has its items checked and its step files
only read (orchestrator/checkpoint/reader.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax

MANIFEST = "nestor_manifest.json"
# Set in a manifest once it lists every file of its step directory (`seal`).
SEALED = "sealed"


class CorruptCheckpoint(Exception):
    """A checkpoint's files differ from the sizes and digests recorded when it was saved."""


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def written_by(item_dir: Path, process: int) -> list[Path]:
    """Returns the files under `item_dir` that process `process` wrote itself: Orbax's array data of
    that process (`ocdbt.process_<i>/`) and its array metadata (`array_metadatas/process_<i>`).

    What Orbax writes when it finalizes a save (the merged index, `_METADATA`,
    `_sharding`) is no process's own.
    """
    own = {f"ocdbt.process_{process}", f"process_{process}"}
    return sorted(path for path in item_dir.rglob("*")
                  if path.is_file() and own & set(path.relative_to(item_dir).parts))


def records(directory: Path, paths: list[Path]) -> dict[str, dict]:
    """Returns the manifest's records of `paths`: {path relative to `directory`: {"bytes", "sha256"}}."""
    return {str(path.relative_to(directory)): {"bytes": path.stat().st_size, "sha256": _sha256(path)} for path in paths}


def write_manifest(step_dir: Path, items: tuple[str, ...], recorded: dict[str, dict] | None = None) -> None:
    """Records the size and SHA-256 of every file in the `items` directories of `step_dir` in its
    `nestor_manifest.json` (Orbax's own step metadata beside them changes after the manifest is written).

    Files in `recorded` (`records` of the processes that wrote them) are taken
    as recorded; the others are hashed here. Written to a temporary name, synced
    and renamed, so the manifest is either whole or absent.
    """
    recorded = recorded or {}
    unrecorded = [path for item in items for path in sorted((step_dir / item).rglob("*"))
                  if path.is_file() and str(path.relative_to(step_dir)) not in recorded]
    _write(step_dir, {"files": records(step_dir, unrecorded) | recorded})


def _write(step_dir: Path, manifest: dict) -> None:
    """Writes `manifest` to a temporary name, synced, and renames it: the manifest is whole or absent."""
    partial = step_dir / f"{MANIFEST}.partial"
    with partial.open("w") as f:
        json.dump(manifest, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, step_dir / MANIFEST)


def _step_files(step_dir: Path, items: tuple[str, ...]) -> list[Path]:
    """Returns the files of `step_dir` outside its `items` (Orbax's own), the manifest left out."""
    return sorted(path for path in step_dir.iterdir()
                  if path.is_file() and path.name not in items and not path.name.startswith(MANIFEST))


def seal(step_dir: Path, items: tuple[str, ...]) -> None:
    """Adds the files of `step_dir` outside its `items` (Orbax's metadata, final once the save is) to its
    manifest and marks it sealed: from then on it lists every file of the directory (process 0)."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"] |= records(step_dir, _step_files(step_dir, items))
    _write(step_dir, manifest | {SEALED: True})


def _file_problem(step_dir: Path, name: str, recorded: dict) -> str | None:
    """Returns how file `name` differs from what the manifest recorded, or None when it matches."""
    path = step_dir / name
    if not path.is_file():
        return f"{name} is missing"
    if not {"bytes", "sha256"} <= set(recorded):
        return f"{MANIFEST} is unreadable (its record of {name} lacks its size or digest)"
    if (size := path.stat().st_size) != recorded["bytes"]:
        return f"{name} has {size} bytes, {recorded['bytes']} when saved"
    if _sha256(path) != recorded["sha256"]:
        return f"{name} has another SHA-256 than when saved (its bytes changed)"
    return None


def verify_manifest(step_dir: Path, items: tuple[str, ...]) -> None:
    """Checks that the manifest of `step_dir` lists every file of its `items` (every file of the directory
    once sealed), and this process's share of them (every process_count-th) against it; raises
    CorruptCheckpoint naming the first that differs or is not listed (an empty or partial manifest
    verifies nothing).

    Waits for no other process: the caller shares each process's verdict
    (`Checkpointer._judged`), so a mismatch seen by one process moves the
    checkpoint aside on all while each reads only its share.
    """
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorruptCheckpoint(f"{MANIFEST} is unreadable ({type(error).__name__}: {error})") from None
    if not isinstance(files, dict) or not all(isinstance(record, dict) for record in files.values()):
        raise CorruptCheckpoint(f"{MANIFEST} is unreadable (its files are not a mapping of records)")
    present = {str(path.relative_to(step_dir)) for item in items for path in (step_dir / item).rglob("*")
               if path.is_file()}
    if manifest.get(SEALED) is True:
        present |= {path.name for path in _step_files(step_dir, items)}
    if unlisted := sorted(present - set(files)):
        raise CorruptCheckpoint(f"{MANIFEST} does not list {len(unlisted)} of its {len(present)} files "
                                f"({unlisted[0]}{', ...' if len(unlisted) > 1 else ''})")
    names = sorted(files)
    for name in names[jax.process_index()::jax.process_count()]:
        if problem := _file_problem(step_dir, name, files[name]):
            raise CorruptCheckpoint(problem)
