"""Rematerialisation policies (`model.remat`): what each stacked unit keeps for the backward pass.

One policy for every way the stack runs: the scan wraps each unit in
`jax.checkpoint` with it, and the pipeline applies it to each layer of a stage.
A unit's input is always kept; the policy picks what else is, and the rest is
recomputed in the backward pass.

- `none`: keep everything (no recomputation).
- `full`: keep only each unit's input; recompute the whole unit.
- `dots`: keep every matmul output (jax's `dots_saveable`, and by name the
  matmuls a custom rule or kernel hides from it, `remat_names.MATMUL_SUMS`),
  and cuDNN's fused attention outputs (context and softmax statistics);
  recompute the elementwise work. `dots_with_no_batch_dims_saveable` would skip
  attention's scores, but a pipeline runs its stages under a `vmap`, which gives
  every matmul a batch dimension: there it would keep nothing.
- `minimal`: keep only the tensors named in `model.remat_names` (default
  `remat_names.MINIMAL`), like MaxText's "minimal". Naming `attention_context`
  keeps cuDNN's fused attention outputs too: its backward kernel needs the
  softmax statistics beside the context.
- `offload`: the same names moved to pinned host memory instead of kept on the
  device (`save_and_offload_only_these_names`); where the device memory is the
  host's, the backend runs `minimal` instead.

`auto` is the backend's choice for its target (nestor.backend).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from nestor.models import remat_names

POLICIES = ("none", "full", "dots", "minimal", "offload")
CHOICES = ("auto", *POLICIES)  # model.remat's values: a policy, or auto (the backend's)
NAMED_POLICIES = ("minimal", "offload")  # the policies `model.remat_names` applies to

# jax's cuDNN attention binds primitives whose names start so ("dot_product_attention_fwd_wrapper"); their
# outputs are the context and the softmax statistics the backward kernel reads.
FUSED_ATTENTION_PRIMITIVE = "dot_product_attention_fwd"


def fused_attention_saveable(primitive, *_, **__) -> bool:
    """A `jax.checkpoint` policy: True for the outputs of cuDNN's fused attention forward kernel, which
    `dots_saveable` does not see (no `dot_general`); without it every unit's backward pass reruns the
    attention forward kernel."""
    return primitive.name.startswith(FUSED_ATTENTION_PRIMITIVE)


def policy(name: str, names: tuple[str, ...] = ()) -> Callable[..., Any] | None:
    """Returns the `jax.checkpoint` policy of remat policy `name` (one of POLICIES), or None for `none`
    (keep everything); `names` are the activations `minimal` and `offload` keep (empty: MINIMAL)."""
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    both = jax.checkpoint_policies.save_from_both_policies
    if name == "dots":
        matmul_sums = jax.checkpoint_policies.save_only_these_names(remat_names.MATMUL_SUMS)
        return both(both(jax.checkpoint_policies.dots_saveable, matmul_sums), fused_attention_saveable)
    names = tuple(names) or remat_names.MINIMAL
    if name == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=names,
            offload_src="device", offload_dst="pinned_host")
    if name != "minimal":
        raise ValueError(f"remat policy {name!r}: one of {', '.join(POLICIES)}")
    saved = jax.checkpoint_policies.save_only_these_names(*names)
    return both(saved, fused_attention_saveable) if remat_names.ATTENTION_CONTEXT in names else saved
