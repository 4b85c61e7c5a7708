"""A PEFT LoRA adapter's adapter_config.json as nestor's `lora` keys (jax-free: the config loader reads it)."""

from __future__ import annotations

import json
from pathlib import Path

from nestor.models import lora_names
from nestor.orchestrator.errors import ConfigError

KEY = "lora.init_from"
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# adapter_config.json fields whose other values peft computes differently from nestor's LoRA
UNSUPPORTED = {"use_dora": (False, None), "use_rslora": (False, None), "bias": ("none",), "fan_in_fan_out": (False,),
               "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "layers_to_transform": (None,),
               "modules_to_save": (None,), "target_parameters": (None,), "lora_bias": (False, None),
               "use_qalora": (False, None), "trainable_token_indices": (None,)}


def read_config(directory: Path) -> dict:
    """Returns the parsed adapter_config.json of a PEFT adapter directory; raises ConfigError (lora.init_from)
    when it is missing, not a LoRA adapter, or asks for what nestor does not compute."""
    path = directory / CONFIG
    if not path.is_file():
        raise ConfigError([(KEY, f"{directory} has no {CONFIG}: give a PEFT LoRA adapter directory")])
    try:
        adapter = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError([(KEY, f"{path} does not parse as JSON: {error}")]) from None
    problems = []
    if adapter.get("peft_type") != "LORA":
        problems.append((KEY, f"{path}: peft_type {adapter.get('peft_type')!r}; nestor reads LORA adapters"))
    for field, allowed in UNSUPPORTED.items():
        if adapter.get(field, allowed[0]) not in allowed:
            problems.append((KEY, f"{path}: {field} {adapter[field]!r} is not supported (nestor computes "
                                  f"{field}={allowed[0]!r})"))
    targets = adapter.get("target_modules") or []
    if isinstance(targets, str):
        problems.append((KEY, f"{path}: target_modules is a pattern ({targets!r}); list the modules"))
    elif unknown := sorted(set(targets) - set(lora_names.PEFT_NAMES)):
        problems.append((KEY, f"{path}: target_modules {unknown} are not projections nestor adapts "
                              f"({', '.join(lora_names.PEFT_NAMES)})"))
    if problems:
        raise ConfigError(problems)
    return adapter


def lora_sections(directory: Path) -> dict:
    """Returns the `lora` keys an adapter directory implies: its rank, alpha, targets and dropout."""
    adapter = read_config(directory)
    return {"lora": {"rank": int(adapter["r"]), "alpha": float(adapter["lora_alpha"]),
                     "targets": list(lora_names.canonical(tuple(adapter["target_modules"]))),
                     "dropout": float(adapter.get("lora_dropout") or 0.0)}}
