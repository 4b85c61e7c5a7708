"""What the cost model knows of a device: its dense peak FLOP/s (loop.peak_flops), memory (loader.memory_fit)
and link bandwidths, within a host and across hosts, from vendor datasheets; and the calibration constants
measured on it (calibration.yaml), each with the date, commit and device of its measurement."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from nestor.orchestrator.loop.peak_flops import peak_tflops

CALIBRATION_FILE = Path(__file__).with_name("calibration.yaml")
PROVENANCE = ("date", "commit", "device", "source")  # what every calibration constant states

# GB/s one device sends (one direction) over the links a collective crosses, from vendor datasheets:
# - within a host: NVIDIA NVLink 4 (H100 SXM, H200) 900 GB/s bidirectional -> 450; NVLink 5 (B200) 1.8 TB/s
#   -> 900; NVLink 3 (A100 SXM) 600 -> 300. Google Cloud TPU system architecture pages, ICI per chip:
#   v5p 4,800 Gbps -> 600 GB/s, v5e 1,600 Gbps -> 200, v6e 3,584 Gbps -> 448 (all links of a chip).
# - across hosts: a NIC per GPU in NVIDIA's DGX/HGX reference designs: H100, H200 and B200 with ConnectX-7
#   400 Gb/s -> 50 GB/s, A100 with ConnectX-6 200 Gb/s -> 25; TPU data-centre network: Google quotes
#   200 Gbps per v5e/v5p host and 400 per v6e host -> 25 and 50 GB/s, over 4 chips -> 6.25 and 12.5.
LINK_GBPS = {  # device table entry: (within a host, across hosts)
    "h100": (450.0, 50.0), "h200": (450.0, 50.0), "b200": (900.0, 50.0), "a100": (300.0, 25.0),
    "tpu v5p": (600.0, 6.25), "tpu v5e": (200.0, 6.25), "tpu v6e": (448.0, 12.5),
}


@dataclasses.dataclass(frozen=True)
class Device:
    """One device of a target as the cost model sees it: FLOP/s it reaches on a train step (peak x the
    calibrated efficiency), GB/s per direction within a host and across hosts, and the seconds each step of a
    ring collective waits on its link whatever the bytes (measured on CPU only: 0 for the table's devices)."""

    kind: str
    achieved_tflops: float
    within_host_gbps: float
    across_hosts_gbps: float
    step_latency_s: float
    note: str  # where the figures come from, printed with the plan


def calibration() -> dict[str, dict]:
    """Returns calibration.yaml's constants: name -> {value, date, commit, device, source, ...}."""
    return yaml.safe_load(CALIBRATION_FILE.read_text())["constants"]


def provenance_problems(constants: dict[str, dict]) -> list[str]:
    """Returns, for each constant that lacks it, what its provenance is missing: a numeric value, a date
    (YYYY-MM-DD), a commit (7 to 40 hex digits), the device measured and the source (command or table)."""
    problems = []
    for name, entry in constants.items():
        entry = entry if isinstance(entry, dict) else {}
        if not isinstance(entry.get("value"), (int, float)):
            problems.append(f"{name}: no numeric value")
        missing = [field for field in PROVENANCE if not str(entry.get(field) or "").strip()]
        if missing:
            problems.append(f"{name}: no {', '.join(missing)}")
            continue
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(entry["date"])):
            problems.append(f"{name}: date {entry['date']!r} is not YYYY-MM-DD")
        if not re.fullmatch(r"[0-9a-f]{7,40}", str(entry["commit"])):
            problems.append(f"{name}: commit {entry['commit']!r} is not a commit hash")
    return problems


def _entry(kind: str, table: dict) -> str | None:
    """Returns the key of `table` that `kind` names (longest first, case and separators ignored)."""
    plain = kind.lower().replace("-", " ").replace("_", " ")
    return next((name for name in sorted(table, key=len, reverse=True) if name in plain), None)


def device_for(kind: str | None, dtype: str) -> Device:
    """Returns the device the plan's times are for: `kind` (cluster.device_kind) in `dtype`, or this host's
    simulated CPU devices where `kind` is None or names none of the table (calibrated on this machine)."""
    constants = calibration()
    peak = peak_tflops(kind, dtype) if kind else None
    links = LINK_GBPS.get(_entry(kind, LINK_GBPS)) if kind else None
    if peak is None or links is None:
        cpu_tflops, cpu_link = constants["cpu_tflops_per_device"], constants["cpu_link_gbps"]
        latency = constants["cpu_collective_step_us"]
        measured = dict.fromkeys(f"{c['date']} ({c['commit']})" for c in (cpu_tflops, cpu_link, latency))
        return Device("cpu", cpu_tflops["value"], cpu_link["value"], cpu_link["value"], latency["value"] * 1e-6,
                      f"simulated CPU devices of this host: {cpu_tflops['value']:g} TFLOP/s, {cpu_link['value']:g} GB/s "
                      f"and {latency['value']:g} us per ring step each, measured {' and '.join(measured)}")
    name = "efficiency_" + ("h200" if "h200" in kind.lower() else "h100")
    efficiency = constants.get(name, constants["efficiency_h100"])
    return Device(kind, peak * efficiency["value"], *links, 0.0,
                  f"{kind}: {peak:g} TFLOP/s peak ({dtype}) x {efficiency['value']:g} efficiency ({efficiency['device']}, "
                  f"{efficiency['date']}, {efficiency['commit']}); links {links[0]:g} / {links[1]:g} GB/s within / "
                  "across hosts")
