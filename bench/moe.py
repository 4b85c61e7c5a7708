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
  a grouped GEMM multiplies (Hopper's Mosaic GPU kernels, XLA:TPU), each row by
  its own expert; XLA:CPU and XLA:GPU expand ragged_dot to every row times every expert;
- token-exchange bytes of one train step over all devices (compiled HLO on an
  expert mesh: all-to-all for the capacity dispatches, all-gather +
  reduce-scatter for dropless), against the analytic minimum: every routed
  token's embedding sent to its expert and back (tokens x k x embed x bytes,
  twice), forward and backward;
- temporaries per device (XLA's memory analysis of the train step);
- tokens/s of the MoE train step against a dense model with the same active
  parameters (every layer's feed-forward k x mlp_dim wide), same mesh and
  batch, timed in the same run, alternately: each round steps the dense model
  and every MoE row of its top-k once.

    python -m bench.moe       # prints the table, writes its section of docs/benchmarks.md
    python -m bench.moe --experts 8,32 --top-k 2 --rounds 5   # fewer rows and rounds
    python -m bench.moe --rounds 0                            # compile-only columns

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
    "token to every expert device, about expert devices / k times the minimum (parallel/experts.py; on GPU and "
    "TPU `moe.exchange=auto` picks the ragged all-to-all, which moves only the routed rows, the minimum, and "
    "cannot be measured on CPU). Its worst-case buffer of "
    "gathered tokens x k rows is what its temporaries show. Dropless tokens/s on CPU pays XLA:CPU's ragged_dot, "
    "which multiplies every row by every local expert; a grouped GEMM (Hopper's kernels, XLA:TPU) multiplies each row once. "
    "Tokens/s on shared simulated CPU devices is indicative only, and absolute values move with whatever else "
    "the host runs: compare rows of one run."
)


def _config(*overrides: str):
    from nestor.orchestrator.loader.config import load

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
    group's weights: the FLOPs of a grouped GEMM (each row times its own expert's weights once), in a
    program XLA:CPU's cost analysis counts (its own ragged_dot multiplies every row by every group).
    Only for counting: the values are not the model's."""
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

    from nestor.models.moe import expert_capacity, grouped_swiglu
    from nestor.models.transformer import moe_feed_forward
    from nestor.orchestrator.job.compiled import cost_flops
    from nestor.orchestrator.specs.lm import lm_config

    cfg = lm_config(config)
    moe = cfg.moe
    layer = nnx.eval_shape(lambda: moe_feed_forward(cfg, nnx.Rngs(params=0)))
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


def compiled_step(config) -> dict:
    """Returns the train step compiled for `config` with its token-exchange bytes (all-to-all,
    all-gather, reduce-scatter; all devices) and temporaries per device, ready to time."""
    from nestor.orchestrator.commands.explain import compile_step
    from nestor.orchestrator.job.build import build_job
    from nestor.parallel.hlo import collectives

    job = build_job(config)
    compiled = compile_step(job)
    found = collectives(compiled.as_text())
    return {"config": config, "job": job, "compiled": compiled, "seconds": None,
            "exchange_bytes": sum(found[kind]["bytes"] for kind in EXCHANGES) * job.mesh.devices.size,
            "temporaries_bytes": compiled.memory_analysis().temp_size_in_bytes}


def time_alternately(steps: dict[str, dict], rounds: int) -> None:
    """Sets each entry's "times" to its step times of `rounds` rounds after one warm-up round, every round
    stepping each entry once in turn, so a change of the host's load reaches all alike, and "seconds" to
    their median."""
    import jax

    from nestor.orchestrator.job.state import init_state

    states = {name: init_state(entry["config"], entry["job"].layout) for name, entry in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in range(rounds + 1):
        for name, entry in steps.items():
            start = time.perf_counter()
            states[name], metrics = entry["compiled"](states[name], entry["job"].data.batch(step))
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - start)
    for name, entry in steps.items():
        entry["times"] = times[name][1:]
        entry["seconds"] = statistics.median(entry["times"])


def minimum_exchange_bytes(config) -> int:
    """Returns tokens x k x embed x bytes, twice (dispatch, combine), forward and backward, per MoE layer."""
    import numpy as np

    tokens = config.train.global_batch * config.train.seq_len
    per_direction = tokens * config.moe.top_k * config.model.embed_dim * np.dtype(config.model.dtype).itemsize
    return 2 * 2 * config.moe_layers * per_direction


def measure(experts: tuple[int, ...], top_ks: tuple[int, ...], dispatches: tuple[str, ...],
            rounds: int) -> list[dict]:
    """Returns one row per top-k, expert count and dispatch; with `rounds` > 0 also tokens/s, timed
    alternately (`time_alternately`) with a dense baseline of the same top-k (every feed-forward
    k x mlp_dim wide: the same active parameters), one top-k at a time."""
    base = _config()
    tokens = base.train.global_batch * base.train.seq_len
    rows = []
    for top_k in top_ks:
        steps = {"dense": compiled_step(_config(f"model.mlp_dim={base.model.mlp_dim * top_k}"))}
        for count in experts:
            for dispatch in dispatches:
                steps[f"{count}/{dispatch}"] = compiled_step(_config(*moe_overrides(count, top_k, dispatch)))
        if rounds:
            time_alternately(steps, rounds)
        dense = steps.pop("dense")
        rows += [_row(entry["config"], entry, dense, steps.get(f"{entry['config'].moe.num_experts}/einsum"), tokens)
                 for entry in steps.values()]
    return rows


def paired_speedup(measured: dict, baseline: dict | None) -> float | None:
    """Returns the median over rounds of baseline step time / measured step time (> 1: measured is faster),
    None when either was not timed."""
    if baseline is None or measured["seconds"] is None:
        return None
    return statistics.median(base / time for base, time in zip(baseline["times"], measured["times"]))


def _row(config, measured: dict, dense: dict, einsum: dict | None, tokens: int) -> dict:
    """Returns one MoE config's measurements next to its dense baseline's tokens/s and, paired round by
    round, its speed against the dense model and against einsum dispatch (None when untimed)."""
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
        "over_dense": paired_speedup(measured, dense),
        "over_einsum": paired_speedup(measured, einsum),
    }


def table(rows: list[dict]) -> str:
    """Returns the rows as a Markdown table."""
    lines = ["| experts | top-k | dispatch | routing+dispatch+combine FLOPs / expert FFN FLOPs | token exchange MiB/step "
             "| analytic minimum MiB | ratio | temporaries MiB/device | MoE tokens/s | dense (same active) tokens/s "
             "| MoE / dense | vs einsum |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        timed = r["moe_tokens_per_s"] is not None
        versus = "" if r["over_einsum"] is None else f"{r['over_einsum']:.2f}"
        speed = (f"{r['moe_tokens_per_s']:,.0f} | {r['dense_tokens_per_s']:,.0f} | "
                 f"{r['over_dense']:.2f} | {versus}") if timed else "not timed | | | "
        lines.append(f"| {r['experts']} | {r['top_k']} | {r['dispatch']} | {r['routing_share']:.1%} "
                     f"| {r['exchange_mib']:.2f} | {r['minimum_mib']:.2f} | {r['exchange_mib'] / r['minimum_mib']:.2f} "
                     f"| {r['temporaries_mib']:.1f} | {speed} |")
    return "\n".join(lines)


def _choices(text: str, allowed: tuple) -> tuple:
    """Returns the comma-separated `text` as a tuple of `allowed`'s type; raises ArgumentTypeError
    for a value not in `allowed`."""
    values = tuple(type(allowed[0])(value) for value in text.split(","))
    if unknown := [value for value in values if value not in allowed]:
        raise argparse.ArgumentTypeError(f"{unknown} not in {allowed}")
    return values


def main() -> None:
    """Runs the benchmark, prints the table and writes its section of docs/benchmarks.md (not with --no-write)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10,
                        help="timed rounds (each steps every model once) after one warm-up round; 0 = compile only")
    parser.add_argument("--experts", type=lambda text: _choices(text, EXPERT_COUNTS), default=EXPERT_COUNTS,
                        help="comma-separated expert counts, e.g. 8,32")
    parser.add_argument("--top-k", type=lambda text: _choices(text, TOP_KS), default=TOP_KS,
                        help="comma-separated top-k values, e.g. 2")
    parser.add_argument("--dispatches", type=lambda text: _choices(text, DISPATCHES), default=DISPATCHES,
                        help="comma-separated dispatches, e.g. einsum,sort")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()

    from nestor.orchestrator.job.processes import configure_jax

    configure_jax(_config())
    import jax

    rows = measure(args.experts, args.top_k, args.dispatches, args.rounds)
    device = jax.devices()[0]
    flags = {"--rounds": (args.rounds, 10), "--experts": (args.experts, EXPERT_COUNTS),
             "--top-k": (args.top_k, TOP_KS), "--dispatches": (args.dispatches, DISPATCHES)}
    command = " ".join([COMMAND] + [f"{flag} {value if isinstance(value, int) else ','.join(map(str, value))}"
                                    for flag, (value, default) in flags.items() if value != default])
    timing = (f"tokens/s: median of {args.rounds} rounds after one warm-up round, each round stepping the dense "
              f"baseline and every MoE row of its top-k once in turn; MoE / dense and vs einsum: medians of the "
              f"per-round tokens/s ratios" if args.rounds else "not timed")
    setup = (f"Model: {' '.join(MODEL)}; an MoE feed-forward in every layer (experts mlp_dim wide), capacity_factor "
             f"1.25 for einsum and sort, one group per sequence; mesh expert={DEVICES} ({DEVICES} simulated "
             f"{device.platform} devices); {timing}; jax {jax.__version__}.")
    text = "\n".join(["## MoE (GShard routing; einsum, sort and dropless dispatch)", "", f"Command: `{command}`", "",
                      setup, "", table(rows), "", READING, ""])
    print(text)
    if not args.no_write:
        write_section("moe", text)


if __name__ == "__main__":
    main()
