"""Signals before a run handles them: kept for the run, so that none is lost, and the exception a second
one (or one the run cannot wait for) stops the command with."""

from __future__ import annotations

import contextlib
import signal
import threading


class Interrupted(KeyboardInterrupt):
    """A signal that stops a command at once, without a save (Ctrl-C's KeyboardInterrupt, with its signal)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__()
        self.signum = signum


# A signal that came while `signals_kept_for_the_run` was active, before a run handled signals itself.
_kept: list[int] = []


def _keep(signum, frame) -> None:
    if _kept:
        raise Interrupted(signum)  # a second one: stop now
    _kept.append(signum)


@contextlib.contextmanager
def _handling(handlers: dict[int, object]):
    """While active, `handlers` (signal -> handler) are installed, in the main thread only (the only one
    that may install them); the previous ones come back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def signals_kept_for_the_run():
    """While active (in the main thread), a first SIGINT or SIGTERM only waits for the run to take it
    (`kept_signal`): raised as KeyboardInterrupt wherever Python happens to be, it can be lost (inside a
    garbage-collection callback, say) and the run would go on. A second raises Interrupted."""
    _kept.clear()
    try:
        with _handling({signal.SIGINT: _keep, signal.SIGTERM: _keep}):
            yield
    finally:
        _kept.clear()


def kept_signal() -> int | None:
    """Returns, and forgets, the signal `signals_kept_for_the_run` kept, or None."""
    return _kept.pop() if _kept else None


def _terminated(signum, frame) -> None:
    raise Interrupted(signum)


def sigterm_interrupts():
    """While active (in the main thread), SIGTERM stops the command as Ctrl-C does: Interrupted."""
    return _handling({signal.SIGTERM: _terminated})
