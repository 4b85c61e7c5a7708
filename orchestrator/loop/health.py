"""Which train states are fit to be saved: finite is not enough, and a slow blow-up must not pass either.

A learning rate that is too high can blow the parameters up by orders of
magnitude while every number stays finite, slowly enough that each step looks
like the last. A state is judged against the best the run has seen, not against
a recent history that drifts with the blow-up: its loss (the median over the
last `HEALTH_WINDOW` steps, so one hard batch is no blow-up) and its parameter norm
must be at most `checkpoint.health_factor` times the best median loss and the
norm of the state that had it. The best travels with each checkpoint
(`record`), so a resume is judged against the run's best, not against its own
first steps. Loss and parameter norm are replicated, so every process reaches
the same verdict.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from nestor.orchestrator.config.schema import HEALTH_WINDOW

MIN_LOSSES = 5  # a loss is judged once the window holds this many steps (the norm from the first step)
# What to change before running a run again that blew up (its checkpoints refused, or NaN).
CALMER = "lower optimizer.lr, raise optimizer.warmup_steps or set optimizer.clip_norm"


@dataclasses.dataclass(frozen=True)
class Best:
    """The best state a run has seen: its median loss, parameter norm and step."""

    loss: float
    param_norm: float
    step: int


class StateHealth:
    """Judges each step's state by its median loss and its parameter norm against the run's best."""

    def __init__(self, factor: float, best: Best | None = None, start_param_norm: float | None = None):
        """`best`: the run's best before this start (a checkpoint's record); without one, the state the run
        starts from (its `start_param_norm`) is the best until the loss has been judged."""
        self.factor = factor
        self.best = best or (None if start_param_norm is None else Best(math.inf, start_param_norm, 0))
        self.losses: collections.deque[float] = collections.deque(maxlen=HEALTH_WINDOW)
        self.last: dict = {}  # the loss and norm of the state judged healthy last

    def judge(self, step: int, values: dict) -> str | None:
        """Returns why the state of `step` (its loss and param_norm in `values`) must not be saved, or None.

        A healthy state with a lower median loss than the best becomes the best. With factor 0 every
        finite state is healthy.
        """
        self.losses.append(float(values["loss"]))
        loss, norm = float(np.median(self.losses)), float(values["param_norm"])
        problems = []
        if self.factor and self.best is not None:
            if len(self.losses) >= MIN_LOSSES and loss > self.factor * self.best.loss:
                problems.append(f"its loss {loss:.4g} (median of the last {len(self.losses)} steps) is more than "
                                f"checkpoint.health_factor={self.factor:g} x the best, {self.best.loss:.4g} at step "
                                f"{self.best.step}")
            if norm > self.factor * self.best.param_norm:
                problems.append(f"its parameter norm {norm:.4g} is more than checkpoint.health_factor="
                                f"{self.factor:g} x {self.best.param_norm:.4g}, the norm of the best state "
                                f"(step {self.best.step})")
        if problems:
            return "; ".join(problems)
        if self.best is None or (len(self.losses) >= MIN_LOSSES and loss < self.best.loss):
            self.best = Best(loss, norm, step)
        self.last = {"loss": loss, "param_norm": norm}
        return None

    def record(self) -> dict:
        """Returns what a checkpoint of the state judged last keeps: its loss, norm and the run's best."""
        return {**self.last, "best": dataclasses.asdict(self.best)}

    @staticmethod
    def restored_state_is_broken(loss: float) -> bool:
        """Whether the first loss after a restore, computed on the restored parameters before any update
        (so no learning rate is to blame), says the checkpoint is broken: it is not finite. (A finite jump
        may be other data: the gate judges it as any other state.)"""
        return not np.isfinite(loss)


def best_of(record: dict | None) -> Best | None:
    """Returns the run's best kept in a checkpoint's `record`, or None where it has none."""
    return Best(**record["best"]) if record and "best" in record else None
