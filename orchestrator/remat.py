"""Rematerialisation (`model.remat`): what each stacked unit keeps for the backward pass.

One policy for every way the stack runs: the scan wraps each unit in
`jax.checkpoint` with it, and the pipeline applies it to each layer of a stage
(`parallel.pipeline`). Either way a unit's input is kept and the policy picks
what else is; everything else is recomputed in the backward pass.

- `none`: keep everything (no recomputation).
- `full`: keep only each unit's input; recompute the whole unit.
- `dots`: keep every matmul output (jax's `dots_saveable`), attention scores
  included on the xla attention path; recompute the elementwise work.
  `dots_with_no_batch_dims_saveable` would skip the scores, but the pipeline
  runs stages under a `vmap`, which gives every matmul a batch dimension: it
  would keep nothing there, so one name would mean two things.
- `minimal`: keep only the tensors named in `model.remat_names` (default
  `models.remat_names.MINIMAL`: the attention and MLP input projections and
  the dispatched expert inputs), like MaxText's "minimal".
- `offload`: the same names, moved to pinned host memory instead of kept on
  the device (`save_and_offload_only_these_names`) on GPU and TPU. CPU has no
  device memory apart from the host's: there it is `minimal`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from models import remat_names

if TYPE_CHECKING:  # orchestrator.config declares its keys' choices with this module's names
    from orchestrator.config import Config

POLICIES = ("none", "full", "dots", "minimal", "offload")
NAMED_POLICIES = ("minimal", "offload")  # the policies `model.remat_names` applies to
OFFLOAD_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")
# pipeline.remat (deprecated) -> model.remat; the old per-stage policies by jax's names.
PIPELINE_REMAT_ALIASES = {"none": "none", "full": "full", "dots_saveable": "dots",
                          "dots_with_no_batch_dims_saveable": "minimal"}


def saved_names(config: Config) -> tuple[str, ...]:
    """Returns the activation names `minimal` and `offload` keep: `model.remat_names`, or the default set."""
    return tuple(config.model.remat_names) or remat_names.MINIMAL


def remat_policy(config: Config, platform: str) -> Callable[..., Any] | None:
    """Returns the `jax.checkpoint` policy of `model.remat` on `platform` (a jax platform name),
    or None for `none` (keep everything)."""
    name = config.model.remat
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots":
        return jax.checkpoint_policies.dots_saveable
    names = saved_names(config)
    if name == "offload" and platform in OFFLOAD_PLATFORMS:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=names,
            offload_src="device", offload_dst="pinned_host")
    return jax.checkpoint_policies.save_only_these_names(*names)
