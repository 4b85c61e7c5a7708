"""A `jax.profiler` trace of chosen training steps, written where TensorBoard's profile plugin finds it.

`profile.start_step` (1-based, as steps are numbered in metrics.jsonl) and
`profile.steps` choose the steps. The trace goes to `run.dir/tb/plugins/profile/<time>/`
on process 0 only, so `tensorboard --logdir run.dir/tb` lists it under the
Profile tab (the `tensorboard-plugin-profile` package). The trace starts once
the step before the first traced one has finished and stops once the last
traced step's outputs are ready, so it holds exactly the requested steps.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import jax

from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.paths import shown


class StepProfiler:
    """Starts and stops a trace around steps `profile.start_step` .. `start_step + steps - 1`."""

    def __init__(self, config: Config, enabled: bool, log=print):
        self.first = config.profile.start_step
        self.last = self.first + config.profile.steps - 1
        self.enabled = enabled and self.first > 0
        self.directory = Path(config.run.dir) / "tb"
        self.log = log
        self.active = False

    def before(self, step: int, previous_outputs) -> float | None:
        """Starts the trace when `step` (about to run) is the first traced one, once `previous_outputs`
        (the step before's state and metrics, an evaluation's included) are computed; returns the time
        (`time.perf_counter`) they were, so that the previous step's time ends there and not after the
        trace has started, or None when no trace starts."""
        if self.enabled and step == self.first:
            jax.block_until_ready(previous_outputs)  # the previous step's work stays out of the trace
            ready = time.perf_counter()
            jax.profiler.start_trace(str(self.directory))
            self.active = True
            return ready
        return None

    def annotation(self, step: int):
        """Returns a context naming `step` in the trace (the profile's step markers); a no-op untraced."""
        if self.active:
            return jax.profiler.StepTraceAnnotation("train", step_num=step)
        return contextlib.nullcontext()

    def after(self, step: int, outputs) -> float | None:
        """Stops the trace after the last traced step, once its `outputs` are computed; returns the time
        they were, so that the step's time ends there and not after the trace is written (a second or
        more), or None when no trace stops."""
        if self.active and step == self.last:
            jax.block_until_ready(outputs)
            ready = time.perf_counter()
            self.stop()
            self.log(f"profiled steps {self.first}..{self.last}: {shown(self.directory)} (TensorBoard's Profile tab)")
            return ready
        return None

    def stop(self) -> None:
        """Ends a running trace (a run stopped early inside the traced steps); writes what it holds."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
