"""Checkpoints with Orbax: asynchronous saves, newest N kept, torn or corrupt saves skipped, reshard on restore.

A checkpoint `run.dir/checkpoints/<step>/` holds three items:
- `state`: the train state {"step", "params", "opt_state"} in its canonical
  layout (layers stacked `[layers, ...]`), written shard by shard;
- `data`: the input iterator's state (next step, source fingerprint), JSON;
- `config`: the resolved config of the run that wrote it, JSON.

Orbax writes a save into a temporary directory and renames it to `<step>`
only once every item is on disk, so a process killed mid-write leaves a
`*.orbax-checkpoint-tmp-*` directory that is never listed as a step. A step
directory that is there but broken (copied half, truncated, hand-edited) is
moved aside to `run.dir/torn_checkpoints/` with a warning before the manager
counts it, so it neither gets restored nor pushes a good checkpoint out of
the `keep` window.

A step directory is complete only with `nestor_manifest.json`, the checksums
of its files (orchestrator/manifest.py): an asynchronous save writes it into
the temporary directory just before Orbax's rename, a synchronous one
(`checkpoint.async=false`) right after. A step directory without it was never
finished (or predates the manifest) and is moved aside like a torn one;
restoring checks every file against it first, and a mismatch names the file,
moves the step aside and the next older checkpoint is restored.

A save that fails (disk full, read-only file system), in the foreground or in
the background, raises CheckpointWriteError as soon as the loop next asks
(every step): the failed step's directories are removed and the older
checkpoints are left as they were.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from orchestrator.config import Config, ConfigError
from orchestrator.manifest import MANIFEST, verify_manifest, write_manifest
from orchestrator.runtime import VERDICT_TIMEOUT_S, every_process_says, wait_for_every_process
from orchestrator.state import StateLayout

# Orbax writes this file last into a finalized step directory.
_METADATA_FILE = "_CHECKPOINT_METADATA"
_ITEMS = ("state", "data", "config")
# What a process says of its check or read of a checkpoint, when not the error it hit.
_DONE, _MISFIT = "done", "does not fit the config"


def _handing_back_failures(handler):
    """Returns Orbax item `handler` with a `restore` that returns a failed read's exception instead of raising it.

    Orbax's restore ends at a barrier of every process; a process whose own
    shards fail to read would skip it and leave the others waiting there for
    ever. `_read` raises the exception once Orbax's restore has returned. (The
    handler keeps its type: Orbax matches arguments to handlers by exact type.)
    """
    read = handler.restore

    def restore(directory, args=None):
        try:
            return read(directory, args=args)
        except Exception as error:  # noqa: BLE001 - raised again by _read, past Orbax's barrier
            return error

    handler.restore = restore
    return handler


def _read(restored):
    """Returns Orbax's restored items, raising the first one whose read failed on this process."""
    for item in restored.values():
        if isinstance(item, Exception):
            raise item
    return restored


# Orbax writes a step into `<step>.orbax-checkpoint-tmp[-<suffix>]` and renames it when it is complete.
_TEMPORARY = ".orbax-checkpoint-tmp"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, read-only file system); the run stops."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    """Returns the directory that holds a run's checkpoints."""
    return Path(run_dir).resolve() / "checkpoints"


def _is_complete(step_dir: Path) -> bool:
    return all((step_dir / name).is_file() for name in (_METADATA_FILE, MANIFEST)) and \
        all((step_dir / item).is_dir() for item in _ITEMS)


def quarantine(step_dir: Path, reason: str, log=print) -> Path:
    """Moves a broken step directory to `run.dir/torn_checkpoints/`; returns where it went.

    `reason` completes "checkpoint <dir> is ...", e.g. "incomplete (missing metadata)".
    """
    target = step_dir.parent.parent / "torn_checkpoints" / f"{step_dir.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(step_dir), str(target))
    log(f"warning: checkpoint {step_dir} is {reason}; skipped and moved to {target}")
    return target


def quarantine_incomplete(directory: Path, log=print, remove_unfinished: bool = False) -> list[Path]:
    """Moves aside every `<step>` directory that lacks Orbax's metadata, an item or nestor's manifest;
    returns the moved ones. With `remove_unfinished` (only for the run that holds run.dir: another
    run's save may be in flight), also deletes the temporary directories of saves that never finished.

    Process 0 moves; every process waits for it before going on, so none lists a
    step directory that is about to go.
    """
    moved = []
    if directory.is_dir() and jax.process_index() == 0:
        for unfinished in directory.glob(f"*{_TEMPORARY}*") if remove_unfinished else ():
            shutil.rmtree(unfinished, ignore_errors=True)
            log(f"removed {unfinished}: a save that never finished")
        steps = [p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()]
        moved = [quarantine(p, f"incomplete (missing Orbax's metadata, an item or {MANIFEST})", log)
                 for p in steps if not _is_complete(p)]
    wait_for_every_process("incomplete checkpoints moved aside", VERDICT_TIMEOUT_S)
    return moved


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    """Maps each array's path ("opt_state/1/0/mu/embed/...") to its shape; works on
    abstract arrays and on Orbax's metadata tree alike."""
    return {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _check_fits(saved_state, saved_config: dict, config: Config, layout: StateLayout, step_dir: Path) -> None:
    """Raises ConfigError when the checkpoint's arrays (paths and shapes) are not the
    current config's, naming the config keys that differ from the checkpoint's."""
    saved, wanted = _shapes(saved_state), _shapes(layout.abstract)
    if saved == wanted:
        return
    current = config.to_dict()
    problems = [(f"{section}.{key}", f"is {current[section].get(key)!r} but {step_dir} was written with {value!r}")
                for section in ("model", "moe") for key, value in saved_config.get(section, {}).items()
                if key != "preset" and current[section].get(key) != value]
    differing = sorted(set(saved) ^ set(wanted)) or sorted(k for k in saved if saved[k] != wanted[k])
    shown = ", ".join(f"{k} {saved.get(k, 'absent')} vs {wanted.get(k, 'absent')}" for k in differing[:3])
    problems.append(("run.dir", f"{step_dir} holds {len(saved)} arrays that do not fit the {len(wanted)} of this "
                                f"config (checkpoint vs now: {shown}{', ...' if len(differing) > 3 else ''}); "
                                "use the checkpoint's values or a new run.dir"))
    raise ConfigError(problems)


def _cause(error: BaseException) -> str:
    """Returns what made a save fail, in a few words: the OS's reason where one is known
    (tensorstore reports it as `os_error_code='28'`), else the error's first line."""
    for link in (error, error.__cause__, error.__context__):
        if isinstance(link, OSError) and link.errno:
            return f"{link.strerror} ({errno.errorcode.get(link.errno, link.errno)})"
        if link is not None and (code := re.search(r"os_error_code='(\d+)'", str(link))):
            number = int(code.group(1))
            return f"{os.strerror(number)} ({errno.errorcode.get(number, number)})"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


class _OrbaxErrorsAreOurs(logging.Filter):
    """Drops ERROR records that Orbax logs, or whose exception runs through Orbax or names its
    temporary directories (asyncio's "exception was never retrieved" of the writes a failed save
    abandoned): a failed save or restore is reported once by the Checkpointer instead, as
    CheckpointWriteError or a quarantine warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        _, exception, trace = record.exc_info or (None, None, None)
        places = [record.pathname, *(frame.filename for frame in traceback.extract_tb(trace)), str(exception)]
        return not any(f"{os.sep}orbax{os.sep}" in place or _TEMPORARY in place for place in places)


_ORBAX_ERRORS = _OrbaxErrorsAreOurs()


class _AbandonedWritesAreOurs:
    """An unraisable-exception hook that drops the "Event loop is closed" errors of array writes Orbax
    abandoned when a save failed (tensorstore finishes them after Orbax closed their event loop);
    passes everything else to the hook it wraps."""

    def __init__(self, wrapped):
        self.wrapped = wrapped

    def __call__(self, unraisable) -> None:
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            self.wrapped(unraisable)


def _hold_back_orbax_noise() -> None:
    """Keeps Orbax's own reports of a failed save off the terminal (once per process)."""
    for logger in ("absl", "asyncio"):
        logging.getLogger(logger).addFilter(_ORBAX_ERRORS)
    if not isinstance(sys.unraisablehook, _AbandonedWritesAreOurs):
        sys.unraisablehook = _AbandonedWritesAreOurs(sys.unraisablehook)


def _remove_for_good(paths: list[Path], settle_s: float = 0.5, limit_s: float = 10.0) -> None:
    """Removes `paths`, again while array writes that Orbax abandoned on a failure (they go on in
    tensorstore) create them anew, until none has come back for `settle_s` (at most `limit_s`)."""
    deadline = time.monotonic() + limit_s
    while paths:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        time.sleep(settle_s)
        if not any(path.exists() for path in paths) or time.monotonic() > deadline:
            return


class Checkpointer:
    """Saves and restores a run's checkpoints; `restore` targets the current mesh's layout.

    `owner`: this run holds run.dir, so temporary directories of unfinished
    saves left there are its to delete.
    """

    def __init__(self, config: Config, layout: StateLayout, log=print, owner: bool = True):
        self.config = config
        self.layout = layout
        self.log = log
        self.directory = checkpoint_dir(config.run.dir)
        self.in_flight: int | None = None  # the step being saved in the background
        self.refused: set[int] = set()  # steps whose state failed the health check: never saved
        _hold_back_orbax_noise()
        quarantine_incomplete(self.directory, log, remove_unfinished=owner)
        self.manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        asynchronous = self.config.checkpoint.async_save
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.config.checkpoint.keep,
            enable_async_checkpointing=asynchronous,
            create=True,
            # The callback runs on process 0 once every process's files are written, before the rename that
            # finalizes. Directories are made before `save` returns, so a read-only run.dir fails there
            # (made in the background, a failure leaves Orbax's writer threads waiting for them forever).
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal_in_flight,
                                           create_directories_asynchronously=False) if asynchronous else None,
        )
        handlers = {"state": _handing_back_failures(ocp.StandardCheckpointHandler()),
                    "data": _handing_back_failures(ocp.JsonCheckpointHandler()), "config": ocp.JsonCheckpointHandler()}
        return ocp.CheckpointManager(self.directory, item_handlers=handlers, options=options)

    def _unfinished(self, step: int) -> list[Path]:
        return sorted(self.directory.glob(f"{step}{_TEMPORARY}*"))

    def _seal_in_flight(self) -> None:
        """Writes the manifest into the temporary directory of the save in flight."""
        unfinished = self._unfinished(self.in_flight)
        if len(unfinished) != 1:
            raise CheckpointWriteError(f"expected one temporary directory for step {self.in_flight}, found "
                                       f"{[p.name for p in unfinished]}")
        write_manifest(unfinished[0], _ITEMS)

    def latest_step(self) -> int | None:
        """Returns the newest finalized step, or None when there is none."""
        return self.manager.latest_step()

    def save(self, step: int, state: dict, data_state: dict, force: bool = False) -> bool:
        """Starts saving `state` at `step` (in the background when `checkpoint.async`); returns whether it saved.

        Without `force`, saves only every `checkpoint.every` steps; never a
        step in `refused` (its state failed the health check). Device
        buffers are copied to host before this returns, so the next step may
        donate them. Raises CheckpointWriteError when this save or the one
        before it failed.
        """
        if step in self.manager.all_steps() or step in self.refused:
            return False
        every = self.config.checkpoint.every
        if not force and not (every and step % every == 0):
            return False
        self.raise_if_failed(wait=True)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(self.config.to_dict()))
        self.in_flight = step
        try:
            saved = self.manager.save(step, args=args, force=True)
            if not self.config.checkpoint.async_save:
                if jax.process_index() == 0:
                    write_manifest(self.directory / str(step), _ITEMS)
                wait_for_every_process(f"manifest of checkpoint {step} written", VERDICT_TIMEOUT_S)
                self.in_flight = None
        except Exception as error:  # noqa: BLE001 - whatever stopped the write, the run stops with it named
            self._failed(error)
        return saved

    def raise_if_failed(self, wait: bool = False) -> None:
        """Raises CheckpointWriteError if the background save has failed; without `wait`, a save still
        running is left to run (the loop asks every step, at no cost)."""
        if self.in_flight is None or (not wait and self.manager.is_saving_in_progress()):
            return
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - see save
            self._failed(error)
        self.in_flight = None

    def _failed(self, error: BaseException) -> None:
        """Removes what the failed save of the step in flight left (process 0) and raises CheckpointWriteError."""
        step, self.in_flight = self.in_flight, None
        # Orbax leaves its coroutines behind; their complaints at exit would bury the one line below.
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
        if jax.process_index() == 0:
            _remove_for_good([path for path in self._unfinished(step) + [self.directory / str(step)]
                              if path.exists() and not (path / MANIFEST).is_file()])
        kept = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and _is_complete(p))
        raise CheckpointWriteError(
            f"run.dir {Path(self.config.run.dir).resolve()}: checkpoint {step} could not be written "
            f"({_cause(error)}); training stopped. "
            + (f"Checkpoints {', '.join(map(str, kept))} are intact; " if kept else "No checkpoint was kept; ")
            + "free space or make run.dir writable, then run again to resume") from None

    def saved_config(self, step: int) -> dict:
        """Returns the resolved config (plain data) of the run that wrote checkpoint `step`.

        Read by this process alone: through Orbax's item handler, not the
        manager, whose restore ends at a barrier of every process.
        """
        return ocp.JsonCheckpointHandler().restore(self.directory / str(step) / "config")

    def check(self, step: int) -> None:
        """Raises ConfigError when checkpoint `step`'s arrays do not fit the current config (another
        model, MoE layout or optimizer chain); other settings, the mesh included, may change on resume.

        Raises CorruptCheckpoint when this process's share of the files differs
        from the manifest written at save. Reads no array and waits for no other
        process.
        """
        step_dir = self.directory / str(step)
        verify_manifest(step_dir)
        _check_fits(self.manager.item_metadata(step).state, self.saved_config(step), self.config, self.layout,
                    step_dir)

    def read(self, step: int) -> tuple[dict, dict]:
        """Returns (state, data_state) of `step`, the state laid out for the current mesh.

        Every process must call it: Orbax's restore ends at a barrier of all. A
        read that fails on this process is raised once every process passed it.
        """
        args = ocp.args.Composite(state=ocp.args.StandardRestore(self.layout.abstract), data=ocp.args.JsonRestore())
        restored = _read(self.manager.restore(step, args=args))
        return restored.state, restored.data

    def restore(self, step: int) -> tuple[dict, dict]:
        """Returns (state, data_state) of `step` (`read`) once `check` found that it fits."""
        self.check(step)
        return self.read(step)

    def restore_latest(self) -> tuple[int, dict, dict] | None:
        """Returns (step, state, data_state) of the newest checkpoint that restores, or None.

        A checkpoint that fails its check or its read on any process is moved
        aside with a warning and every process tries the next older one. Raises
        ConfigError when the checkpoint does not fit the config (on any process).
        """
        for step in sorted(self.manager.all_steps(), reverse=True):
            checked, _ = self._judged(step, "checked", self.check)
            if checked:
                read, (state, data_state) = self._judged(step, "read", self.read)
                if read:
                    return step, state, data_state
        return None

    def _judged(self, step: int, part: str, attempt) -> tuple[bool, Any]:
        """Runs `attempt(step)` and shares how it went with every process; returns (whether it went
        well on every process, its result here: `(None, None)` where it failed).

        Processes that saw different things (one process's check or read
        fails) decide together through `every_process_says`, so none waits at a
        barrier the others skipped; a failure on any moves checkpoint `step`
        aside. Raises ConfigError when the checkpoint does not fit on any process.
        """
        misfit, result = None, (None, None)
        try:
            result, verdict = attempt(step), _DONE
        except ConfigError as error:
            misfit, verdict = error, _MISFIT
        except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is skipped, named and kept aside
            verdict = f"{type(error).__name__}: {error}"[:300]
        verdicts = every_process_says(f"checkpoint {step} {part}", verdict)
        if misfit is not None:
            raise misfit
        if _MISFIT in verdicts:
            raise ConfigError([("run.dir", f"{self.directory / str(step)} does not fit this config on process "
                                           f"{verdicts.index(_MISFIT)}, which says how")])
        failures = [(process, said) for process, said in enumerate(verdicts) if said != _DONE]
        if failures:
            self.manager.close()
            if jax.process_index() == 0:
                reason = "; ".join(said if jax.process_count() == 1 else f"process {process}: {said}"
                                   for process, said in failures)
                quarantine(self.directory / str(step), f"unusable ({reason})", self.log)
            wait_for_every_process(f"checkpoint {step} moved aside", VERDICT_TIMEOUT_S)
            self.manager = self._open()
        return not failures, result

    def close(self) -> None:
        """Finishes saves in flight and releases the manager; raises CheckpointWriteError if the last
        save failed."""
        try:
            self.raise_if_failed(wait=True)
        finally:
            self.manager.close()


def restore_state(config: Config, layout: StateLayout, step: int | None = None) -> tuple[int, Any]:
    """Returns (step, train state) of checkpoint `step` (default: newest) in `layout`'s shardings.

    Raises FileNotFoundError when the run has no checkpoint.
    """
    checkpointer = Checkpointer(config, layout, log=lambda *_: None, owner=False)
    try:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {checkpointer.directory}")
        return step, checkpointer.restore(step)[0]
    finally:
        checkpointer.close()
