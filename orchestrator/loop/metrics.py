"""What a run reports: metrics.jsonl, TensorBoard events, throughput and honest MFU.

Every scalar the step returns is logged (loss, lm_loss, grad_norm,
param_norm, lr, and whatever the model adds, e.g. moe_aux_loss), next to
what the loop measures: step_time_s, tokens_per_s, tflops_per_device and mfu
(only when the device's peak is known), and on the record after them the
seconds spent compiling the step (compile_s) and blocking in a checkpoint
save (checkpoint_s), on an evaluation's record the seconds the evaluation
took (eval_s, never in step_time_s), with a data mixture each source's
realised share of the batch (data_share_<i>), and the run's goodput so far
(goodput_<category> seconds, goodput_fraction; orchestrator.loop.goodput). metrics.jsonl keeps the flat names;
TensorBoard files the same numbers under groups (`tensorboard_tag`). A
`moe_expert_load` metric [MoE layers, experts] becomes a heatmap image every
`metrics.image_every` steps, and at the same steps `moe_expert_bias` (the
selection bias of auxiliary-loss-free balancing) one scalar per layer and
expert, `moe/expert_bias/layer_<L>/expert_<e>`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import yaml

from nestor.models.moe import EXPERT_LOAD
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.job.moe_wiring import EXPERT_BIAS
from nestor.orchestrator.loop.peak_flops import peak_tflops
from nestor.orchestrator.loop.records import read_records
from nestor.orchestrator.specs.registry import spec_of
# What Throughput measures, and the loop's one-off times: compiling the step, blocking in checkpoint saves,
# evaluating.
PERF_METRICS = ("step_time_s", "tokens_per_s", "rows_per_s", "tflops_per_device", "mfu", "compile_s", "checkpoint_s", "eval_s")
# Metrics named with these prefixes go to their own TensorBoard group, the prefix dropped.
_PREFIX_GROUPS = {"moe_": "moe", "eval_": "eval", "data_": "data", "goodput_": "goodput"}
# Records in metrics.jsonl only: `resumed_from` marks a resume (TensorBoard shows it by the config text's step),
# `mesh` the mesh an attempt's steps ran on, from its first record on.
_JSONL_ONLY = ("step", "resumed_from", "mesh")


def tensorboard_tag(name: str) -> str:
    """Returns the TensorBoard tag of metric `name`: `moe_aux_loss` -> `moe/aux_loss`, `eval_*` -> `eval/*`,
    `data_share_0` -> `data/share_0`, `goodput_step` -> `goodput/step`,
    throughput numbers and the loop's times (`eval_s` too) -> `perf/<name>`, anything else (a model's new
    metric too) -> `train/<name>`."""
    if name in PERF_METRICS:
        return f"perf/{name}"
    for prefix, group in _PREFIX_GROUPS.items():
        if name.startswith(prefix):
            return f"{group}/{name[len(prefix):]}"
    return f"train/{name}"


def moe_layer_indices(config: Config, moe_layers: int) -> list[int] | None:
    """Returns the model layer index of each MoE layer (the last of every `moe.every` after the first
    dense layers), or None when `moe_layers` rows do not match the config's layer stack."""
    if not config.moe_layers or moe_layers != config.moe_layers:
        return None
    every = config.moe.every
    return [config.moe.first_dense_layers + (unit + 1) * every - 1 for unit in range(moe_layers)]


def expert_bias_scalars(config: Config, expert_bias: np.ndarray) -> dict[str, float]:
    """Returns TensorBoard's scalars of the selection bias [MoE layers, experts]: one per layer (the
    model's layer index) and expert, tagged `moe/expert_bias/layer_<L>/expert_<e>`."""
    layers = moe_layer_indices(config, len(expert_bias)) or list(range(len(expert_bias)))
    return {f"{tensorboard_tag(EXPERT_BIAS)}/layer_{layer}/expert_{expert}": float(value)
            for layer, row in zip(layers, expert_bias) for expert, value in enumerate(row)}


def expert_load_figure(expert_load: np.ndarray, step: int, layers: list[int] | None = None):
    """Returns a matplotlib Figure (Agg canvas, no display) of expert load: experts across, MoE layers
    down (labelled with `layers`, the model's layer indices, when given), each cell the expert's
    tokens over the even share of its layer on a fixed scale: 1 (white) is balanced, 0 (blue) idle,
    2 (red) twice the even load or more; the title names the busiest expert's multiple."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # a dense run never imports matplotlib
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    load = np.asarray(expert_load, np.float64)  # [moe layers, experts], counts or shares
    mean = load.mean(axis=1, keepdims=True)
    relative = np.divide(load, mean, out=np.zeros_like(load), where=mean > 0)
    rows = len(relative)
    width, height = 7.0, min(2.0 + 0.3 * rows, 8.0)  # inches
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    # Fixed margins (inches) instead of a layout engine, which would triple the drawing time.
    left, right, bottom, top = 0.75, 1.25, 0.55, 0.35
    axes = figure.add_axes((left / width, bottom / height, 1 - (left + right) / width, 1 - (bottom + top) / height))
    colorbar_axes = figure.add_axes((1 - (right - 0.2) / width, bottom / height, 0.15 / width,
                                     1 - (bottom + top) / height))
    cells = axes.imshow(relative, cmap="RdBu_r", norm=TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=2.0),
                        aspect="auto", interpolation="nearest")
    axes.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    axes.yaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    axes.set_xlabel("expert")
    if layers is None:
        axes.set_ylabel("MoE layer")
    else:
        axes.set_ylabel("layer")
        axes.yaxis.set_major_formatter(lambda row, _: str(layers[int(row)]) if 0 <= row < rows else "")
    axes.set_title(f"expert load, step {step} (busiest expert: {relative.max():.2f} x even share)")
    figure.colorbar(cells, cax=colorbar_axes, extend="max", label="tokens / even share")
    return figure


def expert_load_image(expert_load: np.ndarray, step: int, layers: list[int] | None = None) -> np.ndarray:
    """Returns `expert_load_figure` rendered as an RGB uint8 array [height, width, 3] (HWC)."""
    figure = expert_load_figure(expert_load, step, layers)
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()


def split_metrics(values: dict[str, np.ndarray]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Returns (scalars as floats, arrays) of a step's host-side metrics."""
    scalars = {k: float(v) for k, v in values.items() if np.ndim(v) == 0}
    arrays = {k: np.asarray(v) for k, v in values.items() if np.ndim(v) > 0}
    return scalars, arrays


class Throughput:
    """Turns a step time into tokens/s (rows/s for a model of the user's), and, where the model's FLOPs are
    known (nestor's LM), TFLOP/s per device and MFU (None when the peak is unknown)."""

    def __init__(self, config: Config, num_devices: int, device_kind: str):
        spec = spec_of(config)
        self.rate_name = "tokens_per_s" if spec.counts_tokens else "rows_per_s"
        self.per_step = config.train.global_batch * (config.train.seq_len if spec.counts_tokens else 1)
        analytic = spec.flops_per_step(config)
        self.flops_per_step = analytic[0] if analytic else None
        self.num_devices = num_devices
        self.peak = peak_tflops(device_kind, config.model.dtype, config.metrics.peak_tflops)

    def measure(self, step_time_s: float) -> dict[str, float]:
        """Returns step_time_s, tokens_per_s (or rows_per_s) and, with the model's FLOPs, tflops_per_device
        and, when the peak is known, mfu."""
        if step_time_s <= 0:
            return {"step_time_s": step_time_s, self.rate_name: math.nan,
                    **({} if self.flops_per_step is None else {"tflops_per_device": math.nan})}
        out = {"step_time_s": step_time_s, self.rate_name: self.per_step / step_time_s}
        if self.flops_per_step is None:
            return out
        out["tflops_per_device"] = tflops = self.flops_per_step / step_time_s / self.num_devices / 1e12
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out


class MetricsWriter:
    """Writes metrics.jsonl and TensorBoard events (process 0 only); on resume both views drop what a killed attempt wrote past the checkpoint."""

    def __init__(self, config: Config, throughput: Throughput, enabled: bool, log=print):
        self.config = config
        self.log = log
        self.throughput = throughput
        self.enabled = enabled
        self.resumed_from: int | None = None
        self.mesh: str | None = None
        self.run_dir = Path(config.run.dir)
        self.jsonl = self.run_dir / "metrics.jsonl"
        self.tensorboard = None  # opened by start(), which knows where a resumed run continues

    def start(self, resumed_step: int, sharding_table: str, mesh: str) -> None:
        """Drops records after `resumed_step` (a killed run logged them; the resume logs them again) and
        lines that hold no record (a last one cut short: `records.read_records`),
        and writes the config and sharding table as text. The first record
        after a resume carries `resumed_from` (the checkpoint's step); the first of every start, `mesh` (the
        mesh this attempt's steps run on, e.g. "data 2 x fsdp 2 x tensor 2 over 2 processes")."""
        self.resumed_from, self.mesh = resumed_step or None, mesh
        if not self.enabled:
            return
        if self.config.metrics.tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step hides the events a killed attempt wrote past the checkpoint, as the jsonl is trimmed
            self.tensorboard = SummaryWriter(str(self.run_dir / "tb"), purge_step=resumed_step + 1 if resumed_step else None)
        if self.jsonl.exists():
            kept = [record for record in read_records(self.jsonl, self.log, cut=True)
                    if isinstance(record.get("step"), int) and record["step"] <= resumed_step]
            self.jsonl.write_text("".join(json.dumps(record) + "\n" for record in kept))
        if self.tensorboard is not None:
            self.tensorboard.add_text("config", "```\n" + yaml.safe_dump(self.config.to_dict(), sort_keys=False)
                                      + "```", resumed_step)
            self.tensorboard.add_text("sharding", sharding_table, resumed_step)

    def write(self, step: int, values: dict, step_time_s: float, timings: dict[str, float] | None = None) -> dict:
        """Logs one step; returns the record (step, every scalar metric, throughput numbers, and
        `timings`: seconds the loop spent since the previous record, e.g. compile_s, checkpoint_s)."""
        scalars, arrays = split_metrics(values)
        record = {"step": step, **scalars, **self.throughput.measure(step_time_s), **(timings or {}),
                  **{name: value.tolist() for name, value in arrays.items()}}
        if self.resumed_from is not None:
            record["resumed_from"], self.resumed_from = self.resumed_from, None
        if self.mesh is not None:
            record["mesh"], self.mesh = self.mesh, None
        if not self.enabled:
            return record
        with self.jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for name, value in record.items():
                if name not in _JSONL_ONLY and name not in arrays:
                    self.tensorboard.add_scalar(tensorboard_tag(name), value, step)
            every = self.config.metrics.image_every
            if EXPERT_LOAD in arrays and every and step % every == 0:
                load = arrays[EXPERT_LOAD]
                image = expert_load_image(load, step, moe_layer_indices(self.config, len(load)))
                self.tensorboard.add_image(tensorboard_tag(EXPERT_LOAD), image, step, dataformats="HWC")
            if EXPERT_BIAS in arrays and every and step % every == 0:
                for tag, value in expert_bias_scalars(self.config, arrays[EXPERT_BIAS]).items():
                    self.tensorboard.add_scalar(tag, value, step)
        return record

    def close(self) -> None:
        """Flushes and closes the TensorBoard writer."""
        if self.tensorboard is not None:
            self.tensorboard.close()


def spec_text(spec: list) -> str:
    """Returns a PartitionSpec given as JSON (per dimension None, a mesh axis, or a list of axes)
    written as its Python tuple, e.g. "('pipeline', ('data', 'expert'), None)"."""
    return str(tuple(tuple(entry) if isinstance(entry, list) else entry for entry in spec))


def sharding_table(rows: list[dict]) -> str:
    """Returns a Markdown table of parameters: name, shape, logical axes, PartitionSpec, bytes per device."""
    lines = ["| parameter | shape | logical axes | spec | bytes/device |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['shape']} | {r['logical_axes']} | {spec_text(r['spec'])} | {r['bytes_per_device']} |"
              for r in rows]
    return "\n".join(lines)
