"""Restoring checkpoints: which step directories are whole, every process's verdict, torn ones moved aside.

A step directory `run.dir/checkpoints/<step>/` is finalized with Orbax's
`_CHECKPOINT_METADATA` (written last, before the rename that finalizes a
save) and its three items. One that is not (copied half, hand-edited) is
moved aside to `run.dir/torn_checkpoints/` with a warning before the manager
counts it, so it neither gets restored nor pushes a good checkpoint out of
the `keep` window. Restoring checks every file against nestor's manifest
(orchestrator/manifest.py) first; a mismatch names the file, moves the step
aside and the next older checkpoint is restored. A finalized step without a
manifest (written by a nestor older than manifests, or by a synchronous save
killed between Orbax's rename and the manifest) is restored unverified, with
a warning. In a multi-process run every process checks and reads its share and
all decide together (`CheckpointReader._judged`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from nestor.orchestrator.config_schema import Config
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.manifest import MANIFEST, CorruptCheckpoint, verify_manifest
from nestor.orchestrator.paths import shown
from nestor.orchestrator.processes import VERDICT_TIMEOUT_S, every_process_says, wait_for_every_process
from nestor.orchestrator.state import StateLayout

# Orbax writes this file last into a finalized step directory.
METADATA_FILE = "_CHECKPOINT_METADATA"
ITEMS = ("state", "data", "config")
# Orbax writes a step into `<step>.orbax-checkpoint-tmp[-<suffix>]` and renames it when it is complete.
TEMPORARY = ".orbax-checkpoint-tmp"
# The key of nestor's record in a step's Orbax metadata: {"manifest": its file name, "health": ...}.
RECORD = "nestor"
# What a process says of its check or read of a checkpoint, when not the error it hit.
_DONE, _MISFIT = "done", "does not fit the config"


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


def handing_back_failures(handler):
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
    saved, wanted = _shapes(saved_state), _shapes(layout.abstract)
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


class CheckpointReader:
    """The restoring half of `orchestrator.checkpoint.Checkpointer`, which provides what it reads
    through: `config`, `layout`, `log`, `directory`, `manager` (None for a reader of another run's
    checkpoints) and `_open()` (a new manager)."""

    config: Config
    layout: StateLayout
    directory: Path
    manager: ocp.CheckpointManager

    def latest_step(self) -> int | None:
        """Returns the newest finalized step, or None when there is none."""
        return self.manager.latest_step()

    def saved_config(self, step: int) -> dict:
        """Returns the resolved config (plain data) of the run that wrote checkpoint `step`.

        Read by this process alone: through Orbax's item handler, not the
        manager, whose restore ends at a barrier of every process.
        """
        return ocp.JsonCheckpointHandler().restore(self.directory / str(step) / "config")

    def record(self, step: int) -> dict:
        """Returns nestor's record of checkpoint `step` ({} for one of a nestor older than the records).

        Read by this process alone from the step's own files, as `check` and a reader's `read` are: a
        reader never opens Orbax's manager, which reads every step's metadata (one being rotated out
        fails it)."""
        metadata = json.loads((self.directory / str(step) / METADATA_FILE).read_text())
        return (metadata.get("custom_metadata") or {}).get(RECORD) or {}

    def check(self, step: int) -> None:
        """Raises ConfigError when checkpoint `step`'s arrays do not fit the current config (another
        model, MoE layout or optimizer chain); other settings, the mesh included, may change on resume.

        Raises CorruptCheckpoint when this process's share of the files differs
        from the manifest written at save, or when the manifest its record
        promises is missing; a step of an older nestor without one is not
        checked, and process 0 says so in one warning at each restore. Reads no
        array and waits for no other process.
        """
        step_dir = self.directory / str(step)
        if (step_dir / MANIFEST).is_file():
            verify_manifest(step_dir, ITEMS)
        elif self.record(step).get("manifest"):
            raise CorruptCheckpoint(f"{MANIFEST} is missing (nestor wrote one with this checkpoint)")
        elif jax.process_index() == 0:
            self.log(f"warning: checkpoint {shown(step_dir)} has no {MANIFEST} (written by an older nestor, or a "
                     "synchronous save cut off before it); restored without checking its files")
        _check_fits(ocp.StandardCheckpointHandler().metadata(step_dir / "state"), self.saved_config(step), self.config,
                    self.layout, step_dir)

    def read(self, step: int) -> tuple[dict, dict]:
        """Returns (state, data_state) of `step`, the state laid out for the current mesh.

        Every process must call it: Orbax's restore ends at a barrier of all. A
        read that fails on this process is raised once every process passed it.
        A reader's (no manager) reads the step's items through their handlers, with no barrier of its own.
        """
        if self.manager is None:  # a reader's: this step's items, through their handlers
            step_dir = self.directory / str(step)
            state = ocp.StandardCheckpointHandler().restore(step_dir / "state",
                                                            args=ocp.args.StandardRestore(self.layout.abstract))
            return state, ocp.JsonCheckpointHandler().restore(step_dir / "data")
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
            reason = "; ".join(said if jax.process_count() == 1 else f"process {process}: {said}"
                               for process, said in failures)
            self.set_aside([step], f"unusable ({reason})")
        return not failures, result

    def set_aside(self, steps: list[int], reason: str) -> None:
        """Moves checkpoints `steps` to torn_checkpoints/ (process 0; every process waits), saying `reason`."""
        if not steps:
            return
        self.manager.close()
        if jax.process_index() == 0:
            for step in steps:
                quarantine(self.directory / str(step), reason, self.log)
        wait_for_every_process(f"checkpoints {steps} moved aside", VERDICT_TIMEOUT_S)
        self.manager = self._open()
