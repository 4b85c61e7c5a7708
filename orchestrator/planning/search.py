"""The search of a plan: each layout's rungs, least recompute and accumulation first, are judged in turn
(the config's rules, an analytic bound on the state's bytes, then the step compiled without running against
the device's memory less a headroom) until one fits and is costed. Its later rungs with less recompute (more
accumulation or a sharded update) may fit and be faster: they are judged at once where the layout holds the
fastest fit so far, else once every layout has had its first fit, and the fastest rung that fits stands for
its layout. Compiling stops at the time budget, and what it did not judge is left undecided."""

from __future__ import annotations

import dataclasses
import json
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from collections.abc import Callable
from typing import Any

from nestor.backend import ACCELERATORS, platform_family
from nestor.cluster.cpu_devices import usable_cores
from nestor.orchestrator.config.degrees import named_schedule
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import build_job, compile_target, devices_here, select_devices
from nestor.orchestrator.job.compiled import (compile_lowered, counting_lowered, from_cache, lower_step,
                                              memory_per_device, state_bytes, target_flops)
from nestor.orchestrator.job.step import pipeline_schedule
from nestor.orchestrator.loader.memory_fit import GIB, device_memory
from nestor.orchestrator.planning.candidates import REMAT, Candidate, candidates, rule_problem
from nestor.orchestrator.planning.cost import predicted_step
from nestor.orchestrator.planning.devices import Device, device_for
from nestor.parallel.hlo import collective_ops

HEADROOM = 0.10  # of the device's memory, kept free: XLA's estimate is not the allocator's peak

# verdicts
RANKED, RULES, BOUND, COMPILED_OVER, COMPILE_ERROR, DOMINATED, UNDECIDED = (
    "ranked", "rules", "memory by bound", "memory by compile", "compile error", "dominated", "undecided")


def compile_workers() -> int:
    """Returns how many compiles a plan runs at once by default: the cores this process may use, at most 8."""
    return max(1, min(usable_cores(), 8))


@dataclasses.dataclass
class Judged:
    """A candidate and what the search made of it: its verdict, why (rejections), its memory per device in
    bytes (`state`, `temporaries`, `peak`) and predicted step (cost.predicted_step, with `bubble`)."""

    candidate: Candidate
    verdict: str
    reason: str | None = None
    memory: dict[str, int] | None = None
    predicted: dict[str, Any] | None = None


@dataclasses.dataclass
class Plan:
    """The outcome of a search: every candidate judged, the ranked ones fastest first, and what was searched
    with (device, memory limit, compiler, time)."""

    judged: list[Judged]
    device: Device
    device_memory_bytes: int | None
    usable_bytes: int | None
    compiler: str
    compiles: int  # candidates this search compiled, their figures read from run.compile_cache included
    elapsed_s: float
    budget_s: float
    cached: int = 0  # of `compiles`, deviceless ones whose figures were read from run.compile_cache

    @property
    def ranked(self) -> list[Judged]:
        return sorted((j for j in self.judged if j.verdict == RANKED), key=lambda j: j.predicted["step_s"])

    def count(self, verdict: str) -> int:
        return sum(j.verdict == verdict for j in self.judged)


def compile_order(ladders: list[list[Candidate]]) -> list[list[Candidate]]:
    """Returns the layouts' `ladders` in the order they are compiled: each stage count (1, 2, 4, ...) takes
    its turn, so that a budget that runs out has reached pipelines of every depth; within a stage count,
    by `_compile_order`."""
    by_stages: dict[int, list] = {}
    for ladder in sorted(ladders, key=_compile_order):
        layout = dict(ladder[0].layout)
        by_stages.setdefault(layout["mesh.pipeline"] * layout["mesh.dcn.pipeline"], []).append(ladder)
    turns = [by_stages[stages] for stages in sorted(by_stages)]
    return [turn[index] for index in range(max(map(len, turns), default=0)) for turn in turns if index < len(turn)]


def _compile_order(ladder: list[Candidate]) -> tuple:
    """Returns the key that orders layouts of one stage count for compiling: the smallest bubble first, then
    the fewest devices on axes that communicate every layer (tensor, context)."""
    layout = dict(ladder[0].layout)
    degree = {axis: layout[f"mesh.{axis}"] * layout[f"mesh.dcn.{axis}"] for axis in ("pipeline", "tensor", "context")}
    bubble = 0.0
    if degree["pipeline"] > 1:
        bubble = named_schedule(layout["pipeline.schedule"], degree["pipeline"], layout["pipeline.microbatches"],
                                layout["pipeline.repeats"]).bubble_fraction
    return round(bubble, 4), degree["tensor"] * degree["context"]


# compiled candidates' figures, by the candidate's whole config, its devices and the device costed: a second
# search in this process (another memory limit, another --top) compiles nothing it has compiled
_COMPILED: dict[tuple, dict[str, Any]] = {}


def _lowered(job) -> tuple[Any, Any] | dict[str, str]:
    """Returns `job`'s train step lowered and its FLOP-counting step lowered (compiled.counting_lowered: a
    dropless MoE step's second program, else None), traced in this thread; or `error`, why tracing refused
    the candidate, in a line."""
    try:
        return lower_step(job), counting_lowered(job)
    except Exception as error:  # noqa: BLE001 - the candidate is dropped, the plan goes on
        return {"error": error_line(error)}


def _compiled_figures(job, lowered, counting, devices: list, device: Device) -> dict[str, Any]:
    """Returns what compiling `job`'s `lowered` step (and `counting`, where there is one) says: `temporaries`
    and `peak` bytes per device and the `predicted` step (cost.predicted_step, with the FLOPs per device and
    the pipeline's bubble); or `error`, the compiler's refusal in a line. Runs in a compile worker's thread:
    XLA compiles without Python's lock."""
    try:
        compiled = compile_lowered(job, lowered)
        counted = compile_lowered(job, counting) if counting is not None else compiled
        per_device = target_flops(job, compiled, counted)["per_device"]
        memory = memory_per_device(job, compiled)
        position = {d.id: index for index, d in enumerate(devices)}
        per_host = job.config.cluster.devices_per_host
        host_of = [position[d.id] // per_host for d in job.mesh.devices.flat]
        predicted = predicted_step(per_device, collective_ops(compiled.as_text()), host_of, device)
    except Exception as error:  # noqa: BLE001 - XLA's refusals are many; the candidate is dropped, the plan goes on
        return {"error": error_line(error)}
    schedule = pipeline_schedule(job.config, job.mesh)
    predicted |= {"flops_per_device": per_device, "bubble": schedule.bubble_fraction if schedule else 0.0}
    return {"temporaries": memory["temporaries"], "peak": memory["peak_estimate"], "predicted": predicted,
            "cached": from_cache(compiled)}


def _built(config, devices: list) -> tuple[Any, tuple[str, str] | None]:
    """Returns (`config`'s job on `devices`, nothing compiled, None), or (None, (verdict, reason)) where
    building it fails: a ConfigError's first problem by the rules, any other error in a line as a compile
    error (a model of the user's that does not build on this layout)."""
    try:
        return build_job(config, devices=devices, with_data=False), None
    except ConfigError as error:
        return None, (RULES, "{}: {}".format(*error.problems[0]))
    except Exception as error:  # noqa: BLE001 - the candidate is dropped, the plan goes on
        return None, (COMPILE_ERROR, error_line(error))


def error_line(error: Exception) -> str:
    """Returns why a candidate failed, in a line: the error's type and first line (a ConfigError's first
    problem, not its heading)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:  # a ConfigError's heading: its first problem is the line
        text = lines[1]
    return f"{type(error).__name__}: {text[:160]}"


def _capacity_bytes(config, valid: list[list[Candidate]], devices: list) -> float | None:
    """Returns a device's memory in bytes (memory_fit.device_memory) as the first layout whose first rung
    builds finds it; None where none builds or the memory is not known (those rungs are judged, and
    rejected, with the rest)."""
    for ladder in valid:
        probe, _ = _built(config.replace(**ladder[0].as_dict()), devices)
        if probe is not None:
            _, capacity_gib = device_memory(config, probe.backend, devices_here(probe.mesh))
            return None if capacity_gib is None else capacity_gib * GIB
    return None


@dataclasses.dataclass
class _ToCompile:
    """A candidate that passed the rules and the state bound, its steps lowered: what its compile needs."""

    candidate: Candidate
    job: Any
    state: int
    key: tuple
    lowered: Any
    counting: Any


def _prepare(config, candidate: Candidate, devices: list, usable: int | None, device: Device) -> Judged | _ToCompile:
    """Judges `candidate` up to its compile: rejected by rules, by the state bound or by a tracing error, or
    judged from a compile this process made before; else its steps lowered, for `_compiled_figures`."""
    candidate_config, problem = rule_problem(config, candidate.as_dict())
    if problem:
        return Judged(candidate, RULES, problem)
    job, refused = _built(candidate_config, devices)
    if refused:
        return Judged(candidate, *refused)
    state = sum(state_bytes(job).values())
    if usable is not None and state > usable:
        return Judged(candidate, BOUND, f"parameters + optimizer {state / GIB:.2f} GiB per device",
                      {"state": state})
    key = (json.dumps(candidate_config.to_dict(), sort_keys=True, default=str), tuple(d.id for d in devices), device)
    if key not in _COMPILED:
        lowered = _lowered(job)
        if not isinstance(lowered, dict):
            return _ToCompile(candidate, job, state, key, *lowered)
        _COMPILED[key] = lowered
    return _verdict(candidate, state, _COMPILED[key], usable)


def _verdict(candidate: Candidate, state: int, figures: dict[str, Any], usable: int | None) -> Judged:
    """Returns the verdict on a compiled candidate (`_compiled_figures`): a compile error, its compiled peak
    over the usable memory, or ranked with its memory and predicted step."""
    if "error" in figures:
        return Judged(candidate, COMPILE_ERROR, figures["error"])
    judged_memory = {"state": state, "temporaries": figures["temporaries"], "peak": figures["peak"]}
    if usable is not None and figures["peak"] > usable:
        return Judged(candidate, COMPILED_OVER, f"compiled peak {figures['peak'] / GIB:.2f} GiB per device",
                      judged_memory)
    return Judged(candidate, RANKED, None, judged_memory, figures["predicted"])


def search(config, pins: set[str], budget_s: float, progress: Callable[[str], None] | None = None,
           memory_limit_gib: float | None = None, workers: int = 1, device: Device | None = None) -> Plan:
    """Returns the plan for `config` keeping the `pins` (dotted keys), compiling for at most `budget_s`
    seconds, up to `workers` compiles at once; `progress` is told each candidate as it is judged. The memory
    limit is the device's (`memory_fit.device_memory`, or `memory_limit_gib`) less HEADROOM; the times are for
    `device` (default: `device_for` the config's kind, as calibrated).

    Tracing and lowering run in this thread, one candidate at a time; the compiles in `workers` threads. With
    one worker the candidates are judged in the compile order; with more, several layouts' rungs are compiled
    at once, and a layout's next rung waits for its previous rung's verdict."""
    start = time.monotonic()
    target = compile_target(config)
    devices = target.devices if target.devices is not None else select_devices(config)
    device = device or device_for(config.cluster.device_kind, config.model.dtype)
    ladders = candidates(config, pins, accelerator=platform_family(devices[0].platform) in ACCELERATORS)
    judged: list[Judged] = []
    valid = []
    # a layout its rules refuse at its first rung refuses every rung: remat and the sharded update change no
    # split, and accumulation only makes the micro-batches it splits smaller
    for ladder in ladders:
        _, problem = rule_problem(config, ladder[0].as_dict())
        if problem:
            judged += [Judged(candidate, RULES, problem) for candidate in ladder]
        else:
            valid.append(ladder)
    valid = compile_order(valid)
    capacity = memory_limit_gib * GIB if memory_limit_gib is not None else _capacity_bytes(config, valid, devices)
    usable = None if capacity is None else int(capacity * (1 - HEADROOM))
    # (ladder, the rung to judge, the recompute its later rungs must be under to be judged: that of the
    # lightest rung that fits so far)
    queue = deque((ladder, 0, len(REMAT)) for ladder in valid)
    compiled_before = len(_COMPILED)
    reached: set[tuple] = set()  # the layouts judged so far

    def lighter(ladder, rung: int, bound: int) -> list[Candidate]:
        return [candidate for candidate in ladder[rung + 1:] if _recompute(candidate) < bound]

    def judge(verdict: Judged, ladder, rung: int, bound: int) -> None:
        """Records `verdict` on `ladder[rung]` and queues the layout's next rung to judge, if any."""
        judged.append(verdict)
        rest = lighter(ladder, rung, bound)
        if verdict.verdict == RANKED:
            bound = _recompute(ladder[rung])
            judged.extend(Judged(candidate, DOMINATED, "a rung of its layout with no more recompute fits")
                          for candidate in rest if _recompute(candidate) >= bound)
            if next_rungs := lighter(ladder, rung, bound):
                # the layout with the fastest fit so far is refined at once, any other after every layout's first
                # fit (a lighter rung that fits may be slower than the layout's earlier fit)
                layout = ladder[rung].layout
                fits = [j for j in judged if j.verdict == RANKED]
                best = min(j.predicted["step_s"] for j in fits if j.candidate.layout == layout)
                leads = all(best < j.predicted["step_s"] for j in fits if j.candidate.layout != layout)
                (queue.appendleft if leads else queue.append)((ladder, next_rungs[0].rung, bound))
        elif rest:
            queue.appendleft((ladder, rest[0].rung, bound))

    compiling: dict[Future, tuple] = {}
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="plan-compile") as pool:
        while queue or compiling:
            while queue and len(compiling) < max(1, workers):
                ladder, rung, bound = queue.popleft()
                if time.monotonic() - start > budget_s:
                    judged.extend(Judged(candidate, UNDECIDED, "the time budget ran out")
                                  for candidate in [ladder[rung], *lighter(ladder, rung, bound)])
                    continue
                reached.add(ladder[rung].layout)
                if progress:
                    progress(f"[{len(reached)}/{len(valid)} layouts, {time.monotonic() - start:.0f}/{budget_s:.0f} s]"
                             f" {label(ladder[rung])}")
                prepared = _prepare(config, ladder[rung], devices, usable, device)
                if isinstance(prepared, Judged):
                    judge(prepared, ladder, rung, bound)
                else:
                    work = pool.submit(_compiled_figures, prepared.job, prepared.lowered, prepared.counting, devices,
                                       device)
                    compiling[work] = (prepared, ladder, rung, bound)
            if compiling:
                done, _ = wait(compiling, return_when=FIRST_COMPLETED)
                for work in done:
                    prepared, ladder, rung, bound = compiling.pop(work)
                    _COMPILED[prepared.key] = work.result()
                    judge(_verdict(prepared.candidate, prepared.state, _COMPILED[prepared.key], usable), ladder, rung,
                          bound)
    compiled_now = list(_COMPILED.values())[compiled_before:]
    return Plan(_fastest_per_layout(judged), device, None if capacity is None else int(capacity), usable,
                target.compiler, len(compiled_now), time.monotonic() - start, budget_s,
                sum(bool(figures.get("cached")) for figures in compiled_now))


def _recompute(candidate: Candidate) -> int:
    """Returns how much a candidate's remat recomputes, as its place in REMAT (a config's own named policy,
    the only one its ladder has: 0)."""
    remat = candidate.as_dict()["model.remat"]
    return REMAT.index(remat) if remat in REMAT else 0


def _fastest_per_layout(judged: list[Judged]) -> list[Judged]:
    """Returns `judged` with one ranked rung per layout, its fastest predicted step; the others dominated."""
    fastest: dict[tuple, Judged] = {}
    for j in judged:
        if j.verdict == RANKED and (j.candidate.layout not in fastest
                                    or j.predicted["step_s"] < fastest[j.candidate.layout].predicted["step_s"]):
            fastest[j.candidate.layout] = j
    return [j if j.verdict != RANKED or fastest[j.candidate.layout] is j
            else dataclasses.replace(j, verdict=DOMINATED, reason="a faster rung of its layout fits") for j in judged]


AXIS_LETTERS = {"pipeline": "pp", "data": "dp", "fsdp": "fsdp", "context": "cp", "expert": "ep", "tensor": "tp"}


def label(candidate: Candidate) -> str:
    """Returns a candidate's settings in one short line, e.g. `pp2 cp2 tp2 (across hosts pp2), interleaved_1f1b r2
    m4, ring attention, remat full, accum 2`."""
    s = candidate.as_dict()
    mesh = " ".join(f"{letter}{s[f'mesh.{axis}'] * s[f'mesh.dcn.{axis}']}" for axis, letter in AXIS_LETTERS.items()
                    if s[f"mesh.{axis}"] * s[f"mesh.dcn.{axis}"] > 1) or "1 device"
    dcn = " ".join(f"{letter}{s[f'mesh.dcn.{axis}']}" for axis, letter in AXIS_LETTERS.items() if s[f"mesh.dcn.{axis}"] > 1)
    parts = [mesh + (f" (across hosts {dcn})" if dcn else "")]
    if "pipeline.schedule" in s:
        groups = f" r{s['pipeline.repeats']}" if s["pipeline.repeats"] > 1 else ""
        parts.append(f"{s['pipeline.schedule']}{groups} m{s['pipeline.microbatches']}")
    if "model.context_attention" in s:
        parts.append(f"{s['model.context_attention']} attention")
    if "moe.exchange" in s:
        parts.append(f"{s['moe.exchange']} exchange")
    parts.append(f"remat {s['model.remat']}")
    if s["optimizer.shard_update"]:
        parts.append("shard_update")
    if s["train.grad_accum"] > 1:
        parts.append(f"accum {s['train.grad_accum']}")
    return ", ".join(parts)
