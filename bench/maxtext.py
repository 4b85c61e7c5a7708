"""nestor's train step against MaxText's on the same model and mesh, timed alternately in one run.

The model is issue 12's CPU comparison (bench/step.py's): embed 256, 4 heads x 64, SwiGLU 1024, 4 layers,
vocab 1024, seq 256, global batch 8, bfloat16 activations, float32 weights, AdamW with gradient clipping at
1.0, dot-product attention, on 8 simulated CPU devices over fsdp8, fsdp4 x tensor2 and pipeline2 x fsdp2 x
tensor2 (4 microbatches; MaxText with 2 layers per stage, so one pass as in GPipe, not its circular schedule).
`--pipeline-repeats 2` runs both sides' circular schedules instead (MaxText 1 layer per stage, 2 repeats;
nestor `pipeline.repeats=2`), and `--nestor-schedule` times nestor's other schedules (e.g. interleaved_1f1b)
on the pipeline mesh, each with every `--nestor-remat` policy.

MaxText needs Python >= 3.12 and jax >= 0.11, nestor's own environment has jax 0.10, so each framework runs
in a long-lived worker process of its own (`--serve`), started by this driver, compiled and warmed before
timing. The driver then asks the workers in turn for `--steps` timed steps each (the order rotates every
round) and reports the median over `--rounds` of nestor / MaxText. Each worker times what its training
loop does per step: load the batch from its data pipeline, run the compiled step, and it blocks on the
result at the end of its steps.

Install MaxText into its own environment (nestor runs there too, so both sides share one jax):

    python3.12 -m venv /tmp/mtvenv
    /tmp/mtvenv/bin/pip install maxtext==0.2.5 jax==0.11.2 jaxlib==0.11.2 pathwaysutils jinja2 qwix tokamax \\
        huggingface-hub transformers drjax pillow sympy omegaconf aqtp grain tiktoken sentencepiece ml-collections
    /tmp/mtvenv/bin/pip install -e .          # nestor's own dependencies (flax, optax, orbax, ray, ...)
    /tmp/mtvenv/bin/python -m bench.maxtext --maxtext-python /tmp/mtvenv/bin/python --rounds 8 --steps 1

`--nestor-python` (default: the interpreter running this driver) picks the environment of nestor's worker.

What each side runs (each worker reports its resolved settings, printed with the results; the workers'
stderr is kept in `--log-dir`): MaxText's
`decoder_block=llama2` (RMSNorm, RoPE, SwiGLU), `attention=dot_product`, `remat_policy=full` (its default,
recorded per row), synthetic data (no packing: MaxText ignores packing for synthetic data), no dropout,
no checkpointing, its `adamw` with weight decay 0.1 and clipping at 1.0; nestor at each `--nestor-remat`
policy (by default `dots`, its fastest here, and `full`, MaxText's), its AdamW with clipping at 1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.step import round_ratios
from nestor.cluster.cpu_devices import cpu_pool_threads

MARK = "@@bench "
MAXTEXT_MODEL = ("hardware=cpu", "dataset_type=synthetic", "attention=dot_product", "decoder_block=llama2",
                 "base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=64",
                 "base_mlp_dim=1024", "base_num_decoder_layers=4", "vocab_size=1024", "max_target_length=256",
                 "per_device_batch_size=1", "dtype=bfloat16", "weight_dtype=float32", "opt_type=adamw",
                 "gradient_clipping_threshold=1.0", "enable_checkpointing=false", "steps=1000000",
                 "base_output_directory=/tmp/nestor-bench-maxtext", "run_name=bench", "enable_dropout=false",
                 "skip_jax_distributed_system=true")
MAXTEXT_MESHES = {
    "fsdp8": ("ici_fsdp_parallelism=8",),
    "fsdp4 x tensor2": ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
    "pipeline2 x fsdp2 x tensor2": ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2",
                                    "ici_tensor_parallelism=2", "num_pipeline_microbatches=4",
                                    "num_layers_per_pipeline_stage=2"),
}
REPOSITORY = Path(__file__).resolve().parent.parent
READING = (
    "MaxText runs its llama2 decoder block (RMSNorm, RoPE, SwiGLU) with its default `remat_policy=full`, "
    "dot-product attention, synthetic data (no packing) and its AdamW (weight decay 0.1, clipping at 1.0); "
    "nestor runs the same model at each `model.remat` listed, with its AdamW and clipping at 1.0. Each side "
    "loads its batch from its own data pipeline every step and is timed to the end of its last step. The "
    "ratio is the median over rounds of that round's nestor / MaxText; the interquartile range of the "
    "per-round ratios shows the noise of the shared host."
)


def nestor_runner(mesh: str, remat: str, schedule: str = "gpipe", repeats: str = "1"):
    """Returns (run(step) -> metrics, settings, compiled step): nestor's step on `mesh` with
    `model.remat=remat` (and, on a pipeline mesh, `pipeline.schedule=schedule` over `repeats` layer groups
    per stage), each call building the step's batch from nestor's data pipeline as its loop does."""
    import jax

    from bench.step import MESHES, bench_config
    from nestor.orchestrator.job.build import build_job
    from nestor.orchestrator.job.state import init_state

    pipelined = [f"pipeline.schedule={schedule}", f"pipeline.repeats={repeats}"] if "pipeline" in mesh else []
    config = bench_config(MESHES[mesh], f"model.remat={remat}", *pipelined)
    job = build_job(config)
    state = {"state": init_state(config, job.layout)}
    compiled = job.step_fn.lower(state["state"], job.data.batch(0)).compile()

    def run(step):
        state["state"], metrics = compiled(state["state"], job.data.batch(step))
        return metrics

    settings = {"remat": job.backend.remat, "attention": job.backend.report()["attention"], "dtype": config.model.dtype,
                "schedule": config.pipeline.schedule, "repeats": config.pipeline.repeats, "jax": jax.__version__}
    return run, settings, compiled


def maxtext_arguments(mesh: str, repeats: int) -> tuple[str, ...]:
    """Returns MaxText's mesh arguments for `mesh`; on a pipeline mesh with `repeats` > 1, its circular
    schedule (num_pipeline_repeats is the layers over stages x layers per stage)."""
    arguments = MAXTEXT_MESHES[mesh]
    if repeats == 1 or "pipeline" not in mesh:
        return arguments
    settings = dict(argument.split("=", 1) for argument in MAXTEXT_MODEL + arguments)
    per_stage = int(settings["base_num_decoder_layers"]) // (int(settings["ici_pipeline_parallelism"]) * repeats)
    return tuple(argument for argument in arguments if not argument.startswith("num_layers_per_pipeline_stage=")) + (
        f"num_layers_per_pipeline_stage={per_stage}",)


def maxtext_runner(mesh: str, repeats: str = "1"):
    """Returns (run(step) -> metrics, settings, compiled step): MaxText's train step on `mesh` (circular over
    `repeats` layer groups per stage on a pipeline mesh), each call loading the batch from MaxText's data
    loader as its training loop does (maxtext.trainers.pre_train.train)."""
    import jax
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.trainers.pre_train import train
    from maxtext.utils import sharding, train_utils
    from maxtext.version import __version__ as maxtext_version

    base = Path(train.__file__).resolve().parents[2] / "configs" / "base.yml"
    config, recorder = train.initialize(["maxtext", str(base), *MAXTEXT_MODEL, *maxtext_arguments(mesh, int(repeats))])
    (_, _, state_shardings, _, device_mesh, _, _, data_loader, rampup_manager, _,
     state) = train_utils.setup_train_loop(config, recorder)
    graph, state = nnx.split(state)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
    train_step, _ = train_utils.jit_train_and_eval_step(config, graph, device_mesh, state, state_shardings,
                                                        train.train_step, params_shardings=params_shardings)
    batch = data_loader.load_next_batch(rampup_manager=rampup_manager)
    with jax.set_mesh(device_mesh), logical_axis_rules(config.logical_axis_rules):
        compiled = train_step.lower(state, batch).compile()
    holder = {"state": state}

    def run(step):
        batch = data_loader.load_next_batch(rampup_manager=rampup_manager)
        with jax.set_mesh(device_mesh), logical_axis_rules(config.logical_axis_rules):
            holder["state"], metrics = compiled(holder["state"], batch)
        return metrics

    settings = {"remat": config.remat_policy, "attention": config.attention, "dtype": str(config.dtype),
                "weight_dtype": str(config.weight_dtype), "opt_type": str(config.opt_type),
                "scan_layers": config.scan_layers, "packing": config.packing,
                "pipeline_repeats": config.num_pipeline_repeats, "jax": jax.__version__,
                "version": maxtext_version}
    return run, settings, compiled


def serve(run, settings: dict, compiled) -> None:
    """Warms `run` up, says ready with `settings` and the `program` of `compiled`, then answers each line
    `K` on stdin with the seconds per step of K steps (blocking on the last step's result), until stdin closes."""
    import jax

    from bench.step import program

    jax.block_until_ready([run(step) for step in range(2)])
    print(MARK + json.dumps({"ready": settings, "program": program(compiled)}), flush=True)
    step = 2
    for line in sys.stdin:
        count = int(line)
        start = time.perf_counter()
        out = None
        for _ in range(count):
            out = run(step)
            step += 1
        jax.block_until_ready(out)
        print(MARK + json.dumps({"seconds": (time.perf_counter() - start) / count}), flush=True)


class Worker:
    """One framework's step loop in its own process, answering timing requests."""

    def __init__(self, name: str, python: str, arguments: list[str], log: Path, repository: Path = REPOSITORY,
                 xla_flags: str = ""):
        """Starts `python -m bench.maxtext --serve *arguments` in `repository` (a checkout of nestor), with
        `xla_flags` added to the 8 simulated devices' XLA_FLAGS."""
        self.name = name
        environment = dict(os.environ, PYTHONPATH=str(repository),
                           XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {xla_flags}".strip(),
                           PJRT_NPROC=cpu_pool_threads(8))
        self.log = log.open("w")
        self.process = subprocess.Popen([python, "-m", "bench.maxtext", "--serve", *arguments], cwd=repository,
                                        env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, text=True)

    def reply(self) -> dict:
        """Returns the worker's next message; raises RuntimeError if it exited first."""
        for line in self.process.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"{self.name} worker exited with {self.process.wait()}; see {self.log.name}")

    def time(self, steps: int) -> float:
        """Returns the worker's seconds per step over `steps` steps."""
        self.process.stdin.write(f"{steps}\n")
        self.process.stdin.flush()
        return self.reply()["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()
        self.log.close()


def measure(mesh: str, args) -> dict:
    """Returns, on `mesh`, each side's settings and median seconds per step, and per nestor policy the median
    over rounds of nestor / MaxText with its quartiles."""
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    slug = mesh.replace(" ", "")
    repeats = str(args.pipeline_repeats)
    workers = {"maxtext": Worker("maxtext", args.maxtext_python, ["maxtext", mesh, repeats],
                                 log_dir / f"maxtext-{slug}.log")}
    for variant, (remat, schedule) in variants(args).items():
        workers[f"nestor {variant}"] = Worker(f"nestor {variant}", args.nestor_python,
                                              ["nestor", mesh, remat, schedule, repeats],
                                              log_dir / f"nestor-{variant.replace(' ', '-')}-{slug}.log")
    ready, times = alternate(workers, args.rounds, args.steps, mesh)
    result = {"settings": {name: r["ready"] for name, r in ready.items()},
              "programs": {name: r["program"] for name, r in ready.items()},
              "seconds": {name: statistics.median(t) for name, t in times.items()}}
    for variant in variants(args):
        result[variant] = round_ratios(times[f"nestor {variant}"], times["maxtext"])
    return result


def alternate(workers: dict[str, Worker], rounds: int, steps: int, label: str) -> tuple[dict, dict[str, list[float]]]:
    """Returns (each worker's ready message, its seconds per step in each round): `rounds` rounds of `steps`
    steps per worker, the order rotating every round, progress on stderr under `label`; closes the workers."""
    try:
        ready = {name: worker.reply() for name, worker in workers.items()}
        times = {name: [] for name in workers}
        names = list(workers)
        for index in range(rounds):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(workers[name].time(steps))
            print(f"{label} round {index}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()),
                  file=sys.stderr, flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return ready, times


def variants(args) -> dict[str, tuple[str, str]]:
    """Returns nestor's timed variants, label -> (model.remat, pipeline.schedule): each policy, and with more
    than one schedule asked for, each policy under each (the schedule applies on pipeline meshes only)."""
    schedules = [schedule if args.pipeline_repeats == 1 or schedule != "gpipe" else "circular"
                 for schedule in args.nestor_schedule]
    if len(schedules) == 1 and schedules[0] == "gpipe":
        return {remat: (remat, "gpipe") for remat in args.nestor_remat}
    return {f"{remat} {schedule}": (remat, schedule) for remat in args.nestor_remat for schedule in schedules}


def table(rows: dict[str, dict], labels: list[str]) -> str:
    """Returns the measurements as a Markdown table, one row per mesh and nestor variant (`variants`)."""
    lines = ["| mesh | MaxText remat | MaxText ms/step | nestor remat | nestor ms/step | nestor / MaxText (median) "
             "| interquartile range |", "| --- | --- | ---: | --- | ---: | ---: | --- |"]
    for mesh, r in rows.items():
        maxtext = r["settings"]["maxtext"]
        circular = f", circular R={maxtext['pipeline_repeats']}" if maxtext.get("pipeline_repeats", 1) > 1 else ""
        for label in labels:
            ratio = r[label]
            lines.append(f"| {mesh} | {maxtext['remat']}{circular} | {1e3 * r['seconds']['maxtext']:.0f} "
                         f"| {label} | {1e3 * r['seconds'][f'nestor {label}']:.0f} | {ratio['ratio']:.3f} "
                         f"| {ratio['q1']:.3f}-{ratio['q3']:.3f} |")
    return "\n".join(lines)


def program_table(rows: dict[str, dict]) -> str:
    """Returns the compiled programs side by side as a Markdown table, one row per mesh and worker."""
    lines = ["| mesh | step | GFLOP/device | GB accessed | temporaries MiB | collectives per step "
             "| copy / transpose / convert |", "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for mesh, r in rows.items():
        for name, p in r["programs"].items():
            counts = ", ".join(f"{kind} {count}" for kind, count in p["collectives"].items())
            lines.append(f"| {mesh} | {name} | {p['flops'] / 1e9:.2f} | {p['bytes_accessed'] / 1e9:.2f} "
                         f"| {p['temp_bytes'] / 2**20:.1f} | {counts} | {p['copy']} / {p['transpose']} / {p['convert']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--maxtext-python", default="/tmp/mtvenv/bin/python",
                        help="interpreter of the environment MaxText is installed in")
    parser.add_argument("--nestor-python", default=sys.executable, help="interpreter of nestor's worker")
    parser.add_argument("--nestor-remat", nargs="+", default=["dots", "full"],
                        help="nestor's model.remat policies, each timed against MaxText (default: nestor's "
                             "fastest on CPU and MaxText's own)")
    parser.add_argument("--nestor-schedule", nargs="+", default=["gpipe"],
                        choices=["gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble"],
                        help="nestor's pipeline.schedule on pipeline meshes, each timed with every policy "
                             "(gpipe means circular when --pipeline-repeats > 1)")
    parser.add_argument("--pipeline-repeats", type=int, default=1,
                        help="layer groups per stage on pipeline meshes, on both sides: MaxText's circular "
                             "schedule (num_pipeline_repeats) and nestor's pipeline.repeats")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds per mesh")
    parser.add_argument("--steps", type=int, default=1, help="steps per side per round")
    parser.add_argument("--meshes", nargs="*", default=list(MAXTEXT_MESHES), choices=list(MAXTEXT_MESHES))
    parser.add_argument("--log-dir", default="/tmp/nestor-bench-maxtext/logs", help="the workers' stderr")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        side, mesh, *settings = args.serve
        serve(*(maxtext_runner(mesh, *settings) if side == "maxtext" else nestor_runner(mesh, *settings)))
        return
    rows = {}
    for mesh in args.meshes:
        rows[mesh] = measure(mesh, args)
        print(mesh, json.dumps(rows[mesh]), flush=True)
    print(table(rows, list(variants(args))))
    print(program_table(rows))
    if not args.no_write:
        from bench.report import write_section

        write_section("maxtext", section(rows, args))


def section(rows: dict[str, dict], args) -> str:
    """Returns the docs/benchmarks.md section for the measured rows."""
    settings = next(iter(rows.values()))["settings"]
    versions = ", ".join(f"{name} on jax {value['jax']}" for name, value in settings.items())
    command = (f"python -m bench.maxtext --rounds {args.rounds} --steps {args.steps} "
               f"--nestor-remat {' '.join(args.nestor_remat)}")
    if args.nestor_schedule != ["gpipe"] or args.pipeline_repeats > 1:
        command += f" --nestor-schedule {' '.join(args.nestor_schedule)} --pipeline-repeats {args.pipeline_repeats}"
    meshes = "; ".join(f"{mesh}: `{' '.join(maxtext_arguments(mesh, args.pipeline_repeats))}`" for mesh in rows)
    return (f"## Against MaxText on CPU\n\nCommand: `{command}` (8 simulated CPU devices on a shared 2-core host; "
            f"{versions}; {args.rounds} rounds of {args.steps} step(s) per worker per mesh, the order rotating "
            f"every round).\n\nMaxText {settings['maxtext']['version']}: `{' '.join(MAXTEXT_MODEL)}`; per mesh "
            f"{meshes}.\n\n{table(rows, list(variants(args)))}\n\n{READING}\n\nWhat XLA compiled for each step (per device; "
            f"FLOPs and collectives counted once per loop iteration, bytes accessed with loop bodies once):"
            f"\n\n{program_table(rows)}")


if __name__ == "__main__":
    main()
