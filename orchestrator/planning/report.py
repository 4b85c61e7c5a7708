"""A plan as the user reads it: the ranked table of the top candidates, the rejections counted by reason,
what was left undecided, the measured candidates beside their predictions (--measure); and the winner as a
YAML overlay `nestor train CONFIG PLAN.yaml` runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from nestor.orchestrator.loader.memory_fit import GIB
from nestor.orchestrator.loop.peak_flops import peak_tflops
from nestor.orchestrator.planning.measure import SKIPPED_STEPS, Measured
from nestor.orchestrator.planning.search import (BOUND, COMPILE_ERROR, COMPILED_OVER, DOMINATED, HEADROOM, RULES,
                                                 UNDECIDED, Judged, Plan, label)
from nestor.orchestrator.specs.registry import spec_of

REJECTIONS = (RULES, BOUND, COMPILED_OVER, COMPILE_ERROR)


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.3g}"


def row(config, judged: Judged) -> dict[str, Any]:
    """Returns one ranked candidate's figures: predicted step seconds, tokens (or rows) per second, MFU
    (the model's FLOPs over the device's dense peak; None without a peak), memory per device, bubble."""
    p, step = judged.predicted, judged.predicted["step_s"]
    rows = _per_step(config)
    analytic = spec_of(config).flops_per_step(config)
    peak = peak_tflops(config.cluster.device_kind, config.model.dtype) if config.cluster.device_kind else None
    devices = config.cluster.hosts * config.cluster.devices_per_host
    model_flops = analytic[0] if analytic else p["flops_per_device"] * devices
    return {"settings": label(judged.candidate), "step_s": step, "compute_s": p["compute_s"],
            "communication_s": p["within_host_s"] + p["across_hosts_s"], "per_s": rows / step,
            "mfu": model_flops / (step * devices * peak * 1e12) if peak else None, "bubble": p["bubble"],
            **{f"{part}_bytes": judged.memory[part] for part in ("state", "temporaries", "peak")}}


def _per_step(config) -> int:
    """Returns the tokens (or rows, for a model that counts no tokens) of one global batch."""
    return config.train.global_batch * (config.train.seq_len if spec_of(config).counts_tokens else 1)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[column]) for r in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.rjust(width) if index else cell.ljust(width) for index, (cell, width)
                      in enumerate(zip(r, widths))).rstrip() for r in rows]


def format_plan(config, plan: Plan, top: int) -> str:
    """Returns the printed plan: where it was searched, the top `top` candidates, rejections by reason."""
    unit = "tokens/s" if spec_of(config).counts_tokens else "rows/s"
    limit = ("no device memory known (cluster.device_kind or cluster.device_memory_gb): nothing rejected for memory"
             if plan.usable_bytes is None else
             f"{_gib(plan.usable_bytes)} GiB usable per device ({_gib(plan.device_memory_bytes)} GiB less "
             f"{HEADROOM:.0%} headroom)")
    lines = [f"plan for {config.cluster.hosts} x {config.cluster.devices_per_host} {plan.device.kind} devices, "
             f"global batch {config.train.global_batch}; compiled by {plan.compiler}",
             f"memory: {limit}", f"time: {plan.device.note}", ""]
    ranked = [row(config, judged) for judged in plan.ranked[:top]]
    if ranked:
        header = ("#", "settings", "step ms", "compute ms", "comm ms", unit, "MFU", "bubble",
                  "params+opt GiB", "temp GiB", "peak GiB")
        lines += _aligned([header] + [(str(index), r["settings"], f"{r['step_s'] * 1e3:.1f}",
                                       f"{r['compute_s'] * 1e3:.1f}", f"{r['communication_s'] * 1e3:.1f}",
                                       f"{r['per_s']:,.0f}", "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}",
                                       f"{r['bubble']:.1%}", _gib(r["state_bytes"]), _gib(r["temporaries_bytes"]),
                                       _gib(r["peak_bytes"]))
                                      for index, r in enumerate(ranked, 1)])
    else:
        lines.append("no candidate fits: see the rejections below")
    lines += ["", f"{len(plan.judged)} candidates: {len(plan.ranked)} ranked (one per layout, its fastest rung "
                  f"that fits), {plan.count(DOMINATED)} other rungs of those layouts passed over (slower, or with no "
                  f"less recompute than one that fits), {plan.compiles} compiles in {plan.elapsed_s:.0f} s"
                  + (f" ({plan.cached} read from run.compile_cache)" if plan.cached else "")]
    for verdict in REJECTIONS:
        by_key: dict[str, list[str]] = {}
        for judged in plan.judged:
            if judged.verdict == verdict:
                by_key.setdefault(_reason_key(verdict, judged.reason), []).append(judged.reason or "")
        if by_key:
            lines.append(f"rejected, {verdict}: {sum(map(len, by_key.values()))}")
            lines += [f"  {len(reasons):>5}  {key}, e.g. {_shortened(reasons[0].removeprefix(key + ': '))}"
                      for key, reasons in sorted(by_key.items(), key=lambda item: -len(item[1]))]
    if undecided := plan.count(UNDECIDED):
        lines.append(f"undecided: {undecided} candidates not judged when the {plan.budget_s:.0f} s budget ran out "
                     "(raise --budget-s)")
    return "\n".join(lines)


def _reason_key(verdict: str, reason: str | None) -> str:
    """Returns what rejections are counted by: the key a rule names, else the verdict itself."""
    return (reason or "").split(":", 1)[0] if verdict == RULES else verdict


def _shortened(reason: str, width: int = 110) -> str:
    line = reason.split("\n")[0]
    return line if len(line) <= width else line[:width - 3] + "..."


def overlay(winner: Judged, config, pins: set[str]) -> dict:
    """Returns the `winner`'s settings and the pinned keys as a nested YAML mapping (an overlay of CONFIG)."""
    settings = winner.candidate.as_dict()
    plain = config.to_dict()
    for key in pins:
        value = plain
        for part in key.split("."):
            value = value[part] if isinstance(value, dict) and part in value else None
        settings.setdefault(key, value)
    tree: dict = {}
    for key, value in sorted(settings.items()):
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return tree


def write_overlay(path: Path, winner: Judged, config, pins: set[str], command: str,
                  measured_s: float | None = None) -> None:
    """Writes the `winner` (`overlay`) to `path`, headed by the command that planned it, its prediction and,
    where it ran (--measure), its measured step."""
    best = row(config, winner)
    measured = "" if measured_s is None else f", measured {measured_s * 1e3:.1f} ms"
    head = (f"# nestor plan: {command}\n# predicted {best['step_s'] * 1e3:.1f} ms per step{measured} "
            f"({best['settings']}); train with: nestor train CONFIG {path.name}\n")
    path.write_text(head + yaml.safe_dump(overlay(winner, config, pins), sort_keys=False))


def format_measured(config, measured: list[Measured], steps: int) -> str:
    """Returns the measured candidates as a table, fastest measured first, the predicted step beside the
    measured one (the median of steps past the first; `steps` each), then those that failed."""
    predicted_order = sorted(measured, key=lambda m: m.judged.predicted["step_s"])
    unit = "tokens/s" if spec_of(config).counts_tokens else "rows/s"
    ran = [m for m in measured if m.step_s is not None]
    where = ("under the Ray launcher, process 0's steps" if config.cluster.launcher == "ray" else "in this process")
    lines = [f"measured: {len(measured)} candidates x {steps} steps on the devices present, {where}; "
             f"the median step past step {SKIPPED_STEPS}"]
    if ran:
        header = ("#", "settings", "measured ms", "predicted ms", "measured / predicted", f"measured {unit}",
                  "predicted #")
        lines += _aligned([header] + [
            (str(index), label(m.judged.candidate), f"{m.step_s * 1e3:.1f}",
             f"{m.judged.predicted['step_s'] * 1e3:.1f}", f"{m.step_s / m.judged.predicted['step_s']:.2f}",
             f"{_per_step(config) / m.step_s:,.0f}",
             str(predicted_order.index(m) + 1))
            for index, m in enumerate(ran, 1)])
    lines += [f"failed: {label(m.judged.candidate)}: {m.error}" for m in measured if m.step_s is None]
    return "\n".join(lines)
