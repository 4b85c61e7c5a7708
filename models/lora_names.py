"""Names of the weights of nestor's LM a LoRA adapter may target (models.lora), defined once, jax-free so
that the config schema can list them."""

from __future__ import annotations

DENSE = ("query", "key", "value", "out", "gate", "up", "down")  # attention and (shared-expert) MLP projections
EXPERTS = ("expert_gate", "expert_up", "expert_down")  # the routed experts' matrices, one adapter per expert
TARGETS = DENSE + EXPERTS
# peft's module names for the dense projections (a Llama's), accepted as aliases and written on export
PEFT_NAMES = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "o_proj": "out",
              "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
ALL = TARGETS + tuple(PEFT_NAMES)


def canonical(targets: tuple[str, ...]) -> tuple[str, ...]:
    """Returns `targets` with peft's names replaced by nestor's, each once, in TARGETS' order."""
    named = {PEFT_NAMES.get(target, target) for target in targets}
    return tuple(target for target in TARGETS if target in named)
