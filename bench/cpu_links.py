"""The planner's constants for this host's simulated CPU devices (orchestrator/planning/calibration.yaml):
a link's latency per ring step and bandwidth, then the FLOP/s a device reaches on a train step.

Links: Hockney's alpha-beta model over the ring algorithm's steps (Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005). On 8 simulated devices (one
process, XLA:CPU), it times all-reduces over groups of 2, 4 and 8 devices of 4 B to 16 MiB per device,
`--chain` of them in one jitted program (so dispatch is not counted), and fits t = 2(n-1) x latency +
2(n-1)/n x bytes / bandwidth by least squares on the relative error (the sizes span seven orders of
magnitude): cpu_collective_step_us and cpu_link_gbps.

Compute: the cost model divides XLA's FLOPs per device of the compiled step (all of them: remat's recompute,
the optimizer, every elementwise op) by this figure, so it is measured in the same FLOPs. The tiny preset,
data parallel over the 8 devices (a config none of bench.plan_validation's models uses), is planned as one
candidate and trained `--steps` steps `--rounds` times (the median); its step less its collectives' cost with
the links just fitted, over its XLA FLOPs per device: cpu_tflops_per_device.

    python -m bench.cpu_links          # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from bench.plan_validation import DEVICES, ONE_RUNG, SIMULATED, TINY_LM
from nestor.cluster.cpu_devices import simulate_cpu_devices_before_import

GROUPS = (2, 4, 8)
COMPUTE = (*TINY_LM, "train.global_batch=16", "train.seq_len=64", *SIMULATED, f"mesh.data={DEVICES}", "mesh.fsdp=1",
           "mesh.tensor=1", "mesh.pipeline=1", "mesh.context=1", "mesh.expert=1", *ONE_RUNG, "run.compile_cache=null")
FLOATS = (1, 256, 4096, 65536, 262144, 1048576, 4194304)  # float32 elements per device: 4 B to 16 MiB


def ring_terms(group: int, nbytes: float) -> tuple[float, float]:
    """Returns an all-reduce's ring steps and the bytes one device sends, as the cost model counts them."""
    from nestor.orchestrator.planning.cost import ring_steps, sent_bytes
    from nestor.parallel.hlo import CollectiveOp

    op = CollectiveOp("all-reduce", nbytes, 1, ())
    return ring_steps(op, group), sent_bytes(op, group)


def time_all_reduce(group: int, floats: int, chain: int, repeats: int) -> float:
    """Returns the median seconds of one all-reduce of `floats` float32 per device over groups of `group`
    devices (all groups at once), from `chain` of them in one program."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:DEVICES]).reshape(DEVICES // group, group), ("rest", "group"))
    spec = P(("rest", "group"))

    def chained(x):
        for _ in range(chain):
            x = jax.lax.psum(x, "group") * 0.5  # each depends on the last: no two overlap
        return x

    step = jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.ones((DEVICES, floats), jnp.float32), NamedSharding(mesh, spec))
    step(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / chain


def fit(rows: list[tuple[int, int, float]]) -> tuple[float, float]:
    """Returns (latency s per ring step, bandwidth B/s) of the least-squares fit of the relative error over
    `rows` of (group, bytes per device, seconds)."""
    terms = np.array([ring_terms(group, nbytes) for group, nbytes, _ in rows])
    seconds = np.array([s for _, _, s in rows])
    (latency, per_byte), *_ = np.linalg.lstsq(terms / seconds[:, None], np.ones(len(rows)), rcond=None)
    if latency < 0 or per_byte <= 0:
        raise ValueError(f"the times fit no ring (latency {latency:.3g} s, {per_byte:.3g} s per byte): measure again")
    return float(latency), float(1 / per_byte)


def compute_tflops(latency_s: float, bandwidth: float, steps: int, rounds: int) -> dict:
    """Returns COMPUTE's XLA FLOPs per device, measured step, its collectives' time with the fitted links, and
    the TFLOP/s per device that leaves for compute."""
    from nestor.orchestrator.planning.candidates import load_for_plan, pinned_keys
    from nestor.orchestrator.planning.devices import Device
    from nestor.orchestrator.planning.measure import measure
    from nestor.orchestrator.planning.search import search

    config = load_for_plan(None, list(COMPUTE))
    links = Device("cpu", 1.0, bandwidth / 1e9, bandwidth / 1e9, latency_s, "the fitted links")  # 1 TFLOP/s: s = TFLOP
    plan = search(config, pinned_keys(list(COMPUTE)), 3600.0, device=links)
    (judged,) = plan.ranked  # every degree pinned: one layout, one rung
    flops = judged.predicted["compute_s"] * 1e12
    communication = judged.predicted["within_host_s"] + judged.predicted["across_hosts_s"]
    runs = [measure(config, [judged], steps)[0] for _ in range(rounds)]
    if any(run.step_s is None for run in runs):
        raise RuntimeError(f"the tiny step did not train: {next(r.error for r in runs if r.step_s is None)}")
    step = statistics.median(run.step_s for run in runs)
    return {"flops": flops, "step_s": step, "communication_s": communication,
            "tflops": flops / (step - communication) / 1e12}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain", type=int, default=20, help="all-reduces per program")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each program; the median counts")
    parser.add_argument("--steps", type=int, default=10, help="train steps of the compute measurement")
    parser.add_argument("--rounds", type=int, default=3, help="trainings of the compute measurement; the median")
    args = parser.parse_args(argv)
    simulate_cpu_devices_before_import(DEVICES)
    rows = []
    for group in GROUPS:
        for floats in FLOATS:
            chain = args.chain if floats <= 65536 else max(2, args.chain // 10)
            rows.append((group, 4 * floats, time_all_reduce(group, floats, chain, args.repeats)))
    latency, bandwidth = fit(rows)
    print(f"{'group':>5} {'bytes':>10} {'measured us':>12} {'fit us':>10}")
    for group, nbytes, seconds in rows:
        steps, sent = ring_terms(group, nbytes)
        print(f"{group:5d} {nbytes:10d} {seconds * 1e6:12.1f} {(steps * latency + sent / bandwidth) * 1e6:10.1f}")
    found = compute_tflops(latency, bandwidth, args.steps, args.rounds)
    print(f"tiny dp8: {found['flops'] / 1e6:.1f} XLA MFLOP per device, step {found['step_s'] * 1e3:.1f} ms, of it "
          f"{found['communication_s'] * 1e3:.1f} ms in collectives")
    print(f"cpu_collective_step_us: {latency * 1e6:.2f}\ncpu_link_gbps: {bandwidth / 1e9:.3f}\n"
          f"cpu_tflops_per_device: {found['tflops']:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
