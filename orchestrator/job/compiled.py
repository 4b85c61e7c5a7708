"""What a train step compiled without running says about itself: its memory per device (XLA's memory
analysis beside the state's own bytes) and its FLOPs per device (XLA's count, each loop body once per
iteration). `nestor explain` reports them; the planner ranks candidates with them."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
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
        """Returns the figures of `compiled`, a jax Compiled step."""
        cost = cost_dict(compiled)
        memory = compiled.memory_analysis()
        return cls(compiled.as_text(), None if cost is None else dict(cost),
                   {name: int(getattr(memory, name)) for name in MEMORY_ANALYSIS})

    @classmethod
    def read(cls, path: Path) -> CompiledFigures:
        """Returns the figures `write` kept in `path`; raises OSError where it cannot be read, ValueError
        where it holds no figures."""
        data = path.read_bytes()
        try:
            kept = json.loads(gzip.decompress(data))
        except Exception as error:  # noqa: BLE001 - gzip, zlib and json each raise their own
            raise ValueError(f"{path}: {error}") from None
        if not (isinstance(kept, dict) and isinstance(kept.get("text"), str) and isinstance(kept.get("memory"), dict)
                and set(kept["memory"]) == set(MEMORY_ANALYSIS) and isinstance(kept.get("cost"), (dict, type(None)))):
            raise ValueError(f"{path}: not a deviceless compile's figures")
        return cls(kept["text"], kept["cost"], kept["memory"], cached=True)

    def write(self, path: Path) -> None:
        """Keeps the figures in `path`, whole or not at all (a file of its own, then renamed: the plan's
        compile threads may write at once)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        written = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            written.write_bytes(gzip.compress(json.dumps({"text": self.text, "cost": self.cost,
                                                           "memory": self.memory}).encode()))
            written.replace(path)
        finally:
            written.unlink(missing_ok=True)

    def as_text(self) -> str:
        """Returns the compiled HLO's text, as `Compiled.as_text`."""
        return self.text

    def cost_analysis(self) -> dict[str, float] | None:
        """Returns XLA's cost analysis (None: the compiler has none without the device)."""
        return self.cost

    def memory_analysis(self) -> types.SimpleNamespace:
        """Returns XLA's memory analysis: its argument, output, alias and temp sizes in bytes."""
        return types.SimpleNamespace(**self.memory)


MEMORY_ANALYSIS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
FIGURES_DIR = "deviceless"  # under run.compile_cache, beside JAX's own entries
FIGURES_FORMAT = 1  # in the key: a change of what is kept leaves earlier entries unread


def from_cache(compiled) -> bool:
    """Returns whether `compiled` (a compiled step, or a deviceless one's figures) was read from the cache."""
    return isinstance(compiled, CompiledFigures) and compiled.cached


def compile_lowered(job: Job, lowered):
    """Returns `lowered`, a step of `job`, compiled; for a target's deviceless topology, `CompiledFigures`.
    Raises what XLA raises for a program it refuses.

    JAX's persistent cache cannot load a deviceless executable back (it needs a client of the target's
    devices): these compiles write no entry of JAX's, and their figures are kept in `run.compile_cache`
    instead, under the program, its devices, the target and what configures its compiler (`_figures_key`),
    and read back on the next compile of the same program (explain, plan and the launch's compile check run
    again). A file that holds no figures is compiled again and written over."""
    if not job.backend.deviceless:
        return lowered.compile()
    directory = job.config.run.compile_cache
    path = Path(directory) / FIGURES_DIR / f"{_figures_key(job, lowered)}.json.gz" if directory else None
    if path is not None:
        with contextlib.suppress(OSError, ValueError):  # none there, or none to read: compiled below
            return CompiledFigures.read(path)
    with _no_jax_cache_entry():
        figures = CompiledFigures.of(lowered.compile())
    if path is not None:
        with contextlib.suppress(OSError):  # a cache is an optimisation: never fail a compile for it
            figures.write(path)
    return figures


# The jax settings that configure XLA's compile (compiler.get_compile_options) without showing in the lowered
# program; those a jax version lacks are left out.
_COMPILE_SETTINGS = ("jax_compiler_enable_remat_pass", "jax_optimization_level", "jax_memory_fitting_level",
                     "jax_exec_time_optimization_effort", "jax_memory_fitting_effort",
                     "jax_disable_most_optimizations")
# XLA_FLAGS only XLA:CPU reads (configure_jax's devices and collective timeouts): explain and the launch's
# driver key the same program alike
_CPU_ONLY_FLAGS = re.compile(r"--xla_force_host_platform_device_count=\S+|--xla_cpu_\S+")
# a custom_partitioning call names its Python callbacks by their address in this process (JAX's own cache key
# drops it too): the same program lowered in another process differs there alone
_PARTITIONING_CALLBACKS = re.compile(r'(@CustomSPMDPartitioning\(.*?backend_config = )"\d+"')


def _figures_key(job: Job, lowered) -> str:
    """Returns the hash that names a deviceless compile's figures: the lowered program, the devices it is laid
    out on, the versions of jax and jaxlib, the target's compiler (backend.targets.compiler_identity), and the
    settings and flags its compiler reads."""
    from nestor.backend.targets import compiler_identity, installed_version

    settings = {name: getattr(jax.config, name) for name in _COMPILE_SETTINGS if hasattr(jax.config, name)}
    devices = [(d.id, d.process_index, d.device_kind, getattr(d, "coords", None)) for d in job.mesh.devices.flat]
    parts = [str(FIGURES_FORMAT), _PARTITIONING_CALLBACKS.sub(r"\1", lowered.as_text()), repr(devices),
             jax.__version__, str(installed_version("jaxlib")), compiler_identity(job.config.cluster.device_kind),
             repr(sorted(settings.items())), " ".join(_CPU_ONLY_FLAGS.sub("", os.environ.get("XLA_FLAGS", "")).split()),
             os.environ.get("LIBTPU_INIT_ARGS", "")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _no_jax_cache_entry():
    """Returns a context in which this thread's compiles write no entry to JAX's persistent cache (its entry
    for a deviceless compile is written but cannot be read: a warning on every later compile of it). JAX's
    cache itself stays on: a process decides that once, at its first compile."""
    from jax._src import config  # a thread's own setting; not public API

    return config.persistent_cache_min_compile_time_secs(math.inf)


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


def cost_dict(compiled) -> dict[str, float] | None:
    """Returns XLA's cost analysis of `compiled` as one dict (some jax versions give a list of one), or None
    where the compiler has none."""
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, (list, tuple)) else cost


def cost_flops(compiled) -> float:
    """Returns XLA's FLOP count for one run of `compiled` (per device, as XLA reports it).

    XLA counts a loop body once, whatever its trip count: `step_flops` counts
    it once per iteration.
    """
    return float(cost_dict(compiled).get("flops", math.nan))


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
