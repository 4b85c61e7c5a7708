"""Reading checkpoints: whether a step fits the config and its files are whole, and its arrays in the
current mesh's layout, changing nothing in run.dir.

Restoring checks every file against nestor's manifest
(orchestrator/checkpoint/manifest.py) first. A finalized step without a
manifest (written by a nestor older than manifests, or by a synchronous save
killed between Orbax's rename and the manifest) is restored unverified, with
a warning. `CheckpointReader` is what `nestor eval`, `sample`, `logits` and
`export` read with, maybe beside a run that trains; the run itself restores
through its owner (orchestrator/checkpoint/owner.py), which shares this
reader's checks and decides with every process which step restores.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from nestor.orchestrator.checkpoint.files import (ITEMS, METADATA_FILE, RECORD, TEMPORARY, checkpoint_dir,
                                                  finalized_steps, is_finalized)
from nestor.orchestrator.checkpoint.manifest import MANIFEST, CorruptCheckpoint, verify_manifest
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.errors import ConfigError, RunFailed
from nestor.orchestrator.hf.load import fingerprint
from nestor.orchestrator.job.state import StateLayout, with_base
from nestor.orchestrator.paths import shown


_CHECKPOINT_DIRS: set[str] = set()  # the checkpoints/ folders this process reads or writes


def _is_orbax_noise(exception: BaseException | None, *places: str) -> bool:
    """Whether an error report is Orbax's own: raised through Orbax's code, or naming its temporary
    directories or a checkpoints/ folder this process reads (tensorstore's errors name the file only)."""
    trace = exception.__traceback__ if exception is not None else None
    places = (*places, *(frame.filename for frame in traceback.extract_tb(trace)), str(exception))
    marks = (f"{os.sep}orbax{os.sep}", TEMPORARY, *_CHECKPOINT_DIRS)
    return any(mark in place for place in places for mark in marks)


class _OrbaxErrorsAreOurs(logging.Filter):
    """Drops ERROR records that are Orbax's (`_is_orbax_noise`), asyncio's "exception was never retrieved"
    of the reads and writes a failed save or read abandoned included: a failed save or read is reported
    once by nestor instead, as CheckpointWriteError, CheckpointUnreadable or a quarantine warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        return not _is_orbax_noise((record.exc_info or (None, None))[1], record.pathname, record.getMessage())


_ORBAX_ERRORS = _OrbaxErrorsAreOurs()


class _AbandonedWorkIsOurs:
    """An unraisable-exception hook that drops what Orbax's abandoned work raises once nobody waits for it:
    "Event loop is closed" of array writes tensorstore finishes after a failed save closed their loop, and
    the read coroutines left unfinished when a read failed, collected at exit. Passes the rest on."""

    def __init__(self, wrapped):
        self.wrapped = wrapped

    def __call__(self, unraisable) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        coroutine_file = getattr(getattr(unraisable.object, "cr_code", None), "co_filename", "")
        if _is_orbax_noise(error, coroutine_file):
            return
        self.wrapped(unraisable)


def hold_back_orbax_noise(directory: Path) -> None:
    """Keeps Orbax's own reports of a failed save or read of the checkpoints in `directory` off the
    terminal."""
    _CHECKPOINT_DIRS.add(str(Path(directory).resolve()))
    for logger in ("absl", "asyncio"):
        logging.getLogger(logger).addFilter(_ORBAX_ERRORS)  # a filter added twice is kept once
    if not isinstance(sys.unraisablehook, _AbandonedWorkIsOurs):
        sys.unraisablehook = _AbandonedWorkIsOurs(sys.unraisablehook)


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    """Maps each array's path ("opt_state/1/0/mu/embed/...") to its shape; works on
    abstract arrays and on Orbax's metadata tree alike."""
    return {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def config_differences(current: dict, saved_config: dict, keys, step_dir: Path,
                       advice: str = "") -> list[tuple[str, str]]:
    """Returns a problem for each (section, key) of `keys` that the checkpoint in `step_dir` was written with
    (its `saved_config`) and whose value in `current` (Config.to_dict()) differs, each ending in `advice`."""
    return [(f"{section}.{key}", f"is {current[section].get(key)!r} but {shown(step_dir)} was written with "
                                 f"{saved_config[section][key]!r}{advice}")
            for section, key in keys
            if key in saved_config.get(section, {}) and current[section].get(key) != saved_config[section][key]]


def _check_fits(saved_state, saved_config: dict, config: Config, layout: StateLayout, step_dir: Path) -> None:
    """Raises ConfigError when the checkpoint's arrays (paths and shapes) are not the
    current config's, naming the config keys that differ from the checkpoint's."""
    saved, wanted = _shapes(saved_state), _shapes(layout.saved)
    if saved == wanted:
        return
    written = shown(step_dir)
    problems = config_differences(config.to_dict(), saved_config, [
        (section, key) for section in ("model", "moe") for key in saved_config.get(section, {}) if key != "preset"],
        step_dir)
    differing = sorted(set(saved) ^ set(wanted)) or sorted(k for k in saved if saved[k] != wanted[k])
    differences = ", ".join(f"{k} {saved.get(k, 'absent')} vs {wanted.get(k, 'absent')}" for k in differing[:3])
    problems.append(("run.dir", f"{written} holds {len(saved)} arrays that do not fit the {len(wanted)} of this "
                                f"config (checkpoint vs now: {differences}{', ...' if len(differing) > 3 else ''}); "
                                "use the checkpoint's values or a new run.dir"))
    raise ConfigError(problems)


BASE = "base"  # a LoRA checkpoint's record: the fingerprint of the base its adapters adapt


def saved_config(step_dir: Path) -> dict:
    """Returns the resolved config (plain data) of the run that wrote the checkpoint in `step_dir`."""
    return ocp.JsonCheckpointHandler().restore(step_dir / "config")


def newest_saved_config(run_dir: str | Path) -> dict | None:
    """Returns the resolved config (plain data) that wrote `run_dir`'s newest checkpoint; None when it has none."""
    steps = finalized_steps(checkpoint_dir(run_dir))
    return saved_config(checkpoint_dir(run_dir) / str(steps[-1])) if steps else None


class CheckpointReader:
    """Reads a run's checkpoints one step at a time from the step's own files, through Orbax's item
    handlers: no manager (which reads every step's metadata when it opens, and fails on one being
    rotated out), no barrier, nothing written."""

    def __init__(self, config: Config, layout: StateLayout, log=print):
        self.config = config
        self.layout = layout
        self.log = log
        self.directory = checkpoint_dir(config.run.dir)
        hold_back_orbax_noise(self.directory)

    def saved_config(self, step: int) -> dict:
        """Returns the resolved config (plain data) of the run that wrote checkpoint `step`."""
        return saved_config(self.directory / str(step))

    def record(self, step: int) -> dict:
        """Returns nestor's record of checkpoint `step` ({} for one of a nestor older than the records); raises
        CorruptCheckpoint when Orbax's metadata, which holds it, does not read as JSON or holds no mapping."""
        try:
            metadata = json.loads((self.directory / str(step) / METADATA_FILE).read_bytes().decode("utf-8"))
            record = (metadata.get("custom_metadata") or {}).get(RECORD) or {}
        except (OSError, ValueError, AttributeError) as error:  # UnicodeDecodeError is a ValueError
            raise CorruptCheckpoint(f"{METADATA_FILE} is unreadable ({type(error).__name__}: "
                                    f"{str(error)[:200]})") from None
        if not isinstance(record, dict):
            raise CorruptCheckpoint(f"{METADATA_FILE} is unreadable (nestor's record in it is not a mapping)")
        return record

    def check(self, step: int) -> None:
        """Raises ConfigError when checkpoint `step`'s arrays do not fit the current config (another
        model, MoE layout or optimizer chain); other settings, the mesh included, may change on resume.

        Raises CorruptCheckpoint when Orbax's metadata is unreadable, when this process's share of the files differs
        from the manifest written at save, or when the manifest its record
        promises is missing; a step of an older nestor without one is not
        checked, and process 0 says so in one warning at each restore. Reads no
        array and waits for no other process.
        """
        step_dir = self.directory / str(step)
        record = self.record(step)  # read before the manifest is: an unsealed one does not cover it
        if (step_dir / MANIFEST).is_file():
            verify_manifest(step_dir, ITEMS)
        elif record.get("manifest"):
            raise CorruptCheckpoint(f"{MANIFEST} is missing (nestor wrote one with this checkpoint)")
        elif jax.process_index() == 0:
            self.log(f"warning: checkpoint {shown(step_dir)} has no {MANIFEST} (written by an older nestor, or a "
                     "synchronous save cut off before it); restored without checking its files")
        _check_fits(ocp.StandardCheckpointHandler().metadata(step_dir / "state"), self.saved_config(step), self.config,
                    self.layout, step_dir)
        saved_base = record.get(BASE)
        if self.layout.from_source and saved_base and saved_base != self.base_fingerprint:
            was = self.saved_config(step)["model"].get("init_from") or "run.seed"
            now = self.config.model.init_from or "run.seed"
            raise ConfigError([("model.init_from", f"{shown(step_dir)} was trained from a base of fingerprint "
                                                   f"{saved_base} ({was}), which it does not hold; {now} is "
                                                   f"{self.base_fingerprint}: name the base it was trained from")])

    @functools.cached_property
    def base_fingerprint(self) -> str:
        """Returns the fingerprint of the base a LoRA run adapts (orchestrator.hf.load.fingerprint)."""
        return fingerprint(self.config)

    def read(self, step: int) -> tuple[dict, dict]:
        """Returns (state, data_state) of `step`, the state laid out for the current mesh."""
        step_dir = self.directory / str(step)
        state = ocp.StandardCheckpointHandler().restore(step_dir / "state",
                                                        args=ocp.args.StandardRestore(self.layout.saved))
        return with_base(self.config, self.layout, state), ocp.JsonCheckpointHandler().restore(step_dir / "data")

    def restore(self, step: int) -> tuple[dict, dict]:
        """Returns (state, data_state) of `step` (`read`) once `check` found that it fits."""
        self.check(step)
        return self.read(step)


class CheckpointUnreadable(RunFailed):
    """A reader could not read a checkpoint: it is damaged, or the run that trains rotated it out meanwhile."""

    headline = "cannot read the checkpoint: "


READ_ATTEMPTS = 3  # a reader beside a run that trains tries the newest step again when one is rotated out


def restore_state(config: Config, layout: StateLayout, step: int | None = None) -> tuple[int, Any]:
    """Returns (step, train state) of checkpoint `step` (default: newest) in `layout`'s shardings, changing
    nothing in run.dir (a run may be training there).

    Raises FileNotFoundError when the run has no checkpoint, CheckpointUnreadable when the checkpoint is
    damaged, or disappears while it is read (`checkpoint.keep` rotated it out) more than READ_ATTEMPTS times.
    """
    directory = checkpoint_dir(config.run.dir)
    if not finalized_steps(directory):  # a reader creates nothing: no empty checkpoints/ in a mistyped run.dir
        raise FileNotFoundError(f"no checkpoint in {shown(directory)}")
    if step is not None and not is_finalized(directory / str(step)):
        raise FileNotFoundError(f"no checkpoint {step} in {shown(directory)} (it has {finalized_steps(directory)})")
    failure, reader = None, CheckpointReader(config, layout, log=lambda *_: None)
    for _ in range(READ_ATTEMPTS):  # one that fails for a step rotated out meanwhile is tried again
        chosen = step if step is not None else (finalized_steps(directory) or [None])[-1]
        if chosen is None or not is_finalized(directory / str(chosen)):
            break
        try:
            return chosen, reader.restore(chosen)[0]
        except ConfigError:
            raise
        except Exception as error:  # noqa: BLE001 - a damaged checkpoint, or one deleted while read
            failure = f"{type(error).__name__}: {str(error).strip()[:300]}"
    if chosen is not None and is_finalized(directory / str(chosen)):
        raise CheckpointUnreadable(f"{shown(directory / str(chosen))}: {failure}")
    raise CheckpointUnreadable(f"{shown(directory / str(chosen))} was removed while it was read (a run that "
                               "trains there rotates checkpoints out: checkpoint.keep); run the command again")
