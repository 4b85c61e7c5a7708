"""`nestor explain`: compile the train step once, without running it, and report
layout, memory, communication and FLOPs, all read from XLA's own analyses and
the compiled HLO."""

from __future__ import annotations

import math
from typing import Any

import jax

from nestor.backend.targets import TargetDevices
from nestor.orchestrator.loader.config import speed_key_sources
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.hf.load import checked_reader
from nestor.orchestrator.job.context_wiring import context_report
from nestor.orchestrator.job.build import Job, build_job, compile_target, traced_use, unsplit_rows_warning
from nestor.orchestrator.job.compiled import (MEMORY_PARTS, compile_step, from_cache, memory_per_device, step_fit,
                                              target_flops, timed_compile)
from nestor.orchestrator.loader.memory_fit import GIB
from nestor.orchestrator.loop.metrics import spec_text
from nestor.orchestrator.job.moe_wiring import dropless_report
from nestor.orchestrator.specs.registry import spec_of
from nestor.orchestrator.job.state import bytes_text, layout_warnings, param_table
from nestor.orchestrator.job.step import pipeline_schedule
from nestor.parallel.hlo import collectives


# the backend report's entries that apply only where the model calls an op (models.ops)
OP_ENTRIES = {"attention": ("attention",), "einsum": ("matmuls",), "swiglu": ("swiglu",),
              "grouped_matmul": ("grouped_matmul", "exchange")}


def backend_report(job: Job, called: set[str]) -> dict[str, Any]:
    """Returns the backend's report with the choices that do not apply to the model as None: the ops it
    never `called` (`traced_use`; an expert exchange where no grouped matmul runs), the pipeline loop
    without a pipeline."""
    report = job.backend.report()
    for op, entries in OP_ENTRIES.items():
        if op not in called:
            report.update(dict.fromkeys(entries))
    if job.mesh.shape["pipeline"] == 1:
        report["pipeline_loop"] = None
    return report


def pipeline_report(job: Job, temporaries: int) -> dict[str, Any] | None:
    """Returns the pipeline schedule of `job` (name, ticks, microbatches, stages, repeats, bubble_fraction,
    micro-batches in flight per stage) with the compiled step's `temporaries` (bytes per device), or None
    when the mesh has a single stage (`mesh.pipeline=1`)."""
    schedule = pipeline_schedule(job.config, job.mesh)
    if schedule is None:
        return None
    return {"schedule": schedule.name, "ticks": schedule.iterations, "microbatches": schedule.microbatches,
            "stages": schedule.stages, "repeats": schedule.repeats, "bubble_fraction": schedule.bubble_fraction,
            "in_flight": schedule.in_flight(), "temporaries": temporaries}


def lora_report(config: Config, job: Job, memory: dict[str, int]) -> dict[str, Any] | None:
    """Returns a LoRA run's trainable and frozen parameter counts and its memory per device beside full
    fine-tuning's of the same config (`lora.rank=0`, compiled on the same devices), or None without LoRA."""
    if job.layout.trained is None:
        return None
    trained = sum(leaf.size for leaf in jax.tree.leaves(job.layout.trained_part(job.layout.abstract["params"])))
    total = sum(leaf.size for leaf in jax.tree.leaves(job.layout.abstract["params"]))
    full_job = build_job(config.replace(**{"lora.rank": 0, "lora.init_from": None}),
                         devices=list(job.mesh.devices.flat), with_data=False)
    full = memory_per_device(full_job, compile_step(full_job))
    return {"trainable_params": trained, "frozen_params": total - trained,
            "full_fine_tuning_per_device_bytes": {part: full[part] for part in MEMORY_PARTS},
            "saved_per_device_bytes": {part: full[part] - memory[part] for part in MEMORY_PARTS}}


def compiler_name(job: Job, target: TargetDevices) -> str:
    """Returns the report's name of the compiler of `job`'s step: the target's (`compile_target`) where the
    job was built on its devices, else the XLA of the job's own devices."""
    if job.backend.deviceless == (target.devices is not None):
        return target.compiler
    name = f"XLA:{job.backend.platform.upper()}"
    if job.backend.platform == "cpu" and job.backend.target != "cpu":
        return f"{name} standing in for {target.target} (the job's devices)"
    return f"{name} (the job's devices)"


def explain(config: Config, job: Job | None = None) -> dict[str, Any]:
    """Returns the report `nestor explain --json` prints; the train step is compiled once, for the target's
    devices by its own compiler where it is installed (`compile_target`), else on the devices here. Raises
    ConfigError where `model.init_from`'s tensors are damaged or do not fit its config.json, as training would."""
    if config.model.init_from:
        checked_reader(config)[0].close()
    target = compile_target(config)
    job = job or build_job(config, devices=target.devices, with_data=False)
    compiled, compile_s = timed_compile(job)
    params = param_table(job.layout)
    memory = memory_per_device(job, compiled)
    devices = job.mesh.devices.size
    flops = target_flops(job, compiled)
    analytic = spec_of(config).flops_per_step(config)
    called, named = traced_use(job)
    compiler = compiler_name(job, target)
    return {
        "mesh": {"shape": dict(job.mesh.shape), "devices": devices, "platform": job.backend.platform},
        "compiler": compiler,
        "backend": backend_report(job, called),
        "speed_settings": [{"key": key, "value": value, "from": where} for key, value, where in speed_key_sources(config)],
        "remat": job.backend.remat,
        "params": params,
        "param_count": sum(math.prod(row["shape"]) for row in params),
        "memory_per_device_bytes": memory,
        "lora": lora_report(config, job, memory),
        "fit": step_fit(job, memory) | {"compiler": compiler},
        "compile_s": compile_s,
        "compile_cached": from_cache(compiled),  # a deviceless compile's figures, from run.compile_cache
        "collectives": collectives(compiled.as_text()),
        "pipeline": pipeline_report(job, memory["temporaries"]),
        "dropless_moe": dropless_report(config, job.backend, job.mesh, job.rules),
        "context": context_report(config, job.backend, job.mesh, job.rules),
        "flops_per_step": flops["per_device"] * devices,
        "flops_counted_by": flops["counted_by"],
        "flops_left_out_in": flops["left_out_in"],
        "grouped_matmuls_counted_as_target_runs_them": flops["regrouped"],
        "flops_per_step_per_device": flops["per_device"],
        "float32_widening_flops_left_out": flops["widened"] * devices,
        "update_flops_per_step": flops["phases"]["update"] * devices,
        # the model's analytic counts, where its spec has them (XLA's count alone otherwise)
        "model_flops_per_step": analytic[0] if analytic else None,
        "executed_flops_per_step": analytic[1] if analytic else None,
        "warnings": layout_warnings(job.layout, job.rules) + [warning for warning in (unsplit_rows_warning(job, named),)
                                                             if warning],
    }


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Returns `rows` (the first is the header) as lines whose columns are as wide as their widest cell."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def fit_line(fit: dict[str, Any]) -> str:
    """Returns the line that answers "will it fit?" for explain's `fit` entry, and a `note:` line under it
    when the figures carry a caveat."""
    parts = (f"parameters + optimizer {bytes_text(fit['state_bytes'])}, temporaries "
             f"{bytes_text(fit['temporaries_bytes'])}, total {bytes_text(fit['total_bytes'])}")
    if fit["device_memory_bytes"] is None:
        line = f"per device: {parts}; {fit['verdict']}"
    else:
        memory = fit["device_memory_bytes"] / GIB
        device = {None: "cluster.device_memory_gb", "cpu": "cpu: the host's RAM over its devices"}.get(
            fit["device_kind"], fit["device_kind"])
        line = f"per device: {parts} of {memory:.{0 if memory >= 10 else 1}f} GiB ({device}): {fit['verdict']}"
    line += f"\n  (memory analysis of {fit['compiler']})" if fit.get("compiler") else ""
    return line + (f"\nnote: {fit['caveat']}" if fit.get("caveat") else "")


def backend_lines(backend: dict[str, Any]) -> list[str]:
    """Returns the report's lines on the backend: the target and what it runs (the choices that apply to the
    model), then what this compile substitutes where its devices are not the target's."""
    target = backend["target"] + (f" ({backend['device_kind']})" if backend["device_kind"] else "")
    choices = [("attention", "attention"), ("matmuls", "matmuls"), ("grouped matmuls", "grouped_matmul"),
               ("expert exchange", "exchange"), ("pipeline loop:", "pipeline_loop")]
    lines = [f"backend for {target}: remat {backend['remat']}" + "".join(
        f"; {name} {backend[entry]}" for name, entry in choices if backend[entry] is not None)]
    return lines + [f"  compiled here: {note}" for note in backend["substitutions"]]


def _yaml_value(value: Any) -> str:
    """Returns a setting's value as a YAML override writes it (false, not False)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_report(report: dict[str, Any]) -> str:
    """Returns the human-readable form of an explain report."""
    mesh = report["mesh"]
    lines = [f"mesh: {' x '.join(f'{k}{v}' for k, v in mesh['shape'].items())} "
             f"({mesh['devices']} {mesh['platform']} devices)", f"compiled by {report['compiler']}", "",
             *backend_lines(report["backend"]),
             "settings chosen for speed: " + "; ".join(
                 f"{s['key']}={_yaml_value(s['value'])} ({s['from']})" for s in report["speed_settings"]), "",
             f"parameters: {report['param_count']:,}"]
    lines += _aligned([("name", "shape", "logical axes", "spec", "per device")] + [
        (row["name"], str(tuple(row["shape"])), str(tuple(row["logical_axes"])), spec_text(row["spec"]),
         bytes_text(row["bytes_per_device"])) for row in report["params"]])
    lines += ["", f"memory per device (XLA memory analysis, remat {report['remat']}):"]
    lines += [f"  {k:<14} {bytes_text(v)}" for k, v in report["memory_per_device_bytes"].items()]
    if (lora := report["lora"]) is not None:
        trainable, frozen = lora["trainable_params"], lora["frozen_params"]
        full, saved = lora["full_fine_tuning_per_device_bytes"], lora["saved_per_device_bytes"]
        lines += ["", f"LoRA: {trainable:,} trainable parameters ({trainable / (trainable + frozen):.3%}), "
                      f"{frozen:,} frozen; per device against full fine-tuning of this config (compiled too):"]
        lines += [f"  {part:<14} {bytes_text(full[part] - saved[part])} vs {bytes_text(full[part])}: "
                  f"{bytes_text(abs(saved[part]))} {'saved' if saved[part] >= 0 else 'more'}" for part in MEMORY_PARTS]
    lines += ["", fit_line(report["fit"])]
    lines += ["", "collectives per step (compiled HLO):"]
    lines += [f"  {k:<19} {v['count']:>5} x  {bytes_text(v['bytes'])}" for k, v in report["collectives"].items()]
    if (p := report["pipeline"]) is not None:
        lines += ["", f"pipeline: {p['schedule']}, {p['stages']} stages x {p['repeats']} repeats, "
                      f"{p['microbatches']} micro-batches, {p['ticks']} ticks, bubble {p['bubble_fraction']:.1%}, "
                      f"micro-batches in flight per stage {'/'.join(map(str, p['in_flight']))}, "
                      f"temporaries {bytes_text(p['temporaries'])}"]
    if (d := report["dropless_moe"]) is not None:
        lines += ["", f"dropless MoE: exchange {d['exchange']}, grouped matmuls {d['grouped_matmul']}, "
                      f"worst-case buffer {d['buffer_rows']:,} rows, "
                      f"{bytes_text(d['buffer_bytes_per_device'])} per device per layer"]
    if (c := report["context"]) is not None:
        pairs = c["pairs_per_device"]
        lines += ["", f"context: rows split over {c['devices']} devices ({c['layout']}, "
                      f"{c['positions_per_device']:,} positions each), attention {c['attention']}: "
                      f"{bytes_text(c['exchange_bytes_per_layer'])} of keys and values received per device per "
                      f"layer (forward), (query, key) chunk pairs per device {min(pairs)}-{max(pairs)}"]
    counted_note = ", grouped matmuls as the target's kernels run them" if report[
        "grouped_matmuls_counted_as_target_runs_them"] else ""
    if report["float32_widening_flops_left_out"]:
        counted_note += (f", less {report['float32_widening_flops_left_out']:.4g} in this compile's converts to and "
                         "from float32 that the target does not run")
    analytic = (f"model FLOPs {report['model_flops_per_step']:.4g} (analytic)"
                if report["model_flops_per_step"] is not None else None)
    if report["flops_counted_by"] != "XLA cost analysis":  # a deviceless XLA:GPU compile has none
        counted_note += f"; counted from the HLO: {report['compiler']} has no cost analysis without the device"
    if report["flops_left_out_in"]:
        counted_note += f", {', '.join(report['flops_left_out_in'])} not counted"
    counted = (f"{report['flops_per_step']:.4g} ({report['flops_counted_by']}, loop bodies x trip count, all devices"
               f"{counted_note}), of which {report['update_flops_per_step']:.4g} update the state (optimizer, "
               "norms)")
    lines += ["", f"FLOPs per step: {counted}" + (f"; {analytic}" if analytic else ""),
              f"compiled in {report['compile_s']:.1f} s"
              + (" (its figures read from run.compile_cache)" if report.get("compile_cached") else "")]
    return "\n".join(lines + report["warnings"])
