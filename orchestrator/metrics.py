"""What a run reports: metrics.jsonl, TensorBoard events, throughput and honest MFU.

Every scalar the step returns is logged under its own name (loss, lm_loss,
grad_norm, param_norm, lr, and whatever the model adds, e.g. moe_aux_loss),
next to what the loop measures: step_time_s, tokens_per_s,
tflops_per_device and mfu (only when the device's peak is known). The same
numbers go to metrics.jsonl and TensorBoard. A `moe_expert_load`
metric [layers, experts] becomes a heatmap image every `metrics.image_every`
steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import yaml

from orchestrator.config import Config
from orchestrator.flops import model_flops_per_step, peak_tflops

EXPERT_LOAD = "moe_expert_load"
_HEATMAP_CELL = 16  # pixels per (layer, expert) cell, so a 4 x 8 table is still visible


def expert_load_image(expert_load: np.ndarray) -> np.ndarray:
    """Returns an RGB uint8 heatmap [layers * 16, experts * 16, 3] of expert load, one row per layer.

    Each row is scaled by its own even share (tokens / mean), so white is
    twice the even load or more, mid-grey is even, black is an idle expert.
    """
    load = np.asarray(expert_load, np.float64)
    mean = load.mean(axis=1, keepdims=True)
    relative = np.clip(np.divide(load, mean, out=np.zeros_like(load), where=mean > 0) / 2, 0.0, 1.0)
    pixels = np.kron(relative, np.ones((_HEATMAP_CELL, _HEATMAP_CELL)))
    grey = (pixels * 255).round().astype(np.uint8)
    return np.stack([grey, grey, grey], axis=-1)


def split_metrics(values: dict[str, np.ndarray]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Returns (scalars as floats, arrays) of a step's host-side metrics."""
    scalars = {k: float(v) for k, v in values.items() if np.ndim(v) == 0}
    arrays = {k: np.asarray(v) for k, v in values.items() if np.ndim(v) > 0}
    return scalars, arrays


class Throughput:
    """Turns a step time into tokens/s, TFLOP/s per device and MFU (None when the peak is unknown)."""

    def __init__(self, config: Config, num_devices: int, device_kind: str):
        self.tokens_per_step = config.train.global_batch * config.train.seq_len
        self.flops_per_step = model_flops_per_step(config)
        self.num_devices = num_devices
        self.peak = peak_tflops(device_kind, config.model.dtype, config.metrics.peak_tflops)

    def measure(self, step_time_s: float) -> dict[str, float]:
        """Returns step_time_s, tokens_per_s, tflops_per_device and, when the peak is known, mfu."""
        if step_time_s <= 0:
            return {"step_time_s": step_time_s, "tokens_per_s": math.nan, "tflops_per_device": math.nan}
        tflops = self.flops_per_step / step_time_s / self.num_devices / 1e12
        out = {"step_time_s": step_time_s, "tokens_per_s": self.tokens_per_step / step_time_s,
               "tflops_per_device": tflops}
        if self.peak:
            out["mfu"] = tflops / self.peak
        return out


class MetricsWriter:
    """Writes metrics.jsonl and TensorBoard events (process 0 only); on resume both views drop what a killed attempt wrote past the checkpoint."""

    def __init__(self, config: Config, throughput: Throughput, enabled: bool):
        self.config = config
        self.throughput = throughput
        self.enabled = enabled
        self.resumed_from: int | None = None
        self.run_dir = Path(config.run.dir)
        self.jsonl = self.run_dir / "metrics.jsonl"
        self.tensorboard = None  # opened by start(), which knows where a resumed run continues

    def start(self, resumed_step: int, sharding_table: str) -> None:
        """Drops records after `resumed_step` (a killed run logged them; the resume logs them again),
        and writes the config and sharding table as text. The first record
        after a resume carries `resumed_from` (the checkpoint's step)."""
        self.resumed_from = resumed_step or None
        if not self.enabled:
            return
        if self.config.metrics.tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step hides the events a killed attempt wrote past the checkpoint, as the jsonl is trimmed
            self.tensorboard = SummaryWriter(str(self.run_dir / "tb"), purge_step=resumed_step + 1 if resumed_step else None)
        if self.jsonl.exists():
            kept = [line for line in self.jsonl.read_text().splitlines()
                    if line and json.loads(line)["step"] <= resumed_step]
            self.jsonl.write_text("".join(line + "\n" for line in kept))
        if self.tensorboard is not None:
            self.tensorboard.add_text("config", "```\n" + yaml.safe_dump(self.config.to_dict(), sort_keys=False)
                                      + "```", resumed_step)
            self.tensorboard.add_text("sharding", sharding_table, resumed_step)

    def write(self, step: int, values: dict, step_time_s: float) -> dict:
        """Logs one step; returns the record (step, every scalar metric, throughput numbers)."""
        scalars, arrays = split_metrics(values)
        record = {"step": step, **scalars, **self.throughput.measure(step_time_s),
                  **{name: value.tolist() for name, value in arrays.items()}}
        if self.resumed_from is not None:
            record["resumed_from"], self.resumed_from = self.resumed_from, None
        if not self.enabled:
            return record
        with self.jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for name, value in record.items():
                if name != "step" and name not in arrays:
                    self.tensorboard.add_scalar(name, value, step)
            every = self.config.metrics.image_every
            if EXPERT_LOAD in arrays and every and step % every == 0:
                self.tensorboard.add_image(EXPERT_LOAD, expert_load_image(arrays[EXPERT_LOAD]), step,
                                           dataformats="HWC")
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
