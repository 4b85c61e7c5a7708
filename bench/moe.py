"""MoE overheads for E = 8, 32, 128 experts and top-k = 2, 8, per dispatch (einsum, sort, dropless).

For each expert count, top-k and dispatch (einsum: GShard's one-hot einsums,
arXiv 2006.16668; sort: tokens placed in capacity slots by index; dropless:
`moe.capacity_factor=0`, tokens sorted by expert through grouped matmuls), in
one run:
- routing share: XLA's forward FLOPs of the whole MoE layer minus those of
  its expert feed-forwards alone (router, top-k gating, dispatch and
  combine), as a share of the expert feed-forwards' FLOPs, both from
  `compiled.cost_analysis()` on one device. A grouped matmul is counted at
  the FLOPs of a dense matmul over the same rows (`useful_ragged_dot`): what
  `jax.lax.ragged_dot` multiplies on GPU and TPU, each row by its own expert;
  XLA:CPU expands it to every row times every expert;
- token-exchange bytes of one train step over all devices (compiled HLO on an
  expert mesh: all-to-all for the capacity dispatches, all-gather +
  reduce-scatter for dropless), against the analytic minimum: every routed
  token's embedding sent to its expert and back (tokens x k x embed x bytes,
  twice), forward and backward;
- temporaries per device (XLA's memory analysis of the train step);
- tokens/s of the MoE train step against a dense model with the same active
  parameters (every layer's feed-forward k x mlp_dim wide), same mesh and
  batch, timed in the same run.

    python -m bench.moe       # prints the table, writes its section of docs/benchmarks.md

On simulated CPU devices all "devices" share the host's cores: tokens/s
compares total work, not communication overlap; XLA:CPU's ragged_dot does
every expert's work on every row, so dropless tokens/s here is not what an
accelerator sees.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

from bench.report import write_section

EXPERT_COUNTS = (8, 32, 128)
TOP_KS = (2, 8)
DISPATCHES = ("einsum", "sort", "dropless")
DEVICES = 8
MODEL = ["model.preset=tiny", "model.num_layers=4", "model.embed_dim=128", "model.mlp_dim=256",
         "model.num_heads=4", "model.num_kv_heads=4", "model.head_dim=32",
         "train.global_batch=16", "train.seq_len=128"]
BASE = MODEL + ["train.steps=100", "run.dir=/tmp/nestor-bench-moe", f"cluster.devices_per_host={DEVICES}",
                "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.expert=8"]
COMMAND = "python -m bench.moe"
READING = (
    "Reading: with einsum dispatch each one-hot einsum (dispatch, combine) costs 2 x group x experts x capacity x "
    "embed FLOPs, and experts x capacity ~ k x capacity_factor x group, so against the SwiGLU experts (6 x experts "
    "x capacity x embed x mlp) the pair costs about 2 x group / (3 x mlp) whatever the expert count. Sort and "
    "dropless move tokens by gather (no FLOPs) and multiply only in the gate-weighted sum of each token's k "
    "outputs; what is left is the router matmul (2 x embed x experts per token, which grows with the expert count "
    "and shrinks against k experts' FFNs) and the [tokens, experts] gating arithmetic. Einsum and sort fill the "
    "same capacity slots, so they move the same all-to-all bytes: capacity slots, not tokens, so the ratio to the "
    "minimum is k x the capacity factor's padding, rounded up per expert. Dropless on CPU uses the exchange every "
    "backend runs (all-gather of the expert devices' tokens, reduce-scatter of their outputs): it moves every "
    "token to every expert device, about expert devices / k times the minimum (parallel/experts.py; the "
    "ragged all-to-all that would move only the routed tokens is not built). Its worst-case buffer of "
    "gathered tokens x k rows is what its temporaries show. Dropless tokens/s on CPU pays XLA:CPU's ragged_dot, "
    "which multiplies every row by every local expert; on GPU and TPU a grouped matmul multiplies each row once. "
    "Tokens/s on shared simulated CPU devices is indicative only, and absolute values move with whatever else "
    "the host runs: compare rows of one run."
)


def _config(*overrides: str):
    from orchestrator.config import load

    return load(None, BASE + list(overrides))


def moe_overrides(experts: int, top_k: int, dispatch: str) -> list[str]:
    """Returns the overrides of an MoE feed-forward in every layer with `experts` experts, top `top_k`,
    dispatched by `dispatch` (einsum, sort or dropless)."""
    dispatch_keys = ["moe.capacity_factor=0"] if dispatch == "dropless" else [f"moe.dispatch={dispatch}"]
    return [f"moe.num_experts={experts}", f"moe.top_k={top_k}", "moe.every=1", *dispatch_keys]


def dispatch_of(config) -> str:
    """Returns the dispatch a config runs: dropless when capacity_factor is 0, else `moe.dispatch`."""
    return "dropless" if config.moe.capacity_factor == 0 else config.moe.dispatch


@contextlib.contextmanager
def useful_ragged_dot() -> Iterator[None]:
    """Traces every `jax.lax.ragged_dot` inside the block as a dense matmul of its rows by the first
    group's weights: the FLOPs ragged_dot does on GPU and TPU (each row times its own expert's weights
    once), in a program XLA:CPU's cost analysis counts (its own ragged_dot multiplies every row by every
    group). Only for counting: the values are not the model's."""
    import jax

    original = jax.lax.ragged_dot

    def dense_rows(lhs, rhs, group_sizes, **_):
        return lhs @ rhs[0]  # [rows, in] x [in, out]

    jax.lax.ragged_dot = dense_rows
    try:
        yield
    finally:
        jax.lax.ragged_dot = original


def routing_flop_share(config) -> float:
    """Returns (MoE layer forward FLOPs - expert FFN FLOPs) / expert FFN FLOPs, one device, from XLA
    (grouped matmuls counted by `useful_ragged_dot`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.moe import MoEFeedForward, expert_capacity, grouped_swiglu
    from orchestrator.explain import cost_flops
    from orchestrator.state import model_config

    cfg = model_config(config)
    moe = cfg.moe
    layer = nnx.eval_shape(lambda: MoEFeedForward(cfg, nnx.Rngs(params=0)))
    graphdef, params = nnx.split(layer)
    batch, length, dim = config.train.global_batch, config.train.seq_len, cfg.embed_dim
    tokens = jax.ShapeDtypeStruct((batch, length, dim), jnp.float32)

    def flops(fn, x) -> float:
        with useful_ragged_dot():
            return cost_flops(jax.jit(fn).lower(params, x).compile())

    whole = flops(lambda p, x: nnx.merge(graphdef, p)(x)[0], tokens)
    if moe.dropless:  # the grouped SwiGLU over the sorted buffer: tokens x k rows
        rows = jax.ShapeDtypeStruct((batch * length * moe.top_k, dim), jnp.float32)
        sizes = jnp.zeros((moe.num_experts,), jnp.int32)

        def expert_ffn(p, x):
            layer = nnx.merge(graphdef, p)
            return grouped_swiglu(x, sizes, (layer.gate[...], layer.up[...], layer.down[...]))

        experts = flops(expert_ffn, rows)
    else:
        capacity = expert_capacity(length, moe.num_experts, moe.top_k, moe.capacity_factor)
        slots = jax.ShapeDtypeStruct((moe.num_experts, batch, capacity, dim), jnp.float32)  # one group per sequence
        experts = flops(lambda p, x: nnx.merge(graphdef, p).experts(x), slots)
    return (whole - experts) / experts


EXCHANGES = ("all-to-all", "all-gather", "reduce-scatter")


def step_measurements(config, steps: int) -> dict:
    """Returns the train step's token-exchange bytes (all-to-all, all-gather, reduce-scatter; all
    devices), temporaries per device and, with `steps` > 0, the median seconds per step over `steps`
    after one warm-up (else None)."""
    import jax

    from orchestrator.explain import compile_step
    from orchestrator.state import init_state
    from orchestrator.train import build_job
    from parallel.hlo import collectives

    job = build_job(config)
    compiled = compile_step(job)
    found = collectives(compiled.as_text())
    measured = {"exchange_bytes": sum(found[kind]["bytes"] for kind in EXCHANGES) * job.mesh.devices.size,
                "temporaries_bytes": compiled.memory_analysis().temp_size_in_bytes, "seconds": None}
    if steps:
        state = init_state(config, job.layout)
        times = []
        for step in range(steps + 1):
            tokens = job.data.batch(step)
            start = time.perf_counter()
            state, metrics = compiled(state, tokens)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        measured["seconds"] = statistics.median(times[1:])
    return measured


def minimum_exchange_bytes(config) -> int:
    """Returns tokens x k x embed x bytes, twice (dispatch, combine), forward and backward, per MoE layer."""
    import numpy as np

    tokens = config.train.global_batch * config.train.seq_len
    per_direction = tokens * config.moe.top_k * config.model.embed_dim * np.dtype(config.model.dtype).itemsize
    return 2 * 2 * config.moe_layers * per_direction


def measure(steps: int, timed_top_k: tuple[int, ...]) -> list[dict]:
    """Returns one row per top-k, expert count and dispatch; tokens/s only for `timed_top_k`, each next
    to its dense baseline (every feed-forward k x mlp_dim wide: the same active parameters) timed in the same run."""
    base = _config()
    tokens = base.train.global_batch * base.train.seq_len
    rows = []
    for top_k in TOP_KS:
        timed = steps if top_k in timed_top_k else 0
        dense = step_measurements(_config(f"model.mlp_dim={base.model.mlp_dim * top_k}"), timed)
        for experts in EXPERT_COUNTS:
            for dispatch in DISPATCHES:
                config = _config(*moe_overrides(experts, top_k, dispatch))
                rows.append(_row(config, step_measurements(config, timed), dense, tokens))
    return rows


def _row(config, measured: dict, dense: dict, tokens: int) -> dict:
    """Returns one MoE config's measurements next to its dense baseline's tokens/s (None when untimed)."""
    timed = measured["seconds"] is not None
    return {
        "experts": config.moe.num_experts,
        "top_k": config.moe.top_k,
        "dispatch": dispatch_of(config),
        "routing_share": routing_flop_share(config),
        "exchange_mib": measured["exchange_bytes"] / 2**20,
        "minimum_mib": minimum_exchange_bytes(config) / 2**20,
        "temporaries_mib": measured["temporaries_bytes"] / 2**20,
        "moe_tokens_per_s": tokens / measured["seconds"] if timed else None,
        "dense_tokens_per_s": tokens / dense["seconds"] if timed else None,
    }


def table(rows: list[dict]) -> str:
    """Returns the rows as a Markdown table."""
    lines = ["| experts | top-k | dispatch | routing+dispatch+combine FLOPs / expert FFN FLOPs | token exchange MiB/step "
             "| analytic minimum MiB | ratio | temporaries MiB/device | MoE tokens/s | dense (same active) tokens/s "
             "| MoE / dense |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        timed = r["moe_tokens_per_s"] is not None
        speed = (f"{r['moe_tokens_per_s']:,.0f} | {r['dense_tokens_per_s']:,.0f} | "
                 f"{r['moe_tokens_per_s'] / r['dense_tokens_per_s']:.2f}") if timed else "not timed | | "
        lines.append(f"| {r['experts']} | {r['top_k']} | {r['dispatch']} | {r['routing_share']:.1%} "
                     f"| {r['exchange_mib']:.2f} | {r['minimum_mib']:.2f} | {r['exchange_mib'] / r['minimum_mib']:.2f} "
                     f"| {r['temporaries_mib']:.1f} | {speed} |")
    return "\n".join(lines)


def main() -> None:
    """Runs the benchmark, prints the table and writes its section of docs/benchmarks.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed train steps per model")
    parser.add_argument("--timed-top-k", type=int, nargs="*", default=[2],
                        help="the top-k values whose steps are timed (the others: compile-only columns)")
    args = parser.parse_args()

    from orchestrator.runtime import configure_jax

    configure_jax(_config())
    import jax

    rows = measure(args.steps, tuple(args.timed_top_k))
    device = jax.devices()[0]
    command = COMMAND + (f" --steps {args.steps}" if args.steps != 10 else "")
    setup = (f"Model: {' '.join(MODEL)}; an MoE feed-forward in every layer (experts mlp_dim wide), capacity_factor "
             f"1.25 for einsum and sort, one group per sequence; mesh expert={DEVICES} ({DEVICES} simulated "
             f"{device.platform} devices); tokens/s at top-k {', '.join(map(str, args.timed_top_k))}: median of "
             f"{args.steps} steps after one warm-up; jax {jax.__version__}.")
    text = "\n".join(["## MoE (GShard routing; einsum, sort and dropless dispatch)", "", f"Command: `{command}`", "",
                      setup, "", table(rows), "", READING, ""])
    print(text)
    write_section("moe", text)


if __name__ == "__main__":
    main()
