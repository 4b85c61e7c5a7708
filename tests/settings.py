"""The suite's constants, for its files to import (tests/conftest.py applies the flags before jax starts)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The suite compiles hundreds of small programs, and XLA:CPU spends most of a compile generating code: LLVM
# at -O0 and its older elemental emitters in place of the MLIR fusion emitters compile them 2.4 times
# faster, and a 5-step tiny run executes no slower. The HLO's sharding, memory analysis and collectives are
# the default build's; without the fusion emitters a scatter becomes a loop, so a test that reads the
# compiled program's loops or XLA's FLOP count compiles with them (mark `default_cpu_codegen`). Results
# differ from the default build in the last bits, so every process a test compares with gets the flags too
# (tests.helpers.child_env), and the doc blocks' commands, whose few steps are mostly a compile, run with them
# (tests/doc_blocks.py). A 100-step quickstart executes faster at the default, which stays nestor's.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
# A test that executes hundreds of steps in this process (mark `default_cpu_build`) compiles its train step as
# XLA:CPU does outside the suite, LLVM at its default -O3 too: its steps then run about twice as fast.
DEFAULT_CPU_BUILD = {**FUSION_EMITTERS, "xla_backend_optimization_level": 3}
# XLA:CPU aborts the process when a collective's participants do not all arrive within its timeouts; with
# 8 simulated devices' threads on 2 cores beside the other worker's Ray tests, a device can be starved that
# long (a worker aborted in pipeline4 x fsdp2 1F1B, which passes alone in 9 s): the suite waits as long as a
# run with its watchdog on does (orchestrator.job.processes.AUTO_LIMIT_COLLECTIVE_S), so that a run in this
# process leaves its XLA_FLAGS, which processes it starts inherit, as they are.
PATIENT_COLLECTIVES = ("--xla_cpu_collective_call_terminate_timeout_seconds=86400 "
                       "--xla_cpu_collective_timeout_seconds=86400")

# Adam's eps at 1e-6 in runs compared across meshes: at the default 1e-8, an element whose gradient is
# near 0 (~1e-9) moves by a large share of lr * sign(gradient), so float32 rounding that differs between
# meshes moved one embedding entry of 16,384 by 1.3e-4 in 5 steps (param tolerance 1e-4); at 1e-6 the
# largest difference in that run was 2e-6.
COMPARABLE_ADAM = "optimizer.eps=1e-6"
# A tiny step takes well under a second: a run stuck for 2 minutes has hung, and its watchdog ends the worker
# then (tests/xdist_groups.py runs its test once more) rather than after the 600 s floor of the automatic limit.
TINY_HANG_LIMIT = "run.hang_timeout_s=120"
TINY = ("model.preset=tiny", "train.steps=5", "train.global_batch=16", "train.seq_len=32", "optimizer.warmup_steps=2",
        COMPARABLE_ADAM, TINY_HANG_LIMIT)
