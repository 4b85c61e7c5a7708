"""MoE overheads for E = 8, 32, 128 experts (GShard top-2, arXiv 2006.16668), per dispatch.

For each expert count and each `moe.dispatch` (einsum: GShard's one-hot
einsums; sort: tokens placed in slots by index), in one run:
- routing share: XLA's forward FLOPs of the whole MoE layer minus those of
  its expert feed-forwards alone (router, top-k gating, dispatch and
  combine), as a share of the expert feed-forwards' FLOPs, both from
  `compiled.cost_analysis()` on one device;
- all-to-all bytes of one train step over all devices (compiled HLO on an
  expert mesh), against the analytic minimum: every routed token's embedding
  sent to its expert and back (tokens x k x embed x bytes, twice), forward
  and backward;
- tokens/s of the MoE train step against a dense model whose every layer has
  the MoE layers' active width (mlp_dim x top_k; an upper bound on the MoE
  model's active FFN, since its other layers are dense at mlp_dim), same mesh
  and batch.

    python -m bench.moe       # prints the table, writes its section of docs/benchmarks.md

On simulated CPU devices all "devices" share the host's cores: tokens/s
compares total work, not communication overlap.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.report import write_section

EXPERT_COUNTS = (8, 32, 128)
DISPATCHES = ("einsum", "sort")
WIDE_TOP_K = 8  # the routing share only (no timing) at the top-k of fine-grained models
DEVICES = 8
TOP_K = 2
MODEL = ["model.preset=tiny", "model.num_layers=4", "model.embed_dim=128", "model.mlp_dim=256",
         "model.num_heads=4", "model.num_kv_heads=4", "model.head_dim=32",
         "train.global_batch=16", "train.seq_len=128"]
BASE = MODEL + ["train.steps=100", "run.dir=/tmp/nestor-bench-moe", f"cluster.devices_per_host={DEVICES}",
                "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.expert=8", f"moe.top_k={TOP_K}"]
COMMAND = "python -m bench.moe"
READING = (
    "Reading: with einsum dispatch each one-hot einsum (dispatch, combine) costs 2 x group x experts x capacity x embed FLOPs, and "
    "experts x capacity ~ k x capacity_factor x group, so against the SwiGLU experts (6 x experts x capacity x "
    "embed x mlp) the pair costs about 2 x group / (3 x mlp) whatever the expert count: smaller groups make "
    "routing cheaper. Sort dispatch moves tokens by gather instead (no FLOPs) and multiplies only in the "
    "gate-weighted sum of each token's k outputs; what is left is the router matmul (2 x embed x experts per "
    "token, which grows with the expert count) and the [tokens, experts] gating arithmetic. Both dispatches fill "
    "the same capacity slots, so they move the same all-to-all bytes. The all-to-all moves capacity slots, not tokens, so its ratio to the minimum is the "
    "capacity factor, rounded up per expert (ceil(2 x 1.25 x 128 / 128) = 3 slots where 2.5 were asked for "
    "at 128 experts). Tokens/s on shared simulated CPU devices is indicative only, and absolute values move "
    "with whatever else the host runs: compare rows of one run."
)


def _config(*overrides: str):
    from orchestrator.config import load

    return load(None, BASE + list(overrides))


def _moe_overrides(experts: int, dispatch: str) -> list[str]:
    return [f"moe.num_experts={experts}", "moe.every=2", f"moe.dispatch={dispatch}"]


def routing_flop_share(config) -> float:
    """Returns (MoE layer forward FLOPs - expert FFN FLOPs) / expert FFN FLOPs, one device, from XLA."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.moe import MoEFeedForward, expert_capacity
    from orchestrator.explain import cost_flops
    from orchestrator.state import model_config

    cfg = model_config(config)
    layer = nnx.eval_shape(lambda: MoEFeedForward(cfg, nnx.Rngs(params=0)))
    graphdef, params = nnx.split(layer)
    batch, length, dim = config.train.global_batch, config.train.seq_len, cfg.embed_dim
    capacity = expert_capacity(length, cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor)
    tokens = jax.ShapeDtypeStruct((batch, length, dim), jnp.float32)
    slots = jax.ShapeDtypeStruct((cfg.moe.num_experts, batch, capacity, dim), jnp.float32)  # one group per sequence

    def flops(fn, x) -> float:
        return cost_flops(jax.jit(fn).lower(params, x).compile())

    whole = flops(lambda p, x: nnx.merge(graphdef, p)(x)[0], tokens)
    experts = flops(lambda p, x: nnx.merge(graphdef, p).experts(x), slots)
    return (whole - experts) / experts


def step_measurements(config, steps: int) -> tuple[float, int]:
    """Returns (median seconds per train step over `steps` after one warm-up, all-to-all bytes per step, all devices)."""
    import jax

    from orchestrator.explain import compile_step
    from orchestrator.state import init_state
    from orchestrator.train import build_job
    from parallel.hlo import collectives

    job = build_job(config)
    compiled = compile_step(job)
    all_to_all_bytes = collectives(compiled.as_text())["all-to-all"]["bytes"] * job.mesh.devices.size
    state = init_state(config, job.layout)
    times = []
    for step in range(steps + 1):
        tokens = job.data.batch(step)
        start = time.perf_counter()
        state, metrics = compiled(state, tokens)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), all_to_all_bytes


def minimum_all_to_all_bytes(config) -> int:
    """Returns tokens x k x embed x bytes, twice (dispatch, combine), forward and backward, per MoE layer."""
    import numpy as np

    tokens = config.train.global_batch * config.train.seq_len
    moe_layers = config.moe_layers
    per_direction = tokens * config.moe.top_k * config.model.embed_dim * np.dtype(config.model.dtype).itemsize
    return 2 * 2 * moe_layers * per_direction


def measure(steps: int) -> list[dict]:
    """Returns one row per expert count and dispatch; the dense baseline is timed once in the same run."""
    base = _config()
    tokens = base.train.global_batch * base.train.seq_len
    dense_seconds, _ = step_measurements(_config(f"model.mlp_dim={base.model.mlp_dim * TOP_K}"), steps)
    rows = []
    for experts in EXPERT_COUNTS:
        for dispatch in DISPATCHES:
            rows.append(_row(_config(*_moe_overrides(experts, dispatch)), steps, tokens, dense_seconds))
    return rows


def _row(config, steps: int, tokens: int, dense_seconds: float) -> dict:
    """Returns one MoE config's measurements next to the dense baseline's tokens/s."""
    seconds, all_to_all = step_measurements(config, steps)
    return {
        "experts": config.moe.num_experts,
        "dispatch": config.moe.dispatch,
        "routing_share": routing_flop_share(config),
        "all_to_all_mib": all_to_all / 2**20,
        "minimum_mib": minimum_all_to_all_bytes(config) / 2**20,
        "moe_tokens_per_s": tokens / seconds,
        "dense_tokens_per_s": tokens / dense_seconds,
    }


def wide_top_k_shares() -> list[dict]:
    """Returns the routing share at top_k=WIDE_TOP_K for each expert count and dispatch (cost analysis only)."""
    return [{"experts": experts, "dispatch": dispatch,
             "routing_share": routing_flop_share(_config(*_moe_overrides(experts, dispatch), f"moe.top_k={WIDE_TOP_K}"))}
            for experts in EXPERT_COUNTS for dispatch in DISPATCHES]


def share_table(rows: list[dict]) -> str:
    """Returns the top_k=WIDE_TOP_K routing shares as a Markdown table, one column per dispatch."""
    shares = {(r["experts"], r["dispatch"]): r["routing_share"] for r in rows}
    lines = [f"| experts | {' | '.join(DISPATCHES)} |", "|---:|" + "---:|" * len(DISPATCHES)]
    for experts in EXPERT_COUNTS:
        lines.append(f"| {experts} | " + " | ".join(f"{shares[experts, d]:.1%}" for d in DISPATCHES) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """Returns the rows as a Markdown table."""
    lines = ["| experts | dispatch | routing+dispatch+combine FLOPs / expert FFN FLOPs | all-to-all MiB/step | analytic minimum MiB "
             "| ratio | MoE tokens/s | dense (mlp x 2 in every layer) tokens/s | MoE / dense |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['experts']} | {r['dispatch']} | {r['routing_share']:.1%} | {r['all_to_all_mib']:.2f} | {r['minimum_mib']:.2f} "
                     f"| {r['all_to_all_mib'] / r['minimum_mib']:.2f} | {r['moe_tokens_per_s']:,.0f} "
                     f"| {r['dense_tokens_per_s']:,.0f} | {r['moe_tokens_per_s'] / r['dense_tokens_per_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    """Runs the benchmark, prints the table and writes its section of docs/benchmarks.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed train steps per model")
    args = parser.parse_args()

    from orchestrator.runtime import configure_jax

    configure_jax(_config())
    import jax

    rows = measure(args.steps)
    wide = wide_top_k_shares()
    device = jax.devices()[0]
    setup = (f"Model: {' '.join(MODEL)}; MoE every 2nd layer, top_k={TOP_K}, capacity_factor 1.25, one group "
             f"per sequence; mesh expert={DEVICES} ({DEVICES} simulated {device.platform} devices); "
             f"median of {args.steps} steps after one warm-up; jax {jax.__version__}.")
    wide_heading = (f"Routing+dispatch+combine FLOPs / expert FFN FLOPs at top_k={WIDE_TOP_K} (same model, "
                    "cost analysis only):")
    text = "\n".join(["## MoE (GShard routing; einsum and sort dispatch)", "", f"Command: `{COMMAND}`", "", setup, "",
                      table(rows), "", wide_heading, "", share_table(wide), "", READING, ""])
    print(text)
    write_section("moe", text)


if __name__ == "__main__":
    main()
