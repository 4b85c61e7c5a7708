"""nestor's train step from two checkouts, timed alternately in one run: what a change did to the step.

    git worktree add /tmp/before <commit>
    python -m bench.trees /tmp/before                    # this checkout against /tmp/before, jax of this python
    python -m bench.trees /tmp/before --nestor-python /tmp/mtvenv/bin/python   # both sides on another jax
    python -m bench.trees . --this-xla-flags=--xla_disable_hlo_passes=float-normalization-bf16  # what a flag does

Each side is a worker of bench.maxtext's (`--serve nestor`, started in its own checkout, so the other one
needs bench/maxtext.py too) on bench/step.py's model and meshes, compiled and warmed before timing; the
driver asks them in turn for `--steps` steps, the order flipping every round (`bench.maxtext.alternate`), and prints per mesh and
`--nestor-remat` policy each side's median ms per step, the median over rounds of this / other with its
quartiles, and each compiled step's converts. Nothing is written to the docs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.maxtext import MAXTEXT_MESHES, REPOSITORY, Worker, alternate
from bench.step import round_ratios


def compare(other: Path, mesh: str, remat: str, args) -> str:
    """Returns the table row of `mesh` and `remat`: both checkouts' steps timed alternately."""
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    trees = {"this": REPOSITORY, "other": other}
    flags = {"this": args.this_xla_flags, "other": ""}
    workers = {side: Worker(side, args.nestor_python, ["nestor", mesh, remat, "gpipe", "1"],
                            log_dir / f"{side}-{remat}-{mesh.replace(' ', '')}.log", repository=tree,
                            xla_flags=flags[side])
               for side, tree in trees.items()}
    ready, times = alternate(workers, args.rounds, args.steps, f"{mesh} {remat}")
    summary = round_ratios(times["this"], times["other"])
    ms = {side: statistics.median(seconds) * 1e3 for side, seconds in times.items()}
    converts = {side: reply["program"]["convert"] for side, reply in ready.items()}
    return (f"| {mesh} | {remat} | {ms['this']:.0f} | {ms['other']:.0f} | {summary['ratio']:.3f} "
            f"({summary['q1']:.3f}-{summary['q3']:.3f}) | {converts['this']} / {converts['other']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", type=Path, help="the other checkout of nestor")
    parser.add_argument("--nestor-python", default=sys.executable, help="interpreter of both workers")
    parser.add_argument("--nestor-remat", nargs="+", default=["dots", "full"])
    parser.add_argument("--this-xla-flags", default="",
                        help="XLA flags added to this checkout's worker only (give `other` as this checkout "
                             "to time one flag's effect)")
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds per mesh and policy")
    parser.add_argument("--steps", type=int, default=3, help="steps per side per round")
    parser.add_argument("--meshes", nargs="*", default=list(MAXTEXT_MESHES), choices=list(MAXTEXT_MESHES))
    parser.add_argument("--log-dir", default="/tmp/nestor-bench-trees/logs", help="the workers' stderr")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be 2 or more (the quartiles need two ratios)")
    if args.this_xla_flags:
        print(f"This checkout's worker adds XLA flags: {args.this_xla_flags}")
    print(f"| mesh | nestor remat | this ms/step | {args.other} ms/step | this / other (median, quartiles) | "
          "converts this / other |")
    print("| --- | --- | ---: | ---: | ---: | ---: |", flush=True)
    for mesh in args.meshes:
        for remat in args.nestor_remat:
            print(compare(args.other.resolve(), mesh, remat, args), flush=True)


if __name__ == "__main__":
    main()
