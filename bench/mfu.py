"""Model FLOPs utilisation: tokens/s, TFLOP/s per device and MFU of real train steps, over remat policies
and attention implementations, for dense and MoE models, on whatever devices this process has.

Each row trains one config for `--steps` timed steps (after `--warmup` untimed ones) on all local
devices (`mesh.data=-1`), the steps dispatched back to back as the training loop does and timed to
the end of the last one. FLOPs are the analytic model FLOPs of `orchestrator/specs/lm_flops.py` (what MFU
credits: causal attention once, the routed experts only, no rematerialisation); the peak is the
device kind's dense peak (`orchestrator.loop.peak_flops.PEAK_TFLOPS`) or `--peak-tflops`. A CPU has no
peak: its MFU column says n/a. Accelerators train in bfloat16, a CPU in float32 (`--dtype` overrides).

    python -m bench.mfu                                    # accelerators: 1b and moe-1b; CPU: tiny dense and MoE
    python -m bench.mfu --model "1b train.seq_len=4096" --remat full dots --attention cudnn xla --steps 20
    python -m bench.mfu --write                            # also writes its section of docs/benchmarks.md

A model is a preset name followed by `key=value` overrides, one quoted string per `--model`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.profile_top import summary
from bench.report import write_section

PROFILED_STEPS = 2

TINY_MOE = "moe.num_experts=4 moe.every=2 moe.top_k=2"
DEFAULT_MODELS = {  # per platform: a dense and an MoE model
    "cpu": ("tiny train.global_batch=8 train.seq_len=128", f"tiny train.global_batch=8 train.seq_len=128 {TINY_MOE}"),
    "accelerator": ("1b train.global_batch=16 train.seq_len=2048", "moe-1b train.global_batch=16 train.seq_len=2048"),
}


def model_config(model: str, remat: str, attention: str, dtype: str, steps: int):
    """Returns the Config of one row: the model string's preset and overrides, the row's remat,
    attention and dtype, data parallel over every local device."""
    from nestor.orchestrator.loader.config import load

    preset, *overrides = model.split()
    return load(None, [f"model.preset={preset}", "cluster.devices_per_host=-1", "mesh.data=-1",
                       "data.source=synthetic", f"train.steps={steps}", f"model.dtype={dtype}",
                       f"run.dir={tempfile.gettempdir()}/nestor-bench-mfu", *overrides,
                       f"model.remat={remat}", f"model.attention={attention}"])


def measure(config, steps: int, warmup: int = 1, peak_override: float | None = None,
            profile_dir: str | None = None) -> dict:
    """Returns one row: seconds for `steps` steps after `warmup`, tokens/s, model TFLOP/s per device, MFU
    (None without a peak) and XLA's temporaries per device; with `profile_dir`, also "profile": the top
    device costs of PROFILED_STEPS more steps, traced there after the timed ones (the compiled program beside them,
    step.hlo.txt, names the kernels' fusions). Raises what building or compiling raises."""
    import jax

    from nestor.orchestrator.commands.explain import compile_step
    from nestor.orchestrator.loop.peak_flops import peak_tflops
    from nestor.orchestrator.specs.lm_flops import model_flops_per_step
    from nestor.orchestrator.job.build import build_job
    from nestor.orchestrator.job.state import init_state

    job = build_job(config)
    compiled = compile_step(job)
    state = init_state(config, job.layout)
    for step in range(warmup):
        state, metrics = compiled(state, job.data.batch(step))
    jax.block_until_ready(state)
    started = time.perf_counter()
    for step in range(warmup, warmup + steps):
        state, metrics = compiled(state, job.data.batch(step))
    jax.block_until_ready((state, metrics))
    seconds = time.perf_counter() - started
    profile = None
    if profile_dir:
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        (Path(profile_dir) / "step.hlo.txt").write_text(compiled.as_text())
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for step in range(warmup + steps, warmup + steps + PROFILED_STEPS):
                state, metrics = compiled(state, job.data.batch(step))
            jax.block_until_ready((state, metrics))
        profile = summary(profile_dir, PROFILED_STEPS)
    devices = job.mesh.devices.size
    flops = model_flops_per_step(config)
    tflops = flops * steps / seconds / devices / 1e12
    peak = peak_tflops(job.mesh.devices.flat[0].device_kind, config.model.dtype, peak_override)
    return {"seconds": seconds, "steps": steps, "devices": devices, "flops_per_step": flops,
            "tokens_per_s": config.train.global_batch * config.train.seq_len * steps / seconds,
            "tflops_per_device": tflops, "mfu": tflops / peak if peak else None,
            "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30, "profile": profile}


def rows(models: list[str], remats: list[str], attentions: list[str], dtype: str, steps: int, warmup: int,
         peak_override: float | None, report=print, profile_dir: str | None = None) -> list[dict]:
    """Returns a row per model x remat x attention; a config that fails (too big, no cuDNN) gets its
    error, on one line, instead of numbers. `report` receives each row as it is measured, then its
    profile's lines when `profile_dir` is given (each row traced into a numbered folder of it)."""
    import jax

    from nestor.backend import backend_of_devices
    from nestor.orchestrator.job.step import backend_request

    out = []
    for model in models:
        for remat in remats:
            for attention in attentions:
                row = {"model": model, "remat": remat, "attention": attention}
                row_profile = profile_dir and f"{profile_dir}/{len(out)}"
                try:
                    config = model_config(model, remat, attention, dtype, steps)
                    backend = backend_of_devices(backend_request(config), jax.devices())
                    row["attention_run"] = backend.report()["attention"]
                    row |= measure(config, steps, warmup, peak_override, row_profile)
                except Exception as error:  # a row that cannot run says why; the others still run
                    row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
                report(row_line(row))
                for line in row.get("profile") or ():
                    report(f"    {line}")
                out.append(row)
    return out


def row_line(row: dict) -> str:
    """Returns one Markdown table row; the attention cell adds what runs where it is not jax's
    implementation asked for (`row["attention_run"]`, the backend's report)."""
    attention, runs = row["attention"], row.get("attention_run")
    if runs and runs != f"jax.nn.dot_product_attention ({attention})":  # auto resolved, or XLA:CPU's bfloat16 one
        attention = f"{attention}: {runs}"
    head = f"| {row['model']} | {row['remat']} | {attention} |"
    if "error" in row:
        return head + f" {row['error']} | | | | |"
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
    return head + (f" {row['tokens_per_s']:,.0f} | {row['tflops_per_device']:.4g} | {mfu} "
                   f"| {row['seconds'] / row['steps'] * 1e3:.1f} | {row['temp_gib']:.3f} |")


TABLE_HEAD = ("| model | remat | attention | tokens/s | model TFLOP/s per device | MFU | ms/step | XLA temp GiB/device |\n"
              "|---|---|---|---:|---:|---:|---:|---:|")


def main() -> None:
    """Parses the command line, measures every row, prints the table (and writes it with --write)."""
    from nestor.backend.remat import POLICIES as REMAT_POLICIES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="preset plus overrides, quoted; repeatable")
    parser.add_argument("--remat", nargs="+", default=list(REMAT_POLICIES), choices=REMAT_POLICIES)
    parser.add_argument("--attention", nargs="+", help="xla | cudnn | auto (default: xla, and cudnn on GPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row, after compiling")
    parser.add_argument("--dtype", help="model.dtype (default: bfloat16 on accelerators, float32 on CPU)")
    parser.add_argument("--peak-tflops", type=float, help="per-device peak for MFU (default: the device table)")
    parser.add_argument("--profile", metavar="DIR",
                        help=f"trace {PROFILED_STEPS} more steps per row into DIR/<row> and print their top costs")
    parser.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    args = parser.parse_args()

    import jax

    platform = jax.default_backend()
    device = jax.devices()[0]
    models = args.model or list(DEFAULT_MODELS["cpu" if platform == "cpu" else "accelerator"])
    attentions = args.attention or (["xla", "cudnn"] if platform == "gpu" else ["xla"])
    dtype = args.dtype or ("float32" if platform == "cpu" else "bfloat16")
    command = " ".join(["python -m bench.mfu", *sys.argv[1:]])
    setup = (f"{jax.device_count()} x {device.device_kind} ({platform}), jax {jax.__version__}, {dtype}; "
             f"{args.steps} timed steps after {args.warmup} untimed, data parallel over every device.")
    print(setup)
    print(TABLE_HEAD)
    measured = rows(models, args.remat, attentions, dtype, args.steps, args.warmup, args.peak_tflops,
                    profile_dir=args.profile)
    if args.write:
        lines = ["### Measured", "", f"Command: `{command}`", "", setup, "", TABLE_HEAD, *map(row_line, measured)]
        write_section("mfu", "\n".join(lines))

if __name__ == "__main__":
    main()
