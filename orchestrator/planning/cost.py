"""The cost model: a candidate's predicted step time from its compiled step. Compute is XLA's FLOPs per
device over the FLOP/s the device reaches (peak x calibrated efficiency); a pipeline's bubble is in those
FLOPs already (every stage computes on every tick, idle ticks included), and so is remat's recompute.
Communication is each collective of the compiled HLO as a ring (Hockney's alpha-beta model): a latency per
ring step plus the bytes a device sends over the bandwidth of the links its group crosses (within a host, or
across hosts when any group spans two). No overlap of the two is assumed: a GPU's efficiency was measured on
one device, where no collective ran; the CPU's compute is its step less its collectives (bench/cpu_links.py)."""

from __future__ import annotations

from collections.abc import Sequence

from nestor.orchestrator.planning.devices import Device
from nestor.parallel.hlo import CollectiveOp


def sent_bytes(op: CollectiveOp, group_size: int) -> float:
    """Returns the bytes one device sends in one run of `op` over a ring of `group_size` devices (`op.bytes`
    is its result per device: the reduced array, the gathered array, the scattered shard, the exchanged
    or permuted buffer)."""
    if op.kind == "collective-permute":
        return float(op.bytes)
    share = (group_size - 1) / group_size
    return {"all-reduce": 2 * share * op.bytes, "all-gather": share * op.bytes,
            "reduce-scatter": (group_size - 1) * op.bytes, "all-to-all": share * op.bytes}[op.kind]


def ring_steps(op: CollectiveOp, group_size: int) -> int:
    """Returns the steps of `op` as a ring of `group_size` devices, each paying the link's latency once: an
    all-reduce is a reduce-scatter and an all-gather, n-1 steps each; a collective-permute is one."""
    if op.kind == "collective-permute":
        return 1
    return (2 if op.kind == "all-reduce" else 1) * (group_size - 1)


def crosses_hosts(op: CollectiveOp, host_of: Sequence[int]) -> bool:
    """Whether a group of `op` joins devices of two hosts (`host_of[partition id]`; no groups: all devices)."""
    groups = op.groups or (tuple(range(len(host_of))),)
    return any(len({host_of[i] for i in group}) > 1 for group in groups)


def communication_s(ops: list[CollectiveOp], host_of: Sequence[int], device: Device) -> dict[str, float]:
    """Returns seconds per step spent in collectives, within hosts and across them."""
    seconds = {"within_host": 0.0, "across_hosts": 0.0}
    for op in ops:
        size = len(op.groups[0]) if op.groups else len(host_of)
        across = crosses_hosts(op, host_of)
        bandwidth = device.across_hosts_gbps if across else device.within_host_gbps
        one = ring_steps(op, size) * device.step_latency_s + sent_bytes(op, size) / (bandwidth * 1e9)
        seconds["across_hosts" if across else "within_host"] += op.runs * one
    return seconds


def predicted_step(flops_per_device: float, ops: list[CollectiveOp], host_of: Sequence[int],
                   device: Device) -> dict[str, float]:
    """Returns the predicted step: `compute_s`, `within_host_s`, `across_hosts_s` and their sum `step_s`."""
    compute = flops_per_device / (device.achieved_tflops * 1e12)
    comm = communication_s(ops, host_of, device)
    return {"compute_s": compute, "within_host_s": comm["within_host"], "across_hosts_s": comm["across_hosts"],
            "step_s": compute + comm["within_host"] + comm["across_hosts"]}
