"""Stopping a run on a signal: SIGTERM and SIGINT save the step reached and stop, in every process alike."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

import jax

from nestor.cluster.interrupts import Interrupted, kept_signal
from nestor.orchestrator.job.processes import preemption_agreed, preemption_is_agreed


def no_stop_request(now: bool = False) -> None:
    """The `stop_requested` of a run that no launcher can stop: never a signal."""


class StopSignals:
    """While active, SIGTERM and SIGINT only set `received`: the loop saves and stops at the next step
    (a SIGINT after the first signal raises KeyboardInterrupt: Ctrl-C twice stops at once);
    `on_signal(signum, calls)` hears the first one when the loop next asks (`stop_before(calls)`).

    In a multi-host run SIGTERM belongs to jax's preemption sync manager (see
    `preemption_agreed`), so that every process stops after the same step;
    SIGINT is handed to it as a SIGTERM. `requested` (a Ray launcher's
    `stop_requested`) returns a signal sent to the process that launched this
    one, or None: it stops the run as that signal here would have
    (`requested(now=True)` asks at once, where it matters: which signal stopped the run).
    """

    def __init__(self, requested: Callable[..., int | None] = no_stop_request,
                 on_signal: Callable[[int, int], None] = lambda signum, calls: None):
        self.received: int | None = None
        self._requested = requested
        self._on_signal = on_signal  # hears the first signal once the loop sees it (printing inside a signal
        self._announced = False      # handler could interrupt a print of the loop's own)
        self._passed_on = False  # a request handed to the preemption sync manager
        self._kept: int | None = None  # a signal kept before the run handled signals, taken as a request
        self._previous: dict[int, object] = {}
        self._deferring = False  # inside `deferred`: a second Ctrl-C waits for the block's end
        self._cut: int | None = None  # the second Ctrl-C that came inside `deferred`

    def __enter__(self) -> "StopSignals":
        # Handlers can only be installed from the main thread; elsewhere the caller owns signals.
        if threading.current_thread() is threading.main_thread():
            if preemption_is_agreed():
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._forward)
            else:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    self._previous[signum] = signal.signal(signum, self._handle)
        self._kept = kept_signal()  # one that came before the run handled signals: stop before the first step
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            if self._deferring:
                self._cut = signum
                return
            raise Interrupted(signum)  # a second Ctrl-C: stop now, without the save
        self.received = signum

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block that a second Ctrl-C does not cut: it raises Interrupted as the block ends (a save and
        the record of its step are written together, or neither)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._cut is not None:
            raise Interrupted(self._cut)

    @contextlib.contextmanager
    def cuttable(self) -> Iterator[None]:
        """Inside `deferred`: a block that a second Ctrl-C does stop at once (a save in progress: the user who
        presses it again wants out, and an unfinished save leaves an older checkpoint to resume)."""
        deferring, self._deferring = self._deferring, False
        try:
            yield
        finally:
            self._deferring = deferring

    @staticmethod
    def _forward(signum, frame) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    def stop_before(self, calls: int) -> bool:
        """Returns whether to stop before this run's `calls`-th step (from 1): a signal came to this
        process, or, in a multi-host run, every process agreed on this step after one got SIGTERM."""
        requested = None if self.received is not None or self._passed_on else self._kept or self._requested()
        if requested is not None:
            self._passed_on = True
            if preemption_is_agreed():
                os.kill(os.getpid(), signal.SIGTERM)  # every process stops after the step they agree on
            elif jax.process_count() == 1:
                self.received = requested
            # else processes that cannot agree on a step go on: one that stopped alone would hang the rest
        if self.received is None and preemption_agreed(calls):
            self.received = self._requested(now=True) or signal.SIGTERM
        if self.received is not None and not self._announced:
            self._announced = True
            self._on_signal(self.received, calls)
        return self.received is not None

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def stopping_line(signum: int, workers: bool = False) -> str:
    """What a run says when a signal reaches it: it saves at the next step (`workers`: the Ray driver's, for
    the worker group); the hint of a second Ctrl-C for a Ctrl-C only (a submitted job's driver gets `nestor
    stop`'s SIGTERM, and its log has no keyboard)."""
    what = "the workers stop and save at the next step they all reach" if workers else \
        "stopping and saving at the next step"
    again = f" (press Ctrl-C again to stop{' them' if workers else ''} now, without a save)" \
        if signum == signal.SIGINT else ""
    return f"{signal.Signals(signum).name}: {what}{again}"
