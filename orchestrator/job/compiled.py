"""What a train step compiled without running says about itself: its memory per device (XLA's memory
analysis beside the state's own bytes) and its FLOPs per device (XLA's count, each loop body once per
iteration). `nestor explain` reports them; the planner ranks candidates with them."""

from __future__ import annotations

import math
import re
import time

import jax

from nestor.orchestrator.job.build import Job, abstract_batch, devices_here
from nestor.orchestrator.job.state import per_device_bytes
from nestor.orchestrator.loader.memory_fit import fit_report
from nestor.orchestrator.job.step import make_train_step
from nestor.parallel.hlo import estimated_flops, float_normalization_flops, flops_by_phase, flops_per_run


def lower_step(job: Job, step_fn=None):
    """Returns the train step (or `step_fn`, another step of `job`'s) lowered for abstract inputs (traced;
    nothing is allocated, no data is read)."""
    return (step_fn or job.step_fn).lower(job.layout.abstract, abstract_batch(job))


def compile_step(job: Job):
    """Returns the compiled train step for abstract inputs (nothing is allocated, no data is read)."""
    return lower_step(job).compile()


def timed_compile(job: Job):
    """Returns (the compiled train step, seconds spent tracing, lowering and compiling it)."""
    start = time.perf_counter()
    compiled = compile_step(job)
    return compiled, time.perf_counter() - start


def counting_lowered(job: Job):
    """Returns the step lowered for counting the target's FLOPs where the train step's count is not theirs:
    its grouped matmuls multiply each row once, as the target's kernels do where this compile's ragged_dot
    does not (`Backend.for_flop_count`); else None."""
    counting = job.backend.for_flop_count()
    if counting is None:
        return None
    return lower_step(job, make_train_step(job.config, job.layout, job.mesh, job.rules, counting))


def counted_step(job: Job, compiled=None):
    """Returns the compiled step whose FLOPs are the target's: `compiled` (default: compiled here), or a
    second compile of `counting_lowered`."""
    lowered = counting_lowered(job)
    if lowered is None:
        return compiled if compiled is not None else compile_step(job)
    return lowered.compile()


def cost_flops(compiled) -> float:
    """Returns XLA's FLOP count for one run of `compiled` (per device, as XLA reports it).

    XLA counts a loop body once, whatever its trip count: `step_flops` counts
    it once per iteration.
    """
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", math.nan))


def step_flops(compiled) -> float:
    """Returns the FLOPs per device of one run of `compiled` with every loop body counted once per
    iteration: XLA's cost analysis, its loop bodies scaled by their trip counts (parallel.hlo.flops_per_run)."""
    return flops_per_run(compiled.as_text(), cost_flops(compiled))


def target_flops(job: Job, compiled, counted=None) -> dict:
    """Returns the FLOPs per device of `job`'s step as its target runs it: `per_device` (XLA's count with
    loop bodies per iteration, grouped matmuls as the target's kernels run them, less XLA:CPU's converts
    to and from float32 that the target does not run), `widened` (those converts), `phases`
    (parallel.hlo.flops_by_phase), `regrouped` (whether a second compile counted the grouped matmuls),
    `counted_by` and `left_out_in`; `counted` is `counted_step`'s program where the caller compiled it. XLA:GPU
    compiling without the device has no cost analysis: its HLO's instructions are counted as XLA counts them,
    its custom calls (cuDNN's attention, named) left out."""
    counted = counted if counted is not None else counted_step(job, compiled)
    text = counted.as_text()
    widened = 0.0
    if job.backend.widens_what_the_target_does_not():
        widened = float_normalization_flops(text)
    cost_analysis = counted.cost_analysis() is not None
    return {"per_device": (step_flops(counted) if cost_analysis else estimated_flops(text)) - widened,
            "widened": widened, "phases": flops_by_phase(text), "regrouped": counted is not compiled,
            "counted_by": "XLA cost analysis" if cost_analysis else "the HLO's instructions",
            "left_out_in": sorted(set(re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', text)))}


MEMORY_PARTS = ("params", "optimizer", "temporaries", "peak_estimate")  # what LoRA is compared on


def state_bytes(job: Job) -> dict[str, int]:
    """Returns the bytes per device of `job`'s parameters and optimizer state, as its layout shards them."""
    abstract = job.layout.abstract
    return {part: sum(per_device_bytes(leaf) for leaf in jax.tree.leaves(abstract[tree]))
            for part, tree in (("params", "params"), ("optimizer", "opt_state"))}


def memory_per_device(job: Job, compiled) -> dict[str, int]:
    """Returns the bytes per device of `job`'s state (params, optimizer) and of its compiled step (XLA's
    memory analysis: arguments, outputs, aliased, temporaries, and their peak estimate)."""
    memory = compiled.memory_analysis()
    return state_bytes(job) | {
        "arguments": memory.argument_size_in_bytes,
        "outputs": memory.output_size_in_bytes,
        "aliased": memory.alias_size_in_bytes,
        "temporaries": memory.temp_size_in_bytes,
        "peak_estimate": (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
                          + memory.temp_size_in_bytes),
    }


def step_fit(job: Job, memory: dict[str, int]) -> dict:
    """Returns explain's `fit` entry for `job`'s compiled step, whose `memory_per_device` is `memory`."""
    return fit_report(job.config, job.backend, memory["params"] + memory["optimizer"], memory["temporaries"],
                      memory["peak_estimate"], devices_here(job.mesh), job.mesh.shape["pipeline"])
