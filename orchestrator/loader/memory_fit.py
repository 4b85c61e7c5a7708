"""Will it fit? A compiled step's memory per device against the memory of one device.

Device memory is quoted in GiB (2^30 bytes; an "80 GB" H100 holds 80 GiB of
HBM), so every figure here is in GiB. The device is `cluster.device_kind` (a
name of the table below, or a jax `device_kind` string), by default the
accelerators present; `cluster.device_memory_gb` overrides the table. A run
meant for CPUs has the host's RAM, shared by the devices it simulates.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import psutil

from nestor.backend import Backend, entry_named
from nestor.orchestrator.specs.registry import spec_of

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config

GIB = 2**30

# GiB of memory per device, from vendor datasheets: NVIDIA H100 SXM/PCIe 80, H200 141, B200 180 (HGX B200),
# A100 40 or 80; Google Cloud TPU pages: v4 32, v5e 16, v5p 95, v6e 32 (HBM per chip).
DEVICE_MEMORY_GIB = {"h100": 80.0, "h200": 141.0, "b200": 180.0, "a100-40gb": 40.0, "a100-80gb": 80.0,
                     "tpu-v4": 32.0, "tpu-v5e": 16.0, "tpu-v5p": 95.0, "tpu-v6e": 32.0}

# The words that identify each table entry in a device kind, as a user writes it ("a100-80gb") or as
# jax reports it ("NVIDIA A100-SXM4-80GB", "TPU v5 lite"); the entry with most matching words wins.
_KIND_WORDS = [
    (("h100",), "h100"), (("h200",), "h200"), (("b200",), "b200"), (("a100",), "a100-40gb"),
    (("a100", "80gb"), "a100-80gb"), (("tpu", "v4"), "tpu-v4"), (("tpu", "v5e"), "tpu-v5e"),
    (("tpu", "v5", "lite"), "tpu-v5e"), (("tpu", "v5p"), "tpu-v5p"), (("tpu", "v5"), "tpu-v5p"),
    (("tpu", "v6e"), "tpu-v6e"), (("tpu", "v6", "lite"), "tpu-v6e"),
]


def table_entry(device_kind: str) -> str | None:
    """Returns the DEVICE_MEMORY_GIB entry `device_kind` names (case, `-`, `_` and spaces ignored),
    or None when it names none (CPU, an accelerator not in the table)."""
    return entry_named(device_kind, _KIND_WORDS)


def host_memory_gib() -> float:
    """Returns this host's RAM in GiB: what the CPU devices it simulates share."""
    return psutil.virtual_memory().total / GIB


def device_memory(config: Config, backend: Backend, devices_here: int) -> tuple[str | None, float | None]:
    """Returns (the device checked against, its memory in GiB): the backend's device kind
    (`cluster.device_kind`, or the accelerators' own); the memory is `cluster.device_memory_gb` or the
    table's. A run meant for CPUs with neither key set is checked against `cpu`, the host's RAM split
    over the `devices_here` devices this process holds; an accelerator not in the table has None."""
    cluster, kind = config.cluster, backend.device_kind
    if cluster.device_memory_gb is not None:
        return kind, cluster.device_memory_gb
    if backend.target == "cpu" and not kind:
        return "cpu", host_memory_gib() / devices_here
    entry = table_entry(kind) if kind else None
    return kind, DEVICE_MEMORY_GIB[entry] if entry else None


def state_problems(config: Config, backend: Backend, state_bytes: int, largest: dict[str, Any],
                   devices_here: int) -> list[tuple[str, str]]:
    """Returns (key, message) when the train state alone, `state_bytes` per device (parameters and optimizer
    as the mesh shards them), is more than the device's memory (`device_memory`): nothing of it can be
    allocated. `largest` is the largest parameter's row of state.param_table; the key named is the one
    that sizes its largest dimension (model.args for a model of the user's)."""
    kind, capacity_gib = device_memory(config, backend, devices_here)
    if capacity_gib is None or state_bytes <= capacity_gib * GIB:
        return []
    dimension = max(range(len(largest["shape"])), key=lambda index: largest["shape"][index])
    axis = largest["logical_axes"][dimension]
    key = spec_of(config).size_key(axis)
    along = repr(axis) if axis else "a dimension without a logical name (replicated)"
    memory = (f"the {capacity_gib:.1f} GiB each of this host's {devices_here} CPU devices has of its "
              f"{host_memory_gib():.1f} GiB of RAM" if kind == "cpu"
              else f"the {capacity_gib:g} GiB of {kind or 'cluster.device_memory_gb'}")
    return [(key, f"the train state needs {state_bytes / GIB:,.1f} GiB per device (float32 parameters and AdamW's "
                  f"two moments, as the mesh shards them), more than {memory}; its largest parameter, "
                  f"{largest['name']} {largest['shape']}, is {largest['shape'][dimension]:,} along {along}: make "
                  f"{key} smaller or shard the state over more devices")]


def verdict(total_bytes: int, capacity_gib: float | None) -> str:
    """Returns `fits`, `does not fit, short by X GiB`, or, with no known capacity, what to set."""
    if capacity_gib is None:
        return "no device memory limit known; name one with cluster.device_kind or cluster.device_memory_gb"
    short = total_bytes / GIB - capacity_gib
    # Rounded up, so that a config short by a few bytes never reads "short by 0.0 GiB".
    return "fits" if short <= 0 else f"does not fit, short by {math.ceil(short * 10) / 10:.1f} GiB"


# XLA:CPU schedules an unrolled stack's recomputations early, as if there were no remat; XLA:GPU does not
# (measured in docs/benchmarks.md, "Unrolled layer stacks").
UNROLLED_ON_CPU = ("model.scan_layers=false compiled by XLA:CPU for an accelerator: these figures do not apply "
                   "there. XLA:CPU's schedule of an unrolled stack keeps every unit's activations whatever "
                   "model.remat; XLA:GPU's does not (docs/benchmarks.md, \"Unrolled layer stacks\"); "
                   "model.scan_layers=true gives an estimate")


def unrolled_caveat(config: Config, backend: Backend, pipeline_stages: int = 1) -> str | None:
    """Returns why the figures of an unrolled stack compiled on CPU for an accelerator do not apply there,
    or None where they hold (a scanned stack, a run meant for CPUs, a compile for the devices themselves,
    a mesh of several `pipeline_stages` and no first dense layers: the stages keep their loop, nothing is
    unrolled)."""
    if config.model.scan_layers or backend.platform != "cpu" or backend.target == "cpu":
        return None
    if pipeline_stages > 1 and not (config.moe_layers and config.moe.first_dense_layers):
        return None
    return UNROLLED_ON_CPU


def fit_report(config: Config, backend: Backend, state_bytes: int, temporaries_bytes: int, total_bytes: int,
               devices_here: int, pipeline_stages: int = 1) -> dict[str, Any]:
    """Returns explain's `fit` entry: per device the state (parameters + optimizer), XLA's temporaries
    and the total, in bytes, the device checked against (`device_memory`, over `devices_here` devices
    on CPU), its memory, the verdict (`fits` is None when the memory is unknown) and a `caveat` (None,
    or why the figures do not apply)."""
    kind, capacity_gib = device_memory(config, backend, devices_here)
    return {"state_bytes": state_bytes, "temporaries_bytes": temporaries_bytes, "total_bytes": total_bytes,
            "device_kind": kind, "device_memory_bytes": None if capacity_gib is None else int(capacity_gib * GIB),
            "fits": None if capacity_gib is None else total_bytes <= capacity_gib * GIB,
            "verdict": verdict(total_bytes, capacity_gib), "caveat": unrolled_caveat(config, backend, pipeline_stages)}
