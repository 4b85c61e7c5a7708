"""The run's own checkpoints, with Orbax: asynchronous saves, newest N kept, a failed save stops the run in
one line; at the start, the newest checkpoint that every process can check and read is restored and any
that cannot is moved aside.

A checkpoint `run.dir/checkpoints/<step>/` holds three items:
- `state`: the train state {"step", "params", "opt_state"} in its canonical
  layout (layers stacked `[layers, ...]`), written shard by shard (of a LoRA
  run's params, the adapters: its base is read again from its source);
- `data`: the input iterator's state (next step, source fingerprint), JSON;
- `config`: the resolved config of the run that wrote it, JSON.

Orbax writes a save into a temporary directory and renames it to `<step>`
only once every item is on disk, so a process killed mid-write leaves a
`*.orbax-checkpoint-tmp-*` directory that is never listed as a step.

A step directory holds `nestor_manifest.json`, the checksums of its files
(orchestrator/checkpoint/manifest.py): an asynchronous save writes it into
the temporary directory just before Orbax's rename, a synchronous one
(`checkpoint.async=false`) right after; once the save is final, the files
Orbax wrote last (its `_CHECKPOINT_METADATA`) are added to it. Each process hashes the array files it
wrote as soon as its writes are done, in Orbax's background save thread, and
sends the digests to process 0, which hashes only the few files Orbax writes
when it finalizes and writes the manifest. What a restore checks (the arrays
fit the config, the files match the manifest) is orchestrator/checkpoint/reader.py's;
in a multi-process run every process checks and reads its share and all decide
together (`Checkpointer._judged`).

A save that fails (disk full, read-only file system), in the foreground or in
the background, raises CheckpointWriteError as soon as the loop next asks
(every step): the failed step's directories are removed and the older
checkpoints are left as they were.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from nestor.orchestrator.checkpoint.files import (ITEMS, RECORD, TEMPORARY, finalized_steps,
                                                  quarantine, quarantine_incomplete)
from nestor.orchestrator.checkpoint.manifest import MANIFEST, records, seal, write_manifest, written_by
from nestor.orchestrator.checkpoint.reader import BASE, CheckpointReader
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.errors import ConfigError, RunFailed
from nestor.orchestrator.job.processes import (VERDICT_TIMEOUT_S, every_process_says, received_by_process_0,
                                               send_to_process_0, wait_for_every_process)
from nestor.orchestrator.job.state import StateLayout, with_base
from nestor.orchestrator.paths import shown

# What a process says of its check or read of a checkpoint, when not the error it hit.
_DONE, _MISFIT = "done", "does not fit the config"


class CheckpointWriteError(RunFailed):
    """A checkpoint could not be written (disk full, read-only file system); the run stops."""


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


# Orbax writes a replicated shard cooperatively: each replica slices off its part on the device and
# writes that. Each slice is a small jitted program, compiled once per array shape and sharding: 72
# compiles (20-50 ms each) in the quickstart's first save, 1.4 s of a 5.3 s five-step run. Below this
# many bytes per replica, one replica writes the whole shard instead, as Orbax does for unreplicated
# ones; the large arrays of a real model still split their writes over their replicas.
MIN_REPLICA_SLICE_BYTES = 1 << 20


@functools.cache  # once per process: Orbax keeps one handler of jax.Arrays per process
def _write_small_replicated_shards_whole() -> None:
    """Makes Orbax slice a replicated shard over its replicas only when each slice has
    MIN_REPLICA_SLICE_BYTES."""
    # The handler Orbax registers by default keeps array metadata in this store; no public path to it.
    from orbax.checkpoint._src.metadata.array_metadata_store import Store

    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # Orbax warns that the handler is replaced: the point here
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
                                                      array_metadata_store=Store()), override=True)
    finally:
        absl.setLevel(level)


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


class _DoneOnceHashed:
    """An Orbax commit future: done once an item's writes on this process are done and `hash_written`
    (called once) has hashed what this process wrote. Orbax waits for it in its background save thread
    (in `save` itself with `checkpoint.async=false`), off the training loop's path."""

    def __init__(self, writes: list, hash_written):
        self.writes, self.hash_written, self.hashed = writes, hash_written, False

    def result(self, timeout: float | None = None) -> None:
        for write in self.writes:
            write.result(timeout=timeout)
        if not self.hashed:
            self.hash_written()
            self.hashed = True


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


class Checkpointer:
    """The checkpoints of the run that holds run.dir: saves them, restores the newest one that reads on
    every process (`restore_latest`, in the current mesh's layout) and moves torn ones aside.

    It checks what it restores with a CheckpointReader's checks (fit, manifest) and reads through Orbax's
    manager, whose restore ends at a barrier of every process. Torn checkpoints and temporary directories
    of unfinished saves left in run.dir are its to move aside or delete when it opens.
    """

    def __init__(self, config: Config, layout: StateLayout, log=print):
        self.config = config
        self.layout = layout
        self.log = log
        self.reader = CheckpointReader(config, layout, log)  # holds Orbax's error logs back, too
        self.directory = self.reader.directory
        self.in_flight: int | None = None  # the step being saved in the background
        self.own_records: dict[int, str] = {}  # process 0: step -> its manifest records of the files it wrote
        _write_small_replicated_shards_whole()
        quarantine_incomplete(self.directory, log)
        self.manager = self._open()

    def saved_config(self, step: int) -> dict:
        """Returns the resolved config (plain data) of the run that wrote checkpoint `step`."""
        return self.reader.saved_config(step)

    def record(self, step: int) -> dict:
        """Returns nestor's record of checkpoint `step` ({} for one of a nestor older than the records)."""
        return self.reader.record(step)

    def read(self, step: int) -> tuple[dict, dict]:
        """Returns (state, data_state) of `step`, the state laid out for the current mesh.

        Every process must call it: Orbax's restore ends at a barrier of all. A
        read that fails on this process is raised once every process passed it.
        """
        args = ocp.args.Composite(state=ocp.args.StandardRestore(self.layout.saved), data=ocp.args.JsonRestore())
        restored = _read(self.manager.restore(step, args=args))
        return with_base(self.config, self.layout, restored.state), restored.data

    def restore_latest(self) -> tuple[int, dict, dict] | None:
        """Returns (step, state, data_state) of the newest checkpoint that restores, or None.

        A checkpoint that fails its check or its read on any process is moved
        aside with a warning and every process tries the next older one. Raises
        ConfigError when the checkpoint does not fit the config (on any process).
        """
        for step in sorted(self.manager.all_steps(), reverse=True):
            checked, _ = self._judged(step, "checked", self.reader.check)
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
        handlers = {"state": self._hashing_what_it_writes(handing_back_failures(ocp.StandardCheckpointHandler())),
                    "data": handing_back_failures(ocp.JsonCheckpointHandler()), "config": ocp.JsonCheckpointHandler()}
        return ocp.CheckpointManager(self.directory, item_handlers=handlers, options=options)

    def _hashing_what_it_writes(self, handler):
        """Returns Orbax item `handler` whose saves end, on every process, with the files this process
        wrote (`manifest.written_by`) hashed and their records sent to process 0 (`_share_records`)."""
        write = handler.async_save

        async def async_save(directory, args=None):
            writes = await write(directory, args=args)
            hash_written = functools.partial(self._share_records, self.in_flight, Path(directory))
            return [_DoneOnceHashed(writes or [], hash_written)]

        handler.async_save = async_save
        return handler

    @staticmethod
    def _records_name(step: int) -> str:
        return f"manifest records of checkpoint {step}"

    def _share_records(self, step: int, item_dir: Path) -> None:
        """Hashes the files this process wrote into `item_dir` and sends their records to process 0.

        `item_dir` is Orbax's temporary name of the item (`state.orbax-checkpoint-tmp`), renamed to
        the item's name when the save is finalized: records name the files under the item's name.
        """
        item = item_dir.name.split(TEMPORARY)[0]
        own = json.dumps({f"{item}/{name}": record
                          for name, record in records(item_dir, written_by(item_dir, jax.process_index())).items()})
        if jax.process_index() == 0:
            self.own_records[step] = own
        else:
            send_to_process_0(self._records_name(step), own)

    def _write_manifest(self, step: int, step_dir: Path) -> None:
        """Writes the manifest of `step` into `step_dir` from every process's records (process 0)."""
        received = received_by_process_0(self._records_name(step), self.own_records.pop(step))
        write_manifest(step_dir, ITEMS, functools.reduce(dict.__or__, map(json.loads, received)))

    def abandon_unfinished(self) -> None:
        """Removes the temporary directories of saves in flight (process 0), for a process that ends without
        finishing them (a hang): a run.dir keeps no `*.orbax-checkpoint-tmp` directory of a run that ended."""
        if jax.process_index() == 0:
            _remove_for_good(sorted(self.directory.glob(f"*{TEMPORARY}*")), limit_s=5.0)

    def _unfinished(self, step: int) -> list[Path]:
        return sorted(self.directory.glob(f"{step}{TEMPORARY}*"))

    def _seal_in_flight(self) -> None:
        """Writes the manifest into the temporary directory of the save in flight."""
        unfinished = self._unfinished(self.in_flight)
        if len(unfinished) != 1:
            raise CheckpointWriteError(f"expected one temporary directory for step {self.in_flight}, found "
                                       f"{[p.name for p in unfinished]}")
        self._write_manifest(self.in_flight, unfinished[0])

    def save(self, step: int, state: dict, data_state: dict, force: bool = False, health: dict | None = None) -> bool:
        """Starts saving `state` at `step` (in the background when `checkpoint.async`); returns whether it saved.

        Without `force`, saves only every `checkpoint.every` steps. `health`
        (health.StateHealth.record) is kept in the step's metadata with the
        promise of a manifest (`record`). Device buffers are copied to host
        before this returns, so the next step may donate them. Raises
        CheckpointWriteError when this save or the one before it failed.
        """
        if step in self.manager.all_steps():
            return False
        every = self.config.checkpoint.every
        if not force and not (every and step % every == 0):
            return False
        self.raise_if_failed(wait=True)
        args = ocp.args.Composite(state=ocp.args.StandardSave(self.layout.saved_part(state)),
                                  data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(self.config.to_dict()))
        self.in_flight = step
        try:
            record = {"manifest": MANIFEST, **({"health": health} if health else {}),
                      **({BASE: self.reader.base_fingerprint} if self.layout.from_source else {})}
            saved = self.manager.save(step, args=args, force=True, custom_metadata={RECORD: record})
            if not self.config.checkpoint.async_save:
                if jax.process_index() == 0:
                    self._write_manifest(step, self.directory / str(step))
                    self._seal(step)
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
        if jax.process_index() == 0:
            self._seal(self.in_flight)
        self.in_flight = None

    def _seal(self, step: int) -> None:
        """Adds the step files Orbax finalized (its metadata) to the manifest of checkpoint `step` (process 0)."""
        try:
            seal(self.directory / str(step), ITEMS)
        except (OSError, ValueError):  # a full disk: the unsealed manifest still checks every item's file
            pass

    def _failed(self, error: BaseException) -> None:
        """Removes what the failed save of the step in flight left (process 0) and raises CheckpointWriteError."""
        step, self.in_flight = self.in_flight, None
        # Orbax leaves its coroutines behind; their complaints at exit would bury the one line below.
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
        if jax.process_index() == 0:
            _remove_for_good([path for path in self._unfinished(step) + [self.directory / str(step)]
                              if path.exists() and not (path / MANIFEST).is_file()])
        kept = finalized_steps(self.directory)
        raise CheckpointWriteError(
            f"run.dir {shown(Path(self.config.run.dir).resolve())}: checkpoint {step} could not be written "
            f"({_cause(error)}); training stopped. "
            + (f"Checkpoints {', '.join(map(str, kept))} are intact; " if kept else "No checkpoint was kept; ")
            + "free space or make run.dir writable, then run again to resume") from None

    def close(self) -> None:
        """Finishes saves in flight and releases the manager; raises CheckpointWriteError if the last
        save failed."""
        try:
            self.raise_if_failed(wait=True)
        finally:
            self.manager.close()
