"""Goodput: every second of a run's wall clock charged to one category, across all its restarts.

An attempt is one call of `train()` (one process lifetime, or one start of a
Ray worker group). Its clock starts as `train()` starts, and `Goodput` charges
each second of it, as the host thread spends it, to one of ATTEMPT_CATEGORIES:
`restore` (building the start state: a checkpoint's restore, or a fresh state's init), `compile`, `data_wait`
(making the step's batch), `step` (dispatching steps and waiting on their
outputs), `checkpoint_save` (blocking in saves), `eval` (evaluations), and
`idle` (the rest: start-up, logging). Steps are
dispatched ahead of the host, so a category is the host's time, not the
device's: whatever the host does while a step runs is the host's category.

Process 0 appends to `run.dir/goodput.jsonl` a `start` record once the start
state is known, a `log` record at every logged step (`train.log_every`, every
checkpoint step among them), and an `end` record when the attempt ends (all
steps done, a signal, an exception); each holds the attempt's cumulative seconds
per category and the step reached. A process that is killed writes no `end`.

Across attempts (`run_goodput`), two more categories: `lost`, the step time of
an attempt's steps past the lowest step a later attempt resumed from (they
were run again, or thrown away), taken out of `step`; and `recovery`, the wall
time between an attempt's last record and the next attempt's start when the
attempt did not end by itself (killed, failed, or stopped by SIGTERM, the
signal of preemptions): the steps it ran after its last record fall there. A
gap after an attempt that the user ended is a pause, not the run's time: one
that completed, was stopped by SIGINT (Ctrl-C) or by its launcher's driver
(`nestor stop`, a Ctrl-C to the driver), or ended in a config error (the
user's to fix, as the CLI's exit 2 says). The run's wall time is the sum of
its attempts' and its recoveries', so the categories add up to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import time
from pathlib import Path

from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.loop.records import read_records
from nestor.orchestrator.user_code import user_frames

ATTEMPT_CATEGORIES = ("step", "compile", "data_wait", "checkpoint_save", "restore", "eval", "idle")
RUN_CATEGORIES = (*ATTEMPT_CATEGORIES, "lost", "recovery")
FILE_NAME = "goodput.jsonl"
# How an attempt that the user ended says so in its `end` record (`ended`); a gap after one is a pause.
COMPLETED = "completed"
PAUSES = (COMPLETED, signal.SIGINT.name)
USER_STOP = "stopped by its launcher: "  # and the signal its driver got (`nestor stop`'s SIGTERM, a Ctrl-C)
CONFIG_ERROR = "config error: "  # and the exception's type: a ConfigError, or an error raised in the user's code


def is_pause(ended: str) -> bool:
    """Returns whether the gap after an attempt that `ended` so is the user's time (a pause), not recovery."""
    return ended in PAUSES or ended.startswith((USER_STOP, CONFIG_ERROR))


def ending(error: BaseException) -> str:
    """Returns how `error` ended an attempt, as its `end` record says it: a second Ctrl-C's (or a signal's)
    name, CONFIG_ERROR and the type for what the CLI reports as a config error, else `error: <type>`."""
    signum = getattr(error, "signum", signal.SIGINT if isinstance(error, KeyboardInterrupt) else None)
    if signum:
        return signal.Signals(signum).name
    config_error = isinstance(error, ConfigError) or (isinstance(error, Exception) and user_frames(error))
    return f"{CONFIG_ERROR if config_error else 'error: '}{type(error).__name__}"


class Goodput:
    """The accountant of one attempt: charges the seconds since it was made to one category at a time
    (`idle` unless `charged` says otherwise) and, on process 0, writes them to goodput.jsonl."""

    def __init__(self):
        self.started_wall = time.time()
        self.started = self._since = time.perf_counter()
        self._current = "idle"
        self._seconds = dict.fromkeys(ATTEMPT_CATEGORIES, 0.0)
        self.path: Path | None = None  # goodput.jsonl once `start` wrote to it (process 0)
        self.attempt = 0
        self._before = dict.fromkeys(RUN_CATEGORIES, 0.0)  # the earlier attempts' share of the run
        self._step = 0

    def _switch(self, category: str) -> str:
        """Charges the time since the last switch to the current category; makes `category` current and
        returns the one it replaces."""
        now = time.perf_counter()
        self._seconds[self._current] += now - self._since
        self._since, previous, self._current = now, self._current, category
        return previous

    @contextlib.contextmanager
    def charged(self, category: str):
        """Charges the time inside the block to `category` (a block nested in it charges its own)."""
        previous = self._switch(category)
        try:
            yield
        finally:
            self._switch(previous)

    def seconds(self) -> dict[str, float]:
        """Returns the attempt's seconds per category so far; they add up to its elapsed time."""
        self._switch(self._current)
        return dict(self._seconds)

    def start(self, run_dir: Path, resumed_from: int, enabled: bool, log=print) -> None:
        """Opens the attempt in `run_dir`'s goodput.jsonl (process 0, `enabled`): writes its `start` record
        after the earlier attempts' and takes their share of the run, lost work and recovery included (a last
        line a kill cut short is cut off, said in one `log` line)."""
        self._step = resumed_from
        if not enabled:
            return
        self.path = Path(run_dir) / FILE_NAME
        earlier = read_records(self.path, log, cut=True)
        self.attempt = 1 + sum(record.get("event") == "start" for record in earlier)
        started = self._write("start", time=self.started_wall, resumed_from=resumed_from)
        self._before = total(run_goodput(earlier + [started])[:-1]).seconds

    def _record(self, event: str, **extra) -> dict:
        seconds = self.seconds()  # up to now, which is when the current category's time was last charged
        return {"event": event, "attempt": self.attempt, "step": self._step,
                "elapsed_s": round(self._since - self.started, 4),
                "seconds": {name: round(value, 4) for name, value in seconds.items()}, **extra}

    def _write(self, event: str, **extra) -> dict:
        """Appends a record of the attempt so far to goodput.jsonl (process 0); returns it."""
        record = self._record(event, **extra)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def log(self, step: int) -> dict[str, float]:
        """Writes a `log` record at `step`; returns the run's goodput so far as metrics: `goodput_<category>`
        (cumulative seconds over every attempt) and `goodput_fraction` (step over wall time)."""
        self._step = step
        seconds = self._write("log")["seconds"]
        run = {name: self._before[name] + seconds.get(name, 0.0) for name in RUN_CATEGORIES}
        wall = sum(run.values())
        return {"goodput_fraction": run["step"] / wall if wall > 0 else 0.0,
                **{f"goodput_{name}": value for name, value in run.items()}}

    def end(self, stopped_by: int | None, by_launcher: bool = False) -> str | None:
        """Writes the `end` record of an attempt that returned: COMPLETED, or the signal that stopped it
        (after USER_STOP when it came `by_launcher`, its driver told); returns the run's goodput in one line,
        every attempt so far included (None off process 0, or when the attempt never started: nothing to train)."""
        how = None if stopped_by is None else signal.Signals(stopped_by).name
        self._write("end", ended=COMPLETED if how is None else f"{USER_STOP}{how}" if by_launcher else how)
        return summary_line(run_goodput(read_records(self.path, log=lambda _: None))) if self.path is not None else None

    @contextlib.contextmanager
    def ending_on_error(self):
        """Writes the `end` record of an attempt that an exception ends (`ending`), then lets it go on."""
        try:
            yield
        except BaseException as error:
            self._write("end", ended=ending(error))
            raise


@dataclasses.dataclass
class AttemptGoodput:
    """One attempt's share of the run: its seconds per RUN_CATEGORIES (lost work and the recovery after it
    included), the steps it covered, how it ended, and the pause after it (not the run's time)."""
    attempt: int
    resumed_from: int
    last_step: int
    ended: str
    seconds: dict[str, float]
    paused_after: float = 0.0

    @property
    def wall(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float:
        """Productive step time over wall time (0 for no time)."""
        return self.seconds["step"] / self.wall if self.wall > 0 else 0.0


def _kept_step_seconds(records: list[dict], resumed_from: int) -> float:
    """Returns an attempt's step seconds up to step `resumed_from`: at its newest record at or before it."""
    at_or_before = [record for record in records if record["step"] <= resumed_from]
    return at_or_before[-1]["seconds"]["step"] if at_or_before else 0.0


def run_goodput(records: list[dict]) -> list[AttemptGoodput]:
    """Returns each attempt's share of the run described by goodput.jsonl `records`, in order."""
    by_attempt: dict[int, list[dict]] = {}
    for record in records:
        by_attempt.setdefault(record["attempt"], []).append(record)
    attempts = [group for group in by_attempt.values() if group[0]["event"] == "start"]
    shares = []
    for index, group in enumerate(attempts):
        start, last = group[0], group[-1]
        ended = last["ended"] if last["event"] == "end" else ("no end record: killed, or running"
                                                              if index == len(attempts) - 1 else "killed")
        seconds = {name: float(last["seconds"].get(name, 0.0)) for name in ATTEMPT_CATEGORIES}
        share = AttemptGoodput(start["attempt"], start["resumed_from"], last["step"], ended,
                               {**seconds, "lost": 0.0, "recovery": 0.0})
        later = attempts[index + 1:]
        if later:
            kept = _kept_step_seconds(group, min(following[0]["resumed_from"] for following in later))
            share.seconds["lost"] = max(0.0, seconds["step"] - kept)
            share.seconds["step"] -= share.seconds["lost"]
            gap = max(0.0, later[0][0]["time"] - (start["time"] + last["elapsed_s"]))
            if is_pause(ended):
                share.paused_after = gap
            else:
                share.seconds["recovery"] = gap
        shares.append(share)
    return shares


def total(attempts: list[AttemptGoodput]) -> AttemptGoodput:
    """Returns the run as one share: the attempts' seconds and pauses added up, from the first attempt's start
    step to the last one's last step (attempt 0)."""
    seconds = {name: sum(a.seconds[name] for a in attempts) for name in RUN_CATEGORIES}
    if not attempts:
        return AttemptGoodput(0, 0, 0, "", seconds)
    return AttemptGoodput(0, attempts[0].resumed_from, attempts[-1].last_step, attempts[-1].ended, seconds,
                          sum(a.paused_after for a in attempts))


def summary_line(attempts: list[AttemptGoodput]) -> str:
    """Returns one line of the run's goodput: its share of the wall time, then every category that took time."""
    run = total(attempts)
    spent = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in run.seconds.items() if round(seconds, 2))
    plural = "s" if len(attempts) != 1 else ""
    return f"goodput {run.goodput:.1%} of {run.wall:.2f} s over {len(attempts)} attempt{plural}: {spent}"


def report(attempts: list[AttemptGoodput]) -> str:
    """Returns a table of seconds per category, one row per attempt and one for the run, then the summary line
    (and the pauses between attempts, which are not the run's time)."""
    def row(label: str, share: AttemptGoodput, ended: str) -> list[str]:
        return [label, f"{share.resumed_from}..{share.last_step}",
                *(f"{share.seconds[name]:.2f}" for name in RUN_CATEGORIES), f"{share.wall:.2f}", f"{share.goodput:.1%}",
                ended]

    columns = ["attempt", "steps", *RUN_CATEGORIES, "wall", "goodput", "ended"]
    run = total(attempts)
    rows = [row(str(a.attempt), a, a.ended) for a in attempts] + [row("run", run, "")]
    widths = [max(len(row[i]) for row in [columns, *rows]) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) if i < len(columns) - 1 else cell for i, (cell, width)
                       in enumerate(zip(row, widths))).rstrip() for row in [columns, *rows]]
    lines.append(summary_line(attempts))
    if run.paused_after:
        lines.append(f"paused between attempts (after one completed, was stopped by the user or ended in a config "
                     f"error; not counted): {run.paused_after:.2f} s")
    return "\n".join(lines)
