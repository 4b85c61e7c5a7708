"""LoRA on the routed experts (models.lora, models.moe): per dispatch, the compiled train step's temporaries
per device and how many of its instructions produce an array of one layer's expert weight's shape
([experts, embed, mlp] or [experts, mlp, embed]) other than parameters, on one device (compile only).

    python -m bench.lora_experts                             # 64 experts, float32 and bfloat16
    python -m bench.lora_experts --experts 16 --dtypes float32

Run it on two checkouts (PYTHONPATH) to compare their ways of running the adapters.
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile

from nestor.orchestrator.commands.explain import compile_step
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.loader import config as config_lib

EMBED, WIDTH = 256, 1024
MODEL = ("model.preset=tiny", f"model.embed_dim={EMBED}", "model.num_heads=4", "model.num_kv_heads=4",
         "train.global_batch=8", "train.seq_len=128", "moe.every=1", f"moe.expert_mlp_dim={WIDTH}", "lora.rank=8",
         "lora.targets=[expert_gate,expert_up,expert_down]", "cluster.devices_per_host=1", "mesh.data=1",
         "mesh.pipeline=1", "mesh.expert=1", "mesh.tensor=1", "mesh.fsdp=1")
DISPATCHES = {"dropless": "moe.capacity_factor=0", "sort": "moe.dispatch=sort", "einsum": "moe.dispatch=einsum"}


def expert_sized(hlo: str, experts: int) -> dict[str, int]:
    """Returns {opcode: count} of the instructions of `hlo` whose result has an expert weight's shape."""
    shapes = f"{experts},{EMBED},{WIDTH}|{experts},{WIDTH},{EMBED}"
    pattern = re.compile(rf"^\s*(?:ROOT )?%\S+ = \w+\[(?:{shapes})\]\S* ([\w-]+)\(", re.M)
    return dict(collections.Counter(match.group(1) for match in pattern.finditer(hlo)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    print("| dtype | dispatch | temporaries MiB | expert-sized dots | expert-sized results (not parameters) |")
    print("|---|---|---:|---:|---|")
    for dtype in args.dtypes.split(","):
        for dispatch, override in DISPATCHES.items():
            config = config_lib.load(None, [*MODEL, f"moe.num_experts={args.experts}", f"model.dtype={dtype}",
                                            override, f"run.dir={tempfile.mkdtemp()}"])
            compiled = compile_step(build_job(config, with_data=False))
            found = expert_sized(compiled.as_text(), args.experts)
            found.pop("parameter", None)
            print(f"| {dtype} | {dispatch} | {compiled.memory_analysis().temp_size_in_bytes / 2**20:.1f} | "
                  f"{found.get('dot', 0)} | {', '.join(f'{op} {n}' for op, n in sorted(found.items()))} |", flush=True)


if __name__ == "__main__":
    main()
