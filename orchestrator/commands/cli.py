"""The `nestor` command: train, explain, plan, eval, sample, logits, export, goodput, submit, status, logs, stop, data
prepare."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path

from nestor.cluster.interrupts import signals_kept_for_the_run, sigterm_interrupts
from nestor.orchestrator.paths import shown
from nestor.orchestrator.commands.preflight import check_dependencies

STARTED = time.monotonic()  # when the command started: the whole run's time is counted from here
# the commands that read a run's checkpoints: they take its directory for CONFIG too (`run_config`)
OF_A_RUN = ("eval", "sample", "logits")
MEASURED_STEPS = 10  # nestor plan --measure: steps per candidate where --steps is not given


def _tensorboard_command(log_dir: str) -> str:
    """Returns the command that opens TensorBoard on `log_dir`, as the user can type it here."""
    tensorboard = "tensorboard"
    if shutil.which(tensorboard) is None:  # e.g. `.venv/bin/nestor` run without the venv on PATH
        beside = Path(sys.executable).parent / tensorboard
        tensorboard = shown(beside) if beside.exists() else tensorboard
    return f"{tensorboard} --logdir {shown(log_dir)}"


def where_results_are(config) -> list[str]:
    """Returns the closing lines of a run: where its files are, how to look at them, and what running the
    same command again does (resume from the newest checkpoint). A driver that cannot see run.dir (a
    cluster's storage) says what it said before any checkpoint was read."""
    from nestor.cluster.warm_head import kept_after_this_process
    from nestor.orchestrator.checkpoint.files import checkpoint_dir, finalized_steps

    run_dir = config.run.dir
    kept = finalized_steps(checkpoint_dir(run_dir))
    files = ["config.yaml", "metrics.jsonl", "goodput.jsonl", "checkpoints/"]
    if config.metrics.tensorboard:
        files.append("tb/")
    lines = [f"run dir: {shown(run_dir)}  ({', '.join(files)})"]
    if config.cluster.launcher == "ray" and (kept_s := kept_after_this_process()) is not None:
        lines.append(f"Ray: the local head stays up {kept_s:g} s for the next command (nestor stop-head ends it now)")
    if config.metrics.tensorboard:
        lines.append(f"TensorBoard: {_tensorboard_command(str(Path(run_dir) / 'tb'))}")
    if kept and kept[-1] > config.train.steps:  # nothing was trained: the run is past train.steps
        lines.append(f"extend: run the same command with train.steps above {kept[-1]}, the newest checkpoint")
        return lines
    newest = "" if not kept or kept[-1] == config.train.steps else f"from checkpoint {kept[-1]}; "
    lines.append(f"resume or extend: run the same command again ({newest}train.steps={config.train.steps} now)")
    return lines


def _interrupted(interrupt: KeyboardInterrupt) -> str:
    """Returns how a KeyboardInterrupt (or Interrupted, with its signal) stopped the command, in a word."""
    return "terminated (SIGTERM)" if getattr(interrupt, "signum", None) == signal.SIGTERM else "interrupted"


def _train(config, args) -> int:
    from nestor.orchestrator.checkpoint.files import checkpoint_dir, finalized_steps
    from nestor.orchestrator.loop.console import Console

    console = Console()
    try:
        if config.cluster.launcher == "ray":
            from nestor.orchestrator.commands.ray_driver import train_on_ray

            stopped_by = train_on_ray(config, console, said=getattr(args, "said", None))
        else:
            from nestor.orchestrator.job.processes import configure_jax
            from nestor.orchestrator.loop.train import train

            configure_jax(config)
            stopped_by = train(config, console=console).stopped_by
    except KeyboardInterrupt as interrupt:  # a second Ctrl-C, or a signal before training handles them
        print(f"nestor: {_interrupted(interrupt)}: stopped without saving the steps since the newest checkpoint",
              file=sys.stderr)
        if finalized_steps(checkpoint_dir(config.run.dir)):
            for line in where_results_are(config):
                print(line)
        elif checkpoint_dir(config.run.dir).is_dir():  # the run got as far as its checkpoints, none saved
            print(f"run dir: {shown(config.run.dir)}  (no checkpoint saved: running the same command again "
                  "starts from step 0)")
        return 128 + getattr(interrupt, "signum", signal.SIGINT)
    print(f"the whole run took {time.monotonic() - STARTED:.0f} s, from the command to its last save")
    for line in where_results_are(config):
        print(line)
    # A preempted run exits as the signal would have made it (128 + signal), after its checkpoint.
    return 0 if stopped_by is None else 128 + stopped_by


def _explain(config, args) -> int:
    from nestor.orchestrator.commands.explain import explain, format_report
    from nestor.orchestrator.job.processes import configure_jax

    configure_jax(config)
    report = explain(config)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _progress(what: str):
    """Returns the printer of a plan's progress lines on stderr (`what line`), one line kept on a terminal."""
    def say(line: str | None) -> None:  # None: the last line is wiped
        if sys.stderr.isatty():
            print("\r\033[K" if line is None else f"\r\033[K{what} {line}"[:200], end="", file=sys.stderr, flush=True)
        elif line is not None:
            print(f"{what} {line}", file=sys.stderr, flush=True)
    return say


def _plan(config, args) -> int:
    from nestor.orchestrator.errors import ConfigError
    from nestor.orchestrator.job.processes import configure_jax
    from nestor.orchestrator.planning.candidates import pinned_keys
    from nestor.orchestrator.planning.measure import check_measurable, measure
    from nestor.orchestrator.planning.report import format_measured, format_plan, write_overlay
    from nestor.orchestrator.planning.search import compile_workers, search

    if args.steps is not None and not args.measure:
        raise ConfigError([("--steps", f"{args.steps}: steps of the measured candidates; add --measure K")])
    steps = args.steps or MEASURED_STEPS
    configure_jax(config)
    if args.measure:  # before the search: a refusal costs no compile
        check_measurable(config, steps)
    pins = pinned_keys(args.overrides)
    plan = search(config, pins, args.budget_s, progress := _progress("planning"),
                  workers=args.workers or compile_workers())
    progress(None)
    print(format_plan(config, plan, args.top))
    winner, measured_s = (plan.ranked[0], None) if plan.ranked else (None, None)
    if args.measure and plan.ranked:
        if config.cluster.launcher == "ray":
            from nestor.orchestrator.commands.ray_driver import train_on_ray as run
        else:
            from nestor.orchestrator.planning.measure import train_here as run
        measured = measure(config, plan.ranked[:args.measure], steps, progress := _progress("measuring"), run)
        progress(None)
        print("\n" + format_measured(config, measured, steps))
        best = measured[0]
        winner, measured_s = (best.judged, best.step_s) if best.step_s is not None else (None, None)
    if args.out and winner is not None:
        command = " ".join(["nestor plan", args.config, *args.overrides])
        write_overlay(Path(args.out), winner, config, pins, command, measured_s)
        what = "the measured winner" if measured_s is not None else "the winner"
        print(f"wrote {what} to {shown(args.out)}: nestor train {args.config} {shown(args.out)}")
    return 0 if winner is not None else 1


def _eval(config, args) -> int:
    from nestor.orchestrator.evaluation.commands import evaluate_checkpoint
    from nestor.orchestrator.job.processes import configure_jax
    from nestor.orchestrator.specs.registry import spec_of

    configure_jax(config)
    result = evaluate_checkpoint(config)
    others = "".join(f" {name} {value:.4f}" for name, value in result.items()
                     if name not in ("step", "eval_loss", "eval_perplexity"))
    perplexity = f" eval_perplexity {result['eval_perplexity']:.3f}" if "eval_perplexity" in result else ""
    rows = (f"{config.train.global_batch} x {config.train.seq_len} tokens" if spec_of(config).counts_tokens
            else f"{config.train.global_batch} rows")
    print(f"step {result['step']}: eval_loss {result['eval_loss']:.4f}{perplexity}{others} "
          f"({config.eval.steps} batches of {rows}, "
          f"eval.source={config.eval.source})")
    return 0


def _sample(config, args) -> int:
    from nestor.orchestrator.evaluation.commands import sample_checkpoint
    from nestor.orchestrator.job.processes import configure_jax

    configure_jax(config)
    if args.chat is not None:
        from nestor.orchestrator.evaluation.commands import chat_checkpoint

        print(chat_checkpoint(config, args.chat, args.max_tokens, args.temperature, args.top_k, args.seed))
    else:
        print(sample_checkpoint(config, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed))
    return 0


def _logits(config, args) -> int:
    import numpy as np

    from nestor.orchestrator.errors import ConfigError
    from nestor.orchestrator.evaluation.commands import logits_of
    from nestor.orchestrator.job.processes import configure_jax

    try:
        tokens = np.load(args.tokens)
    except (OSError, ValueError) as error:
        raise ConfigError([("--tokens", f"{args.tokens} is no .npy array: {error}")]) from None
    configure_jax(config)
    logits, source = logits_of(config, tokens)
    import jax

    if jax.process_index() == 0:
        np.save(args.out, logits)
        print(f"logits {list(logits.shape)} of {shown(source)} -> {shown(args.out)}")
    return 0


def _export(args) -> int:
    from nestor.orchestrator.commands.hf_export import export
    from nestor.orchestrator.job.processes import configure_jax

    config = run_config(args.run_dir, args.overrides)
    configure_jax(config)
    written = export(config, Path(args.out).expanduser().resolve(), args.step, args.dtype, args.max_shard_gb,
                     adapters=args.adapters)
    what = "adapters, " if args.adapters else ("adapters merged, " if config.lora.rank else "")
    print(f"exported {written.step_text} of {shown(config.run.dir)} to {shown(args.out)}: {what}{written.files} "
          f"safetensors file(s), {written.tensors} tensors, {written.dtype}")
    for note in written.notes:
        print(f"note: {note}")
    return 0


def _goodput(args) -> int:
    from nestor.orchestrator.loop.goodput import FILE_NAME, read_records, report, run_goodput

    path = Path(args.run_dir).expanduser() / FILE_NAME
    attempts = run_goodput(read_records(path, log=lambda line: print(line, file=sys.stderr)))
    if not attempts:
        what = "holds no attempt" if path.is_file() else "does not exist"
        print(f"nestor: {shown(path)} {what}: name the run.dir of a run that trained (with this nestor or newer)",
              file=sys.stderr)
        return 2
    print(report(attempts))
    return 0


def run_config(run_dir: str, overrides: list[str]):
    """Returns the config of the run in `run_dir`: its config.yaml (else the config its newest checkpoint was
    written with), with run.dir made `run_dir` (a run directory that moved) and `overrides` (a mesh that fits
    this machine, say) layered over it. Raises ConfigError (RUN_DIR) when it holds neither."""
    from nestor.orchestrator.loader.config import load
    from nestor.orchestrator.errors import ConfigError

    directory = Path(run_dir).expanduser().resolve()
    here = [f"run.dir={json.dumps(str(directory))}", *overrides]  # a JSON string is a YAML one
    if (directory / "config.yaml").is_file():
        return load(directory / "config.yaml", here)
    from nestor.orchestrator.checkpoint.reader import newest_saved_config

    if (saved := newest_saved_config(directory)) is None:
        raise ConfigError([("RUN_DIR", f"{shown(directory)} holds no config.yaml and no checkpoint: name the run.dir "
                                       "of a run that trained")])
    return load(saved, here)


def _submit(config, args) -> int:
    import yaml

    from nestor.cluster import jobs
    from nestor.orchestrator.specs.registry import resolve_user_code, user_code_paths

    resolve_user_code(config)  # an import path that does not resolve is one line here, not in the job's log
    job_id = jobs.submit(args.address, yaml.safe_dump(config.to_dict(), sort_keys=False),
                         user_code=user_code_paths(config))
    print(job_id, flush=True)
    print(f"nestor: run.dir on the cluster: {config.run.dir} (relative paths resolve against the directory "
          "nestor runs in; every host must see this path)", file=sys.stderr, flush=True)
    if not args.follow:
        return 0
    final = jobs.follow(args.address, job_id)
    print(f"nestor: job {job_id} {final}", file=sys.stderr)
    return 0 if final == "SUCCEEDED" else 1


def _stop_head(address: str | None) -> int:
    """`nestor stop-head`: the head at `address`, else this user's warm local heads (cluster.keep_head_s)."""
    if address:
        from nestor.cluster.head import stop_head

        print(f"stopped the Ray head at {address}: {stop_head(address)} processes")
        return 0
    from nestor.cluster.warm_head import stop_warm_heads

    stopped, busy = stop_warm_heads()
    for head in stopped:
        print(f"stopped the local Ray head at {head}")
    for head in busy:
        print(f"left the local Ray head at {head} up: a running nestor command holds it (stop that command first)")
    if not stopped and not busy:
        print("no local Ray head of yours is up")
    return 1 if busy else 0


def _job_command(args) -> int:
    from nestor.cluster import jobs

    if args.command == "stop-head":
        return _stop_head(args.address)
    if args.command == "status":
        from nestor.orchestrator.commands.ray_driver import restart_lines

        print(jobs.status(args.address, args.job_id))
        for line in restart_lines(jobs.logs(args.address, args.job_id)):
            print(line)
    elif args.command == "logs":
        print(jobs.logs(args.address, args.job_id), end="")
    else:
        print("stopped" if jobs.stop(args.address, args.job_id) else "not running")
    return 0


def _data_prepare(args) -> int:
    from nestor.orchestrator.data.prepare import Options, first_record, input_files, prepare
    from nestor.orchestrator.data.preferences import SPLIT_FILES, is_preference_record, prepare_preferences
    from nestor.orchestrator.data.shards import VOCAB_MULTIPLE

    files = input_files(args.sources, "SOURCE")
    if is_preference_record(first_record(files[0])):  # DPO's pairs: named arrays
        out = Path(args.out).expanduser().resolve()
        written = prepare_preferences(files, args.tokenizer, out, args.eval_fraction, args.seq_len,
                                      args.chat_template, args.separator)
        for split, pairs in written["splits"].items():
            if pairs:
                print(f"{split}: {pairs:,} preference pairs of {written['seq_len'] + 1} tokens a side in "
                      f"{shown(out / SPLIT_FILES[split])}")
        print(f"train on it: nestor train CONFIG train.objective=dpo lora.rank=R data.source=arrays "
              f"data.paths=[{shown(out / SPLIT_FILES['train'])}] train.seq_len={written['seq_len']}")
        return 0

    options = Options(tokenizer=args.tokenizer, out=Path(args.out).expanduser().resolve(),
                      eval_fraction=args.eval_fraction, text_field=args.text_field,
                      parquet_column=args.parquet_column, workers=args.workers, shard_mb=args.shard_mb,
                      separator=args.separator, chat_template=args.chat_template)
    metadata = prepare(args.sources, options, args.eval_source)
    for split, counts in metadata["splits"].items():
        print(f"{split}: {counts['tokens']:,} tokens in {counts['documents']:,} documents, "
              f"{len(counts['shards'])} shards")
    # A command to paste, the user's config in place of CONFIG. It names no model.vocab_size, which would
    # conflict with a checkpoint's (model.init_from): the loader sizes the vocabulary from the shards
    # (loader.config.shards_tokenizer), padded as Megatron and MaxText pad it for the mesh's tensor axis.
    ids = metadata["tokenizer"]["vocab_size"]
    padded = -(-ids // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    print(f"train on it: nestor train CONFIG data.source=tokens data.paths=[{shown(options.out)}]")
    rounded = f", rounded up to {padded} (a multiple of {VOCAB_MULTIPLE}, so that any mesh splits it)" \
        if padded != ids else ""
    print(f"(model.vocab_size: the run grows it to hold the tokenizer's {ids:,} ids{rounded}, unless its config "
          "or its model.init_from checkpoint sets it)")
    return 0


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _separator(text: str) -> int | str:
    """Parses --separator: `eos`, or a token id >= 0."""
    return text if text == "eos" else _non_negative_int(text)


def _data_parser(commands) -> None:
    data = commands.add_parser("data", help="prepare token shards for data.source=tokens")
    actions = data.add_subparsers(dest="action", required=True)
    prepare = actions.add_parser("prepare", help="tokenize text, JSONL and Parquet files into token shards")
    prepare.add_argument("sources", nargs="+", metavar="SOURCE",
                         help="text, .jsonl or .parquet files, globs or directories")
    prepare.add_argument("--tokenizer", required=True, help="a tokenizers .json, a SentencePiece .model, or bytes")
    prepare.add_argument("--out", required=True, help="the directory of shards (an interrupted prepare resumes)")
    prepare.add_argument("--eval-fraction", type=_fraction, default=0.0,
                         help="share of documents held out as the eval split (by a hash of the text)")
    prepare.add_argument("--eval-source", nargs="*", default=[], metavar="SOURCE",
                         help="inputs held out whole as the eval split")
    prepare.add_argument("--text-field", default="text", help="JSONL: the field holding a document's text")
    prepare.add_argument("--parquet-column", default="text", help="Parquet: the column holding the text")
    prepare.add_argument("--workers", type=_positive(int), default=1, help="tokenizing processes")
    prepare.add_argument("--shard-mb", type=_positive(float), default=256.0, help="input MiB per shard")
    prepare.add_argument("--chat-template", default=None, metavar="NAME_OR_FILE",
                         help="chat data (JSONL of messages or prompt/completion): the template, a name (chatml) "
                              "or a .jinja file; default: the tokenizer's checkpoint's")
    prepare.add_argument("--seq-len", type=_non_negative_int, default=0, help="preference pairs (prompt, chosen, "
                         "rejected): tokens a side, less one (0: the longest pair's)")
    prepare.add_argument("--separator", type=_separator, default="eos",
                         help="the token id that ends each document, or eos: the tokenizer's end of text (bytes: 0)")
    prepare.set_defaults(handler=_data_prepare)


def parser() -> argparse.ArgumentParser:
    """Returns the argument parser of the `nestor` command."""
    main = argparse.ArgumentParser(prog="nestor", description="Train large Flax models on nested device meshes.")
    commands = main.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model, or resume it from run.dir")
    explain = commands.add_parser("explain", help="compile the train step and report layout, memory, collectives, FLOPs")
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    plan = commands.add_parser("plan", help="search meshes, schedules, remat and accumulation for the target; rank "
                                            "what fits by a cost model; write the winner as a YAML overlay")
    plan.add_argument("--top", type=_positive(int), default=5, help="candidates to print")
    plan.add_argument("--out", metavar="PLAN.yaml", help="write the winner as an overlay: nestor train CONFIG PLAN.yaml")
    plan.add_argument("--budget-s", type=_positive(float), default=300.0,
                      help="seconds to spend judging candidates (compiling most); the rest is left undecided")
    plan.add_argument("--workers", type=_positive(int),
                      help="compiles at once (default: the cores this process may use, at most 8; each holds a "
                           "compiler's memory)")
    plan.add_argument("--measure", type=_positive(int), metavar="K",
                      help="train the top K for --steps steps each on the devices present (cluster.launcher="
                           "inprocess) and re-rank them by measured step time; --out writes the measured winner")
    plan.add_argument("--steps", type=_positive(int), metavar="S",
                      help=f"--measure: steps per candidate, the first not timed (default {MEASURED_STEPS})")
    evaluate = commands.add_parser("eval", help="eval loss (and perplexity, for a token cross-entropy) of "
                                                "run.dir's newest checkpoint")
    sample = commands.add_parser("sample", help="decode text from run.dir's newest checkpoint")
    given = sample.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the text to continue")
    given.add_argument("--chat", metavar="MESSAGE",
                       help="a user's message: rendered with the run's chat template, answered to the end of the turn")
    sample.add_argument("--max-tokens", type=_positive(int), default=64, help="tokens to generate")
    sample.add_argument("--temperature", type=_non_negative, default=0.0, help="0 = greedy")
    sample.add_argument("--top-k", type=_non_negative_int, default=0, help="draw from the K likeliest; 0 = all")
    sample.add_argument("--seed", type=_non_negative_int, default=0, help="seeds the draws")
    logits = commands.add_parser("logits", help="write the logits of run.dir's newest checkpoint (or model.init_from) "
                                                "for given token rows")
    logits.add_argument("--tokens", required=True, help="a .npy of int token ids [rows, length]")
    logits.add_argument("--out", required=True, help="the .npy to write, float32 [rows, length, vocab]")
    export = commands.add_parser("export", help="write a run's checkpoint as a Hugging Face checkpoint")
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (its config.yaml and checkpoints/)")
    export.add_argument("--to", required=True, choices=("hf",), help="the format: hf (config.json, safetensors)")
    export.add_argument("--out", required=True, help="the directory to write (created; must be empty)")
    export.add_argument("--step", type=_non_negative_int, help="the checkpoint (default: the newest)")
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the tensors' dtype")
    export.add_argument("--max-shard-gb", type=_positive(float), default=5.0, help="the most GB per file")
    export.add_argument("--adapters", action="store_true", help="a LoRA run: write its adapters as a PEFT adapter "
                        "directory (adapter_config.json, adapter_model.safetensors) instead of merging them")
    export.add_argument("overrides", nargs="*", metavar="KEY=VALUE|FILE.yaml",
                        help="overrides of the run's config (a mesh that fits the devices here)")
    export.set_defaults(handler=_export)
    goodput = commands.add_parser("goodput", help="where a run's wall time went, over all its restarts")
    goodput.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (its goodput.jsonl)")
    goodput.set_defaults(handler=_goodput)
    submit = commands.add_parser("submit", help="submit a training job to a running Ray cluster (Jobs API)")
    submit.add_argument("--follow", action="store_true", help="stream the logs; exit non-zero if the job fails")
    for command, handler in ((train, _train), (explain, _explain), (plan, _plan), (evaluate, _eval), (sample, _sample),
                             (logits, _logits), (submit, _submit)):
        command.add_argument("config", nargs="?", help="run YAML, e.g. configs/quickstart.yaml" + (
            ", or a run directory (its config.yaml; run.dir is it)" if command.prog.split()[-1] in OF_A_RUN else ""))
        command.add_argument("overrides", nargs="*", metavar="KEY=VALUE|FILE.yaml",
                             help="dotted overrides (mesh.tensor=2) or further YAML files layered in order; "
                                  "anywhere on the line")
        command.set_defaults(handler=handler)
    for name, text in (("status", "print a submitted job's status and its restarts"),
                       ("logs", "print a submitted job's output"), ("stop", "stop a submitted job")):
        command = commands.add_parser(name, help=text)
        command.add_argument("job_id", help="the submission id `nestor submit` printed")
        command.set_defaults(handler=None)
    stop_head = commands.add_parser("stop-head", help="stop the Ray head at --address on this machine (not every "
                                    "Ray node, as `ray stop` does); without it, your local heads kept warm between "
                                    "commands (cluster.keep_head_s)")
    stop_head.add_argument("--address", help="the head's GCS address HOST:PORT (ray start --port)")
    stop_head.set_defaults(handler=None)
    _data_parser(commands)
    for command in (submit, commands.choices["status"], commands.choices["logs"], commands.choices["stop"]):
        command.add_argument("--address", required=True, help="the cluster's dashboard URL, e.g. http://127.0.0.1:8265")
    return main


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Returns the parsed command line; KEY=VALUE overrides and YAML layers may come after options too
    (`nestor submit CONFIG --address URL train.steps=20 --follow`). Exits 2 on anything else."""
    main = parser()
    args, extra = main.parse_known_args(argv)
    if getattr(args, "config", "") is None:  # argparse would name the optional overrides as required too
        run = (" or a run directory", "|RUN_DIR", " or runs/quickstart") if args.command in OF_A_RUN else ("",) * 3
        main.error(f"nestor {args.command} needs a run YAML{run[0]}: nestor {args.command} CONFIG{run[1]} "
                   f"[KEY=VALUE ...], e.g. nestor {args.command} configs/quickstart.yaml{run[2]}")
    if extra and getattr(args, "overrides", None) is not None:
        strays = [item for item in extra if item.startswith("-") or not ("=" in item or item.endswith((".yaml", ".yml")))]
        if strays:
            main.error(f"unrecognized arguments: {' '.join(strays)}")
        args.overrides += extra
    elif extra:
        main.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit code: 2 for a config error, 1 for a cluster error, a missing
    dependency, a diverged run or a failed checkpoint write (printed as one message, no trace), 128 + signal
    when stopped by one. From its first line, a SIGINT or SIGTERM to `nestor train` waits for the run to
    take it (it stops before its first step, or saves and stops), and stops other commands with one line."""
    args = parse(argv)
    with signals_kept_for_the_run() if args.command == "train" else sigterm_interrupts():
        return _main(args)


def _searched(args, config) -> frozenset[str]:
    """Returns the keys a plan sets itself (none for another command): no warning names them idle."""
    if args.command != "plan":
        return frozenset()
    from nestor.orchestrator.planning.candidates import pinned_keys, searched_keys

    return frozenset(searched_keys(config, pinned_keys(args.overrides)))


def _main(args) -> int:
    missing = check_dependencies()
    if missing:
        print(f"nestor: {missing}", file=sys.stderr)
        return 1
    if args.command == "train":  # before the config's checks import jax
        from nestor.orchestrator.commands.first_line import early_starting_line

        args.said = early_starting_line(args.config, args.overrides)
        if args.said:
            print(args.said, flush=True)
    from nestor.cluster.rendezvous import ClusterError
    from nestor.orchestrator.loader.config import load
    from nestor.orchestrator.errors import ConfigError, RunFailed
    from nestor.orchestrator.loader.idle_keys import idle_warning
    from nestor.orchestrator.commands.user_errors import user_code_error

    config = None
    try:
        if args.handler is None:
            return _job_command(args)
        if args.command in ("data", "export", "goodput"):
            return args.handler(args)
        overrides = args.overrides
        given_run = args.command in OF_A_RUN and Path(args.config).expanduser().is_dir()
        if args.command == "plan":  # CONFIG's own mesh may be for other devices: the plan searches it anew
            from nestor.orchestrator.planning.candidates import load_for_plan

            config = load_for_plan(args.config, overrides)
        else:
            config = run_config(args.config, overrides) if given_run else load(args.config, overrides)
        if warning := idle_warning(config, _searched(args, config)):
            print(f"nestor: {warning}", file=sys.stderr)
        for line in config.chosen:  # on stderr, as the idle keys' warning: stdout may be explain's --json
            print(f"nestor: {line}", file=sys.stderr)
        return args.handler(config, args)
    except ConfigError as error:
        print(f"{getattr(error, 'frames', '')}nestor: {error}", file=sys.stderr)  # a user's code's frames first
        return 2
    except ClusterError as error:
        print(f"nestor: {error}", file=sys.stderr)
        return 1
    except RunFailed as error:  # a diverged run, a failed checkpoint write
        print(f"nestor: {error.headline}{error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:
        print(f"nestor: {_interrupted(interrupt)}", file=sys.stderr)
        return 128 + getattr(interrupt, "signum", signal.SIGINT)
    except Exception as error:  # the user's own code's: its frames and the key; nestor's own: a traceback
        if config is None or (converted := user_code_error(config, error)) is None:
            raise
        print(f"{converted.frames}nestor: {converted}", file=sys.stderr)
        return 2


def console_script() -> int:
    """The `nestor` console script (and `python -m nestor.orchestrator`): returns `main`'s exit code, after which
    a Ctrl-C while the process exits is ignored; the run has stopped and said where it is, and JAX's exit
    handlers would show it as a traceback (a second Ctrl-C that came after a first one had stopped the run)."""
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(console_script())
