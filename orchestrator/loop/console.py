"""What a run says while it runs: one stream, written by the process the user watches.

`Console` is the run's voice: log lines, the compile status, and each logged
step, as a live bar with loss, tokens/s and time left on a terminal, or one
plain line per logged step elsewhere (no ANSI codes off a terminal). Under
Ray the training loop runs in worker processes whose output the user never
sees: rank 0 holds a `ForwardingConsole` that sends every call to the driver,
where `replay` hands it to the driver's own Console. So a run prints the same
lines under every launcher, once.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

# The Console methods a ForwardingConsole sends and `replay` accepts.
EVENTS = ("log", "compiling", "compiled", "start", "step", "close")
EVALUATED = (("eval_loss", ".4f"), ("eval_perplexity", ".2f"))  # shown beside a step that evaluated


class Console:
    """Prints a run's progress: a rich bar on a terminal, plain lines otherwise.

    `log` receives every plain line (print by default); `interactive=None`
    asks whether stdout is a terminal. A Console given its own `log` is never
    interactive: its caller wants the lines.
    """

    def __init__(self, log: Callable[[str], Any] | None = None, interactive: bool | None = None):
        self._print = log or (lambda line: print(line, flush=True))
        if interactive is None:
            interactive = log is None and sys.stdout.isatty()
        self.interactive = interactive
        self.bar = None
        self.task = None
        self._status = None
        self._compile_started = 0.0

    @classmethod
    def silent(cls) -> "Console":
        """Returns a Console that shows nothing (tests, non-lead processes)."""
        return cls(log=lambda line: None)

    def log(self, line: str) -> None:
        """Prints one line, above the live bar when there is one."""
        if self.bar is not None:
            self.bar.console.print(line, markup=False, highlight=False)
        else:
            self._print(line)

    def compiling(self, what: str = "the train step") -> None:
        """Says compilation started; a spinner on a terminal."""
        self._compile_started = time.perf_counter()
        if self.interactive:
            from rich.console import Console as RichConsole

            self._status = RichConsole().status(f"compiling {what} ...")
            self._status.start()
        else:
            self._print(f"compiling {what} ...")

    def compiled(self, seconds: float) -> None:
        """Says compilation finished and how long it took."""
        if self._status is not None:
            self._status.stop()
            self._status = None
        self.log(f"compiled in {seconds:.1f} s")

    def start(self, total_steps: int, first_step: int) -> None:
        """Opens the progress display for steps first_step+1 .. total_steps."""
        if not self.interactive:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                            TextColumn("loss {task.fields[loss]}  {task.fields[rate]}"),
                            TimeRemainingColumn())
        self.task = self.bar.add_task("train", total=total_steps, completed=first_step, loss="-", rate="-")
        self.bar.start()

    def step(self, record: dict) -> None:
        """Shows one logged step (a metrics.jsonl record); a step that evaluated adds its eval loss on the bar's
        terminal as a line of its own."""
        evaluated = "  ".join(f"{name} {record[name]:{shown}}" for name, shown in EVALUATED if name in record)
        rate = (f"{record['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in record
                else f"{record.get('rows_per_s', math.nan):.0f} rows/s")
        if self.bar is not None:
            self.bar.update(self.task, completed=record["step"], loss=f"{record['loss']:.4f}", rate=rate)
            if evaluated:
                self.log(f"step {record['step']:5d}  {evaluated}")
            return
        mfu = f"  mfu {record['mfu']:.1%}" if "mfu" in record else ""
        self._print(f"step {record['step']:5d}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                    f"grad_norm {record['grad_norm']:.3f}  {rate}{mfu}"
                    + (f"  {evaluated}" if evaluated else ""))

    def close(self) -> None:
        """Stops the live bar (its last state stays on screen) and any spinner."""
        if self._status is not None:
            self._status.stop()
            self._status = None
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class ForwardingConsole:
    """A Console whose calls travel, as (method, args) messages, to `send` (a worker's line to the driver)."""

    def __init__(self, send: Callable[[tuple], Any]):
        self._send = send

    def __getattr__(self, name: str):
        if name not in EVENTS:
            raise AttributeError(name)
        return lambda *args: self._send((name, args))


def replay(console: Console, message: tuple) -> None:
    """Runs one message of a ForwardingConsole on `console`; raises ValueError for anything else."""
    name, args = message
    if name not in EVENTS:
        raise ValueError(f"not a console event: {name!r}")
    getattr(console, name)(*args)
