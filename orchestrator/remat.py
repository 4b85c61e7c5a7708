"""Rematerialisation (`model.remat`): what each stacked unit keeps for the backward pass.

One policy for every way the stack runs: the scan wraps each unit in
`jax.checkpoint` with it, and the pipeline applies it to each layer of a stage
(`parallel.pipeline`). Either way a unit's input is kept and the policy picks
what else is; everything else is recomputed in the backward pass.

- `auto` (the default): `dots` on GPU and TPU, and `none` on CPU, where
  memory is the host's. On an H100 `dots` trains fastest (docs/benchmarks.md,
  MFU: the 1b preset at 47% MFU against 42% for `none`, which also runs out
  of memory at twice the batch); TPUs have not been measured.
- `none`: keep everything (no recomputation).
- `full`: keep only each unit's input; recompute the whole unit.
- `dots`: keep every matmul output (jax's `dots_saveable`, and by name the
  matmuls that round their float32 sums themselves, `models.matmul`),
  attention scores included on the xla attention path, and cuDNN's fused
  attention outputs (context and softmax statistics) on the cudnn path;
  recompute the elementwise work. Where the model computes attention from
  float32 sums (bfloat16 on CPU) only its context is kept: its backward pass
  recomputes the scores.
  `dots_with_no_batch_dims_saveable` would skip the scores, but the pipeline
  runs stages under a `vmap`, which gives every matmul a batch dimension: it
  would keep nothing there, so one name would mean two things.
- `minimal`: keep only the tensors named in `model.remat_names` (default
  `models.remat_names.MINIMAL`: the attention and MLP input projections and
  the dispatched expert inputs), like MaxText's "minimal". Naming
  `attention_context` keeps cuDNN's fused attention outputs too: its backward
  kernel needs the softmax statistics beside the context, and without them it
  runs the forward kernel again.
- `offload`: the same names, moved to pinned host memory instead of kept on
  the device (`save_and_offload_only_these_names`) on GPU and TPU. CPU has no
  device memory apart from the host's: there it is `minimal`. cuDNN's
  softmax statistics have no name, so `offload` never keeps them: its
  backward pass runs the attention forward kernel again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from models import remat_names

if TYPE_CHECKING:  # orchestrator.config declares its keys' choices with this module's names
    from orchestrator.config import Config

POLICIES = ("none", "full", "dots", "minimal", "offload")
CHOICES = ("auto", *POLICIES)  # model.remat's values: a policy, or auto (one by platform)
ACCELERATOR_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")  # jax platforms with device memory apart from the host's
NAMED_POLICIES = ("minimal", "offload")  # the policies `model.remat_names` applies to
# pipeline.remat (deprecated) -> model.remat; the old per-stage policies by jax's names.
PIPELINE_REMAT_ALIASES = {"none": "none", "full": "full", "dots_saveable": "dots",
                          "dots_with_no_batch_dims_saveable": "minimal"}


# jax's cuDNN attention binds primitives whose names start so ("dot_product_attention_fwd_wrapper"); their
# outputs are the context and the softmax statistics the backward kernel reads.
FUSED_ATTENTION_PRIMITIVE = "dot_product_attention_fwd"


def fused_attention_saveable(primitive, *_, **__) -> bool:
    """A `jax.checkpoint` policy: True for the outputs of cuDNN's fused attention forward kernel.

    `dots_saveable` does not see them (the kernel is no `dot_general`), so
    without this the backward pass of every unit reruns the attention forward
    kernel: on an H100 the 1b preset's forward attention kernels took 12.7 ms
    per step instead of 5.8 ms (docs/benchmarks.md, MFU)."""
    return primitive.name.startswith(FUSED_ATTENTION_PRIMITIVE)


def saved_names(config: Config) -> tuple[str, ...]:
    """Returns the activation names `minimal` and `offload` keep: `model.remat_names`, or the default set."""
    return tuple(config.model.remat_names) or remat_names.MINIMAL


def target_platform(config: Config, platform: str) -> str:
    """Returns the platform a run is meant for: `cluster.accelerator` when it names one, else that of a
    named `cluster.device_kind` (`tpu-...`: tpu, any other the table knows: gpu), else `platform`, the
    devices' own. `nestor explain` on CPU for an H100 thus compiles the remat policy an H100 would run."""
    cluster = config.cluster
    if cluster.accelerator != "cpu":
        return cluster.accelerator
    if cluster.device_kind:
        return "tpu" if cluster.device_kind.lower().startswith("tpu") else "gpu"
    return platform


def policy_name(config: Config, platform: str) -> str:
    """Returns the policy that runs for `model.remat` on devices of `platform` (a jax platform name):
    for `auto`, `dots` when the run is meant for accelerators (`target_platform`), else `none`;
    `offload` off accelerators is `minimal`; any other policy is itself."""
    name = config.model.remat
    if name == "auto":
        return "dots" if target_platform(config, platform) in ACCELERATOR_PLATFORMS else "none"
    if name == "offload" and platform not in ACCELERATOR_PLATFORMS:
        return "minimal"
    return name


def remat_policy(config: Config, platform: str) -> Callable[..., Any] | None:
    """Returns the `jax.checkpoint` policy of `model.remat` on `platform` (a jax platform name),
    or None for `none` (keep everything)."""
    name = policy_name(config, platform)
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    both = jax.checkpoint_policies.save_from_both_policies
    if name == "dots":
        float32_sums = jax.checkpoint_policies.save_only_these_names(remat_names.MATMUL_SUMS)
        return both(both(jax.checkpoint_policies.dots_saveable, float32_sums), fused_attention_saveable)
    names = saved_names(config)
    if name == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=names,
            offload_src="device", offload_dst="pinned_host")
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    return both(policy, fused_attention_saveable) if remat_names.ATTENTION_CONTEXT in names else policy
