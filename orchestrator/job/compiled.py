"""What a train step compiled without running says about itself: its memory per device (XLA's memory
analysis beside the state's own bytes) and its FLOPs per device (XLA's count, each loop body once per
iteration). `nestor explain` reports them; the planner ranks candidates with them."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import importlib.metadata
import json
import math
import os
import re
import threading
import time
import types
from pathlib import Path

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
    """Returns the compiled train step for abstract inputs (nothing is allocated, no data is read); for a
    deviceless target, its figures (`compile_lowered`)."""
    return compile_lowered(job, lower_step(job))


@dataclasses.dataclass(frozen=True)
class CompiledFigures:
    """What nestor reads of a step compiled for a target's deviceless topology, read like the compiled step:
    its HLO text and XLA's cost and memory analyses. `cached`: read from `run.compile_cache`."""

    text: str
    cost: dict[str, float] | None
    memory: dict[str, int]
    cached: bool = False

    @classmethod
    def of(cls, compiled) -> CompiledFigures:
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):
            cost = cost[0]
        memory = compiled.memory_analysis()
        return cls(compiled.as_text(), None if cost is None else dict(cost),
                   {name: int(getattr(memory, name)) for name in MEMORY_ANALYSIS})

    def as_text(self) -> str:
        return self.text

    def cost_analysis(self) -> dict[str, float] | None:
        return self.cost

    def memory_analysis(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(**self.memory)


MEMORY_ANALYSIS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
FIGURES_DIR = "deviceless"  # under run.compile_cache, beside JAX's own entries


def compile_lowered(job: Job, lowered):
    """Returns `lowered`, a step of `job`, compiled; for a target's deviceless topology, `CompiledFigures`.

    JAX's persistent cache cannot load a deviceless executable back (it needs a client of the target's
    devices), so it is bypassed for these compiles; their figures are kept in `run.compile_cache` instead,
    under the program, its devices and the compiler's versions and flags, and read back on the next compile
    of the same program (explain, plan and the launch's compile check run again)."""
    if not job.backend.deviceless:
        return lowered.compile()
    directory = job.config.run.compile_cache
    path = Path(directory) / FIGURES_DIR / f"{_figures_key(job, lowered)}.json.gz" if directory else None
    if path is not None and path.is_file():
        try:
            return CompiledFigures(**json.loads(gzip.decompress(path.read_bytes())), cached=True)
        except (OSError, ValueError, TypeError):
            pass  # damaged or from another nestor: compiled again and written over
    with _without_jax_cache():
        figures = CompiledFigures.of(lowered.compile())
    if path is not None:
        with contextlib.suppress(OSError):  # a cache is an optimisation: never fail a compile for it
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = {name: value for name, value in dataclasses.asdict(figures).items() if name != "cached"}
            written = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # plan's threads
            written.write_bytes(gzip.compress(json.dumps(kept).encode()))
            written.replace(path)
    return figures


def _figures_key(job: Job, lowered) -> str:
    """Returns the hash that names a deviceless compile's figures: the lowered program, the devices it is
    laid out on, the target's description (backend.targets) and the versions and flags of the compilers."""
    from nestor.backend.targets import GPU_TARGET_DIR, compiler_version, target_name

    target = target_name(job.config.cluster.device_kind)
    proto = GPU_TARGET_DIR / f"{target}.textproto"
    # a custom_partitioning call names its Python callbacks by their address in this process (JAX's own cache
    # key drops it too): the same program lowered in another process differs there alone
    program = _PARTITIONING_CALLBACKS.sub(r"\1", lowered.as_text())
    parts = [program, repr([(d.id, d.process_index, d.device_kind, getattr(d, "coords", None))
                                      for d in job.mesh.devices.flat]),
             jax.__version__, importlib.metadata.version("jaxlib"), str(target),
             str(target and compiler_version(target)),
             os.environ.get("XLA_FLAGS", ""), proto.read_text() if proto.is_file() else ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


_PARTITIONING_CALLBACKS = re.compile(r'(@CustomSPMDPartitioning\(.*?backend_config = )"\d+"')


def _without_jax_cache():
    """Returns a context in which this thread's compiles skip JAX's persistent cache (its entry for a
    deviceless compile is written but cannot be read: a warning on every later compile of it)."""
    try:
        from jax._src.config import enable_compilation_cache  # a thread's own setting; not public API
    except ImportError:
        return contextlib.nullcontext()
    return enable_compilation_cache(False)


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
    return compile_lowered(job, lowered)


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
