"""`nestor explain`'s FLOPs of a dropless MoE step for another target, against the dense model with the
same active parameters, compiled on this CPU (nothing runs).

The model (the issue's comparison): the tiny preset with 4 layers, embed 128, a dropless MoE layer in every
layer (top-2, experts 256 wide) against a dense model 512 wide, 16 sequences of 128 tokens (`--global-batch`), bfloat16, for
`cluster.device_kind` (default h100). Per expert count and mesh: the step's FLOPs against the dense step's,
the same without the state update (optimizer, norms: `update_flops_per_step`), and the update's share of
the MoE step; then the ratio and the share again with `optimizer.shard_update=true` (ZeRO stage 1) for both
models.

    python -m bench.target_flops                         # E = 8, 32, 128 on data8 and fsdp8, for an H100
    python -m bench.target_flops --experts 32 --meshes data8 --device-kind tpu-v5p
    python -m bench.target_flops --experts 128 --global-batch 64   # 1,024 tokens per device
    python -m bench.target_flops --experts 128 --meshes fsdp8 --breakdown 12   # what the MoE step adds, by op
"""

from __future__ import annotations

import argparse

MESHES = {"data8": ("mesh.data=8",), "fsdp8": ("mesh.fsdp=8",), "expert8": ("mesh.expert=8",)}
MODEL = ("model.preset=tiny", "model.embed_dim=128", "model.num_layers=4",
         "train.seq_len=128", "cluster.devices_per_host=8", "model.dtype=bfloat16", "run.compile_cache=null",
         "run.dir=/tmp/nestor-bench-target-flops")


def figures(*overrides: str) -> tuple[float, float]:
    """Returns (FLOPs per step, of which the state update) of `nestor explain` for the overrides."""
    from nestor.orchestrator.loader.config import load
    from nestor.orchestrator.commands.explain import explain

    report = explain(load(None, [*MODEL, *overrides]))
    return report["flops_per_step"], report["update_flops_per_step"]


def flops_by_op(*overrides: str) -> dict[tuple[str, str, str], float]:
    """Returns the FLOPs `nestor explain` counts for the overrides by (phase, HLO op, jax op), less this
    compile's float32 widening (parallel.hlo.flops_by_op)."""
    from nestor.orchestrator.loader.config import load
    from nestor.orchestrator.job.compiled import counted_step
    from nestor.orchestrator.job.build import build_job
    from nestor.parallel.hlo import flops_by_op as by_op

    job = build_job(load(None, [*MODEL, *overrides]), with_data=False)
    return by_op(counted_step(job).as_text(), without_widening=job.backend.widens_what_the_target_does_not())


def print_breakdown(moe: dict, dense: dict, rows: int) -> None:
    """Prints the `rows` largest differences MoE - dense, each over the dense step's FLOPs."""
    total = sum(dense.values())
    excess = {key: (moe.get(key, 0.0) - dense.get(key, 0.0)) / total for key in set(moe) | set(dense)}
    print("| phase | HLO op | jax op | (MoE - dense) / dense step |")
    print("| --- | --- | --- | ---: |")
    for (phase, op, jax_op), share in sorted(excess.items(), key=lambda item: -abs(item[1]))[:rows]:
        print(f"| {phase} | {op} | {jax_op or '-'} | {share:+.4f} |")


SHARD_UPDATE = ("optimizer.shard_update=false", "optimizer.shard_update=true")


def main() -> None:
    """Parses the command line and prints one table row per mesh and expert count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--meshes", nargs="+", default=["data8", "fsdp8"], choices=list(MESHES))
    parser.add_argument("--device-kind", default="h100", help="cluster.device_kind: the target explain counts for")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences of 128 tokens per step")
    parser.add_argument("--breakdown", type=int, default=0, metavar="ROWS",
                        help="instead of the table: per mesh and expert count, the ROWS largest differences by op "
                             "(replicated update)")
    args = parser.parse_args()
    from nestor.cluster.cpu_devices import simulate_cpu_devices_before_import

    simulate_cpu_devices_before_import(8)
    target = (f"cluster.device_kind={args.device_kind}", f"train.global_batch={args.global_batch}")
    moe_keys = lambda experts: (f"moe.num_experts={experts}", "moe.every=1", "moe.top_k=2",  # noqa: E731
                                "moe.expert_mlp_dim=256", "moe.capacity_factor=0")
    if args.breakdown:
        for mesh in args.meshes:
            dense = flops_by_op(*MESHES[mesh], *target, "model.mlp_dim=512")
            for experts in args.experts:
                print(f"\n{mesh}, {experts} experts:")
                print_breakdown(flops_by_op(*MESHES[mesh], *target, *moe_keys(experts)), dense, args.breakdown)
        return
    print("| mesh | experts | MoE / dense FLOPs | without the state update | update share of the MoE step "
          "| shard_update: MoE / dense FLOPs | shard_update: update share |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mesh in args.meshes:
        dense = [figures(*MESHES[mesh], *target, "model.mlp_dim=512", shard) for shard in SHARD_UPDATE]
        for experts in args.experts:
            moe = [figures(*MESHES[mesh], *target, *moe_keys(experts), shard) for shard in SHARD_UPDATE]
            (total, update), (dense_total, dense_update) = moe[0], dense[0]
            (sharded_total, sharded_update), (sharded_dense, _) = moe[1], dense[1]
            print(f"| {mesh} | {experts} | {total / dense_total:.3f} "
                  f"| {(total - update) / (dense_total - dense_update):.3f} | {update / total:.1%} "
                  f"| {sharded_total / sharded_dense:.3f} | {sharded_update / sharded_total:.1%} |", flush=True)


if __name__ == "__main__":
    main()
