"""Reader throughput: global batches per second the data sources build, against the step rate they feed.

Rows:
- quickstart, `text` (its own source: the standard library's sources, bytes)
  and `tokens` (the same files prepared by `nestor data prepare`): every row of
  its global batch (16 x 65), against the quickstart's measured step rate on
  this machine (`--quickstart-steps` steps trained in process, the median
  step_time_s after the first);
- 125m at seq 2048, `tokens` (a prepared directory of uniform random ids of
  its 32,768 vocabulary, `--tokens-125m` of them): the rows of 8 processes
  (32 each, global batch 256) read by one process, against the fastest step
  8 H100s could take: model FLOPs per step at 100% MFU (989 TFLOP/s bf16 each).

Each row reads `--batches` consecutive global batches (random windows) per
round, `--rounds` rounds, rows alternating within each round; batches/s is the
median over rounds. Files are in the page cache (just written or read), so
this is the reader's cost, not the disk's.

    python -m bench.data_reader            # prints the table
    python -m bench.data_reader --write    # and writes its section of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The quickstart's mesh needs 8 devices: simulated on a CPU, set before jax starts.
from nestor.cluster.cpu_devices import simulate_cpu_devices_before_import  # noqa: E402

simulate_cpu_devices_before_import(8)

import numpy as np  # noqa: E402

from bench.report import write_section  # noqa: E402
from nestor.orchestrator.loader.config import load  # noqa: E402
from nestor.orchestrator.data.batches import make_source  # noqa: E402
from nestor.orchestrator.data.shards import FORMAT, LEGACY_SEPARATOR, METADATA, shard_name, token_dtype, write_shard  # noqa: E402
from nestor.orchestrator.specs.lm_flops import model_flops_per_step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
H100_BF16_TFLOPS = 989.0
PROCESSES_125M, ROWS_PER_PROCESS_125M = 8, 32


def random_token_directory(out: Path, tokens: int, vocab_size: int, documents: int = 2048) -> Path:
    """Writes a prepared directory of `documents` documents of uniform random ids (one shard); returns it."""
    rng = np.random.default_rng(0)
    dtype = token_dtype(vocab_size)
    lengths = rng.multinomial(tokens - documents, np.full(documents, 1 / documents))
    docs = [rng.integers(1, vocab_size, length, dtype=dtype) for length in lengths]
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, split_docs in (("train", docs), ("eval", [])):
        count_tokens, count_documents = write_shard(out, shard_name(split, 0), split_docs, dtype, LEGACY_SEPARATOR)
        splits[split] = {"tokens": count_tokens, "documents": count_documents,
                         "shards": [{"name": shard_name(split, 0), "tokens": count_tokens,
                                     "documents": count_documents}]}
    metadata = {"format": FORMAT, "tokenizer": {"path": "random", "fingerprint": "random", "vocab_size": vocab_size},
                "dtype": dtype.name, "splits": splits}
    (out / METADATA).write_text(json.dumps(metadata))
    return out


def quickstart_step_time(run_dir: Path, steps: int) -> float:
    """Trains the quickstart in this process for `steps` steps; returns the median step_time_s after the first."""
    from nestor.orchestrator.loop.console import Console
    from nestor.orchestrator.loop.train import train

    config = load(QUICKSTART, [f"run.dir={run_dir}", f"train.steps={steps}", "train.log_every=1",
                               "cluster.launcher=inprocess", "checkpoint.every=0", "metrics.tensorboard=false"])
    history = train(config, console=Console.silent()).history
    return statistics.median(record["step_time_s"] for record in history[1:])


def time_rows(source, rows: range, batches: int, first_step: int) -> float:
    """Returns seconds per global batch for `batches` consecutive steps of `rows`."""
    started = time.perf_counter()
    for step in range(first_step, first_step + batches):
        source.rows(step, rows)
    return (time.perf_counter() - started) / batches


def main() -> None:
    """Measures every row alternately, prints the table (and writes it with --write)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20, help="global batches per row per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens-125m", type=int, default=64_000_000, help="random tokens prepared for 125m")
    parser.add_argument("--quickstart-steps", type=int, default=6, help="steps trained to time the quickstart")
    parser.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    args = parser.parse_args()

    import jax

    from nestor.orchestrator.data.prepare import Options, prepare

    work = Path(tempfile.mkdtemp(prefix="nestor-bench-data-"))
    text_source = make_source(load(QUICKSTART, [f"run.dir={work / 'run'}"]))
    prepare([str(f) for f in text_source.files], Options(tokenizer="bytes", out=work / "stdlib", workers=2),
            log=lambda line: None)
    quickstart_tokens = make_source(load(QUICKSTART, ["data.source=tokens", f"data.paths=[{work / 'stdlib'}]"]))
    big = load(None, ["model.preset=125m", "train.seq_len=2048",
                      f"train.global_batch={PROCESSES_125M * ROWS_PER_PROCESS_125M}", "model.dtype=bfloat16",
                      "data.source=tokens", f"data.paths=[{random_token_directory(work / 'random', args.tokens_125m, 32768)}]"])
    cases = {"quickstart, text": (text_source, range(16)), "quickstart, tokens": (quickstart_tokens, range(16)),
             f"125m seq 2048, tokens, {PROCESSES_125M} processes x {ROWS_PER_PROCESS_125M} rows":
                 (make_source(big), range(PROCESSES_125M * ROWS_PER_PROCESS_125M))}
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for source, rows in cases.values():  # warm: page cache, memory maps, the text source's first files
        time_rows(source, rows, 2, 0)
    for round_index in range(args.rounds):
        for name, (source, rows) in cases.items():
            seconds[name].append(time_rows(source, rows, args.batches, 1000 * round_index))

    quickstart_step = quickstart_step_time(work / "quickstart", args.quickstart_steps)
    fastest_125m_step = model_flops_per_step(big) / (PROCESSES_125M * H100_BF16_TFLOPS * 1e12)
    steps = {"quickstart, text": (quickstart_step, "quickstart on this CPU, measured"),
             "quickstart, tokens": (quickstart_step, "quickstart on this CPU, measured")}
    lines = ["| reader | rows x tokens per batch | batches/s | tokens/s | step it feeds | steps/s | "
             "batches per step time |", "|---|---|---:|---:|---|---:|---:|"]
    for name, (source, rows) in cases.items():
        per_batch = statistics.median(seconds[name])
        step_s, step_name = steps.get(name, (fastest_125m_step, "8 x H100 at 100% MFU (bound)"))
        width = source.width
        lines.append(f"| {name} | {len(rows)} x {width} | {1 / per_batch:,.1f} | {len(rows) * width / per_batch:,.0f} "
                     f"| {step_name} | {1 / step_s:,.2f} | {step_s / per_batch:,.1f} |")
    command = " ".join(["python -m bench.data_reader", *sys.argv[1:]])
    setup = (f"{jax.devices()[0].platform}, jax {jax.__version__}, numpy {np.__version__}; median of {args.rounds} "
             f"rounds of {args.batches} batches per row, rows alternating; files in the page cache.")
    print(setup)
    print("\n".join(lines))
    if args.write:
        write_section("data", "\n".join(["## Data reader (`bench/data_reader.py`)", "", f"Command: `{command}`", "",
                                         setup, "", *lines]))


if __name__ == "__main__":
    main()
