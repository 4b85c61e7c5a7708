"""Orchestration overhead: nestor's train step against a bare `jax.jit` step of the same model.

The model (issue 12's CPU comparison): embed 256, 4 heads x 64, SwiGLU 1024,
4 layers, vocab 1024, seq 256, global batch 8, bfloat16 activations, float32
weights, on 8 simulated CPU devices over three meshes.

What the bare step is: the same transformer written here in plain jax
(embedding, RMSNorm, RoPE, `jax.nn.dot_product_attention`, SwiGLU, a
`lax.scan` over the stacked layers, float32 logits and cross-entropy; its
matmuls, attention and SwiGLU are the ops the backend installs for nestor's
model (models.ops), so that on CPU both sum in float32 and round once),
`jax.value_and_grad`, and the same optax chain (clip + AdamW on the same
schedule) applied to the same parameter tree, jitted with the same parameter
shardings and the batch split over the data-parallel axes. It has none of
nestor's layer: no NNX module, no activation constraints but one (the
residual stream keeps the batch split between layers; without it GSPMD lays
the residual out like the fsdp-split weights and the step runs ~3x slower),
no remat tags, no metrics beyond the loss, no data pipeline (its batches are
built before timing). On the pipeline mesh the bare step runs the same GPipe
schedule written plainly (`_bare_gpipe`: stages as a vmapped dimension, a
`jnp.roll` between ticks, M + S - 1 ticks, every stage working on every
tick); an earlier bare step used the pipeline axis for data parallelism instead
and did 1/1.29 of the FLOPs, which made nestor's pipeline look 1.54x slower.
nestor's step on CPU skips its bubble stages' work and the bare step does not,
so on the pipeline mesh the ratio is not orchestration overhead alone.

nestor's side is timed as its training loop runs a step: the batch built by
its data pipeline, then the compiled step, every metric returned.

    python -m bench.step --rounds 8 --steps 1   # prints the table, writes its section of docs/benchmarks.md
    python -m bench.step --programs             # compile only: XLA's FLOPs, bytes, temporaries, collectives

Timing alternates: each round runs `--steps` steps of one side then of the
other (the order flips every round), blocking at the end of each run, and
the ratio is the median over rounds of nestor / bare.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections import Counter

from nestor.cluster.cpu_devices import simulate_cpu_devices_before_import

MESHES = {
    "fsdp8": {"mesh.fsdp": 8},
    "fsdp4 x tensor2": {"mesh.fsdp": 4, "mesh.tensor": 2},
    "pipeline2 x fsdp2 x tensor2": {"mesh.pipeline": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
}
MODEL = ("model.embed_dim=256", "model.num_heads=4", "model.num_kv_heads=4", "model.head_dim=64",
         "model.mlp_dim=1024", "model.num_layers=4", "model.vocab_size=1024", "model.dtype=bfloat16",
         "train.seq_len=256", "train.global_batch=8", "pipeline.microbatches=4", "model.remat=none",
         "cluster.devices_per_host=8", "run.dir=/tmp/nestor-bench-step")  # no remat: as the bare step
READING = (
    "Bare: the same transformer, loss and optax chain in plain jax, jitted with the same parameter shardings and "
    "the residual stream pinned to the batch split between layers; no NNX module, no activation constraints "
    "inside the layer, no metrics but the loss, batches built before timing (the module docstring of "
    "`bench/step.py` has the details). On the pipeline mesh the bare step runs the same GPipe schedule "
    "(4 micro-batches, 2 stages) written plainly, every stage working on every tick, bubble included: "
    "(M + S - 1) / M = 1.25 of the work. nestor's step on CPU skips its bubble stages' work (README, "
    "Pipeline), so on that mesh the ratio counts this too and is not the orchestration's overhead alone. The "
    "interquartile range of the per-round ratios shows the noise of the shared host."
)


def bench_config(mesh: dict[str, int], *overrides: str):
    """Returns the benchmark's config on `mesh` (mesh.<axis> -> degree, the other axes 1)."""
    from nestor.orchestrator.loader.config import load

    degrees = {f"mesh.{axis}": 1 for axis in ("pipeline", "data", "fsdp", "expert", "tensor")} | mesh
    return load(None, [*MODEL, *(f"{key}={value}" for key, value in degrees.items()), *overrides])


def _rms_norm(x, scale, eps):
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * scale).astype(x.dtype)


def _bare_layer(cfg, pin):
    """Returns layer(x, p) -> (x, None): one transformer block of the bare model, `pin` applied to its output."""
    from nestor.models import ops
    from nestor.models.transformer import rotary

    dtype = cfg.compute_dtype

    def project(equation, x, weight):
        return ops.einsum(equation, x, weight.astype(dtype))

    def layer(x, p):
        attention, mlp = p["attention"], p["mlp"]
        h = _rms_norm(x, p["attention_norm"]["scale"], cfg.norm_eps)
        q, k, v = (project("btd,dhk->bthk", h, attention[name]) for name in ("query", "key", "value"))
        q, k = rotary(q, cfg.rope_theta), rotary(k, cfg.rope_theta)
        context = ops.attention(q, k, v)
        x = x + project("bthk,hkd->btd", context, attention["out"])
        h = _rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps)
        hidden = ops.swiglu(project("...d,dm->...m", h, mlp["gate"]), project("...d,dm->...m", h, mlp["up"]))
        return pin(x + project("...m,md->...d", hidden, mlp["down"])), None

    return layer


def _bare_gpipe(layer, blocks, x, stages: int, microbatches: int, state_sharding):
    """Returns the stack's output [batch, length, embed] run as GPipe in plain jax: `blocks` [layers, ...]
    viewed as [stages, layers/stages, ...], the batch split into `microbatches` (row r in micro-batch
    r % M), M + S - 1 ticks in which every stage runs its layers on what the previous stage sent it
    (`jnp.roll` over the stage-sharded state: a collective-permute), stage 0 reading the next
    micro-batch and the last stage's results written back in its place."""
    import jax
    import jax.numpy as jnp

    blocks = jax.tree.map(lambda leaf: leaf.reshape(stages, leaf.shape[0] // stages, *leaf.shape[1:]), blocks)
    batch = x.shape[0]
    buffer = x.reshape(batch // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)  # [M, mb, length, embed]
    run_stages = jax.vmap(lambda stage_blocks, h: jax.lax.scan(layer, h, stage_blocks)[0],
                          spmd_axis_name=state_sharding.spec[0])
    first = jnp.arange(stages)[:, None, None, None] == 0

    def tick(carry, t):
        state, buffer = carry  # state [S, mb, length, embed]: each stage's last output
        incoming = jnp.where(first, buffer[t % microbatches][None], jnp.roll(state, 1, 0))
        state = jax.lax.with_sharding_constraint(run_stages(blocks, incoming), state_sharding)
        done = t - (stages - 1)  # the micro-batch the last stage just finished
        buffer = buffer.at[done % microbatches].set(jnp.where(done >= 0, state[-1], buffer[done % microbatches]))
        return (state, buffer), None

    state = jnp.zeros((stages, *buffer.shape[1:]), x.dtype)
    (_, buffer), _ = jax.lax.scan(tick, (state, buffer), jnp.arange(microbatches + stages - 1))
    return buffer.swapaxes(0, 1).reshape(x.shape)  # [batch, length, embed]


def bare_loss(params: dict, tokens, cfg, residual=None, pipeline=None):
    """Returns the mean next-token cross-entropy of the model in plain jax; `params` is nestor's
    parameter tree (layers stacked), `cfg` a models.transformer.TransformerConfig, `residual` the
    sharding the residual stream [batch, length, embed] is pinned to between layers (None: free),
    `pipeline` None for a scan over the layers, else (stages, microbatches, state sharding) for GPipe."""
    import jax
    import jax.numpy as jnp
    import optax

    from nestor.models import ops

    dtype = cfg.compute_dtype
    pin = (lambda x: x) if residual is None else (lambda x: jax.lax.with_sharding_constraint(x, residual))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    layer = _bare_layer(cfg, pin)
    x = pin(params["embedding"][inputs].astype(dtype))
    if pipeline is None:
        x, _ = jax.lax.scan(layer, x, params["blocks"])
    else:
        x = pin(_bare_gpipe(layer, params["blocks"], x, *pipeline))
    x = _rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps)
    logits = ops.einsum("btd,dv->btv", x, params["unembedding"].astype(dtype), jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def make_bare_step(config, job):
    """Returns (step(state, tokens) -> (state, loss), state sharding, batch sharding): the bare
    jitted step over nestor's state layout and shardings; on a pipeline mesh it runs GPipe with
    nestor's `pipeline.microbatches` (`_bare_gpipe`), the batch split over data and fsdp."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from nestor.models import ops
    from nestor.orchestrator.specs.lm import lm_config

    cfg = lm_config(config)
    model_ops = job.backend.compiled_here().ops()
    optimizer = job.layout.optimizer
    batch_axes = tuple(axis for axis in ("data", "fsdp") if job.mesh.shape[axis] > 1) or None
    batch = NamedSharding(job.mesh, PartitionSpec(batch_axes))
    residual = NamedSharding(job.mesh, PartitionSpec(batch_axes, None, None))
    stages = job.mesh.shape["pipeline"]
    pipeline = None if stages == 1 else (
        stages, config.pipeline.microbatches, NamedSharding(job.mesh, PartitionSpec("pipeline", batch_axes, None, None)))

    def step(state, tokens):
        with ops.installed(model_ops):
            loss, grads = jax.value_and_grad(bare_loss)(state["params"], tokens, cfg, residual, pipeline)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, loss

    shardings = job.layout.shardings
    jitted = jax.jit(step, in_shardings=(shardings, batch),
                     out_shardings=(shardings, NamedSharding(job.mesh, PartitionSpec())), donate_argnums=0)
    return jitted, shardings, batch


def program(compiled) -> dict:
    """Returns what XLA compiled for one step, per device: FLOPs (loop bodies once per iteration), bytes
    accessed (loop bodies once), temporaries, collectives per step by kind (parallel.hlo), and how many
    copy, transpose and convert instructions the program text holds."""
    from nestor.parallel.hlo import collectives, flops_per_run

    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    opcodes = Counter(re.findall(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w-]*)\(", text))
    return {"flops": flops_per_run(text, cost["flops"]), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "collectives": {kind: c["count"] for kind, c in collectives(text).items() if c["count"]},
            **{opcode: opcodes[opcode] for opcode in ("copy", "transpose", "convert")}}


def compiled_programs(mesh: dict[str, int], *overrides: str) -> dict[str, dict]:
    """Returns the `program` of nestor's and of the bare step, compiled for abstract inputs on `mesh`
    (nothing run); `overrides` change the model (tests)."""
    import jax
    import numpy as np

    from nestor.orchestrator.commands.explain import compile_step
    from nestor.orchestrator.job.build import build_job
    from nestor.orchestrator.job.processes import enable_compile_cache

    config = bench_config(mesh, *overrides)
    enable_compile_cache(config)
    job = build_job(config)
    bare, shardings, batch = make_bare_step(config, job)
    abstract = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                            job.layout.abstract, shardings)
    tokens = jax.ShapeDtypeStruct(job.data.fields["tokens"].shape, np.int32, sharding=batch)
    return {"nestor": program(compile_step(job)), "bare": program(bare.lower(abstract, tokens).compile())}


def _time(run, steps: int) -> float:
    import jax

    start = time.perf_counter()
    out = None
    for step in range(steps):
        out = run(step)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def measure(mesh: dict[str, int], rounds: int, steps: int) -> dict:
    """Returns medians over `rounds` alternating rounds: nestor's and the bare step's seconds per step,
    the ratio nestor / bare per round (median, and its quartiles) on `mesh`."""
    import jax

    from nestor.orchestrator.job.build import build_job
    from nestor.orchestrator.job.processes import enable_compile_cache
    from nestor.orchestrator.job.state import init_state

    config = bench_config(mesh)
    enable_compile_cache(config)
    job = build_job(config)
    nestor_state = init_state(config, job.layout)
    nestor_step = job.step_fn.lower(nestor_state, job.data.batch(0)).compile()
    bare_step, bare_shardings, bare_batch = make_bare_step(config, job)
    bare_state = jax.device_put(init_state(config, job.layout), bare_shardings)
    batches = [jax.device_put(job.data.batch(step)["tokens"], bare_batch) for step in range(steps)]
    bare_step = bare_step.lower(bare_state, batches[0]).compile()
    state = {"nestor": nestor_state, "bare": bare_state}

    def run_nestor(step):
        state["nestor"], metrics = nestor_step(state["nestor"], job.data.batch(step))
        return metrics

    def run_bare(step):
        state["bare"], loss = bare_step(state["bare"], batches[step % steps])
        return loss

    _time(run_nestor, 2), _time(run_bare, 2)  # warm-up
    times = {"nestor": [], "bare": []}
    for index in range(rounds):
        if index:
            print(f"round {index}: nestor / bare {times['nestor'][-1] / times['bare'][-1]:.3f}", file=sys.stderr,
                  flush=True)
        order = (("nestor", run_nestor), ("bare", run_bare))
        for name, run in order if index % 2 == 0 else order[::-1]:
            times[name].append(_time(run, steps))
    return {"nestor_ms": 1e3 * statistics.median(times["nestor"]), "bare_ms": 1e3 * statistics.median(times["bare"]),
            **round_ratios(times["nestor"], times["bare"])}


def round_ratios(numerators: list[float], denominators: list[float]) -> dict[str, float]:
    """Returns the median of the per-round ratios numerator / denominator ("ratio") and their quartiles
    ("q1", "q3"); two rounds or more."""
    ratios = sorted(a / b for a, b in zip(numerators, denominators))
    quartiles = statistics.quantiles(ratios, n=4)
    return {"ratio": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2]}


def table(rows: dict[str, dict]) -> str:
    """Returns the measurements as a Markdown table, one row per mesh."""
    lines = ["| mesh | nestor ms/step | bare jax.jit ms/step | nestor / bare (median) | interquartile range |",
             "| --- | ---: | ---: | ---: | --- |"]
    for mesh, r in rows.items():
        lines.append(f"| {mesh} | {r['nestor_ms']:.1f} | {r['bare_ms']:.1f} | {r['ratio']:.3f} "
                     f"| {r['q1']:.3f}-{r['q3']:.3f} |")
    return "\n".join(lines)


def programs_table(programs: dict[str, dict[str, dict]]) -> str:
    """Returns the compiled programs (`compiled_programs` per mesh) as a Markdown table, one row per mesh."""
    lines = ["| mesh | FLOPs nestor / bare | bytes accessed nestor / bare | temporaries MiB nestor / bare "
             "| collectives per step nestor; bare | copy / transpose / convert nestor; bare |",
             "| --- | ---: | ---: | ---: | --- | --- |"]

    def counted(kinds: dict[str, int]) -> str:
        return ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items()))

    def ops(program: dict) -> str:
        return f"{program['copy']} / {program['transpose']} / {program['convert']}"

    for mesh, sides in programs.items():
        nestor, bare = sides["nestor"], sides["bare"]
        lines.append(f"| {mesh} | {nestor['flops'] / bare['flops']:.4f} "
                     f"| {nestor['bytes_accessed'] / bare['bytes_accessed']:.3f} "
                     f"| {nestor['temp_bytes'] / 2**20:.1f} / {bare['temp_bytes'] / 2**20:.1f} "
                     f"| {counted(nestor['collectives'])}; {counted(bare['collectives'])} "
                     f"| {ops(nestor)}; {ops(bare)} |")
    return "\n".join(lines)


def _rounds(text: str) -> int:
    rounds = int(text)
    if rounds < 2:
        raise argparse.ArgumentTypeError(f"{rounds}: the interquartile range needs 2 rounds or more")
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=_rounds, default=8, help="alternating rounds per mesh (2 or more: the "
                                                                 "quartiles of the ratio need two)")
    parser.add_argument("--steps", type=int, default=1, help="steps per side per round")
    parser.add_argument("--meshes", nargs="*", default=list(MESHES), choices=list(MESHES))
    parser.add_argument("--programs", action="store_true",
                        help="compare the compiled programs (FLOPs, bytes, temporaries, collectives) instead of timing")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    simulate_cpu_devices_before_import(8)
    if args.programs:
        programs = {}
        for mesh in args.meshes:
            programs[mesh] = compiled_programs(MESHES[mesh])
        print(programs_table(programs))
        if not args.no_write:
            from bench.report import write_section

            write_section("step-programs", programs_section(programs))
        return
    rows = {}
    for mesh in args.meshes:
        rows[mesh] = measure(MESHES[mesh], args.rounds, args.steps)
        print(mesh, rows[mesh], flush=True)
    print(table(rows))
    if not args.no_write:
        from bench.report import write_section

        write_section("step", section(rows, args))


def section(rows: dict[str, dict], args) -> str:
    """Returns the docs/benchmarks.md section for the measured rows."""
    import jax

    model = " ".join(MODEL[:-2])
    command = f"python -m bench.step --rounds {args.rounds} --steps {args.steps}"
    return (f"## Step time on CPU\n\nCommand: `{command}` (8 simulated {jax.devices()[0].platform} devices on a "
            f"shared 2-core host, jax {jax.__version__}; {args.rounds} alternating rounds of {args.steps} step(s) "
            f"per side per mesh).\n\nModel: {model}; float32 weights.\n\n{table(rows)}\n\n{READING}")


def programs_section(programs: dict[str, dict[str, dict]]) -> str:
    """Returns the docs/benchmarks.md section for the compared programs."""
    import jax

    return (f"### What nestor's step adds, from the compiled programs\n\nCommand: `python -m bench.step --programs` "
            f"(jax {jax.__version__}): both steps compiled for abstract inputs on each mesh, nothing run; XLA's "
            "accounting per device (FLOPs counted once per loop iteration, bytes accessed with loop bodies once; "
            "copy, transpose and convert instructions counted in the program text).\n\n"
            f"{programs_table(programs)}")


if __name__ == "__main__":
    main()
