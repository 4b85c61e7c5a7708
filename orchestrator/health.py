"""Which train states are fit to be saved: finite is not enough.

A learning rate that is too high can blow the parameters up by orders of
magnitude while every number stays finite; saved, such a state would be
"the newest checkpoint" that every resume starts from and fails again. A
state is saved only if its loss and parameter norm are at most
`checkpoint.health_factor` times the median of their recent healthy values
(the last `HISTORY` steps). The parameter norm's history starts with the
norm of the state the run started from (initialised or restored), so even
the first step after a start or a resume is judged. Loss and parameter norm
are replicated, so every process reaches the same verdict.
"""

from __future__ import annotations

import collections

import numpy as np

HISTORY = 20  # steps whose values make "recent history"
JUDGED = ("loss", "param_norm")
# What to change before running a run again that blew up (its checkpoints refused, or NaN).
CALMER = "lower optimizer.lr, raise optimizer.warmup_steps or set optimizer.clip_norm"


class StateHealth:
    """Judges each step's loss and parameter norm against their recent healthy values."""

    def __init__(self, factor: float, start_param_norm: float):
        self.factor = factor
        self.history = {name: collections.deque(maxlen=HISTORY) for name in JUDGED}
        self.history["param_norm"].append(start_param_norm)

    def judge(self, values: dict) -> str | None:
        """Returns why the state these values (loss, param_norm) belong to must not be saved, or None.

        Healthy values join the history; a blown-up value does not, so a run
        that stays blown up is never saved. With factor 0 every finite state
        is healthy.
        """
        problems = []
        for name in JUDGED:
            value, recent = float(values[name]), self.history[name]
            if self.factor and recent and value > self.factor * (median := float(np.median(recent))):
                problems.append(f"{name} {value:.4g} is more than checkpoint.health_factor={self.factor:g} x its "
                                f"median {median:.4g} over the last {len(recent)} healthy steps")
        if problems:
            return "; ".join(problems)
        for name in JUDGED:
            self.history[name].append(float(values[name]))
        return None
