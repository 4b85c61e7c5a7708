"""Progress on a terminal (a rich bar with step, loss, tokens/s, ETA) or plain log lines elsewhere."""

from __future__ import annotations

import sys


class ProgressReporter:
    """Shows each logged step: a live bar when stdout is a TTY, one log line per step otherwise."""

    def __init__(self, total_steps: int, first_step: int, log=print, interactive: bool | None = None):
        self.log = log
        self.bar = None
        if sys.stdout.isatty() if interactive is None else interactive:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tokens_per_s]:.0f} tok/s"),
                                TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total_steps, completed=first_step,
                                          loss=float("nan"), tokens_per_s=0.0)
            self.bar.start()

    def update(self, record: dict) -> None:
        """Advances to `record["step"]` and shows its loss and throughput."""
        if self.bar is not None:
            self.bar.update(self.task, completed=record["step"], loss=record["loss"],
                            tokens_per_s=record["tokens_per_s"])
            return
        mfu = f"  mfu {record['mfu']:.1%}" if "mfu" in record else ""
        self.log(f"step {record['step']:5d}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                 f"grad_norm {record['grad_norm']:.3f}  {record['tokens_per_s']:.0f} tok/s{mfu}")

    def close(self) -> None:
        """Stops the live bar, leaving its last state on screen."""
        if self.bar is not None:
            self.bar.stop()
