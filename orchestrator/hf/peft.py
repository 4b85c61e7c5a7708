"""PEFT's LoRA adapter format both ways: `lora.init_from` reads an adapter directory (adapter_config.json,
adapter_model.safetensors) into nestor's adapters, and `nestor export --adapters` writes one that peft loads.

peft stores, per adapted Linear of the Hugging Face model, `base_model.model.<weight name>.lora_A.weight`
[rank, in] and `...lora_B.weight` [out, rank] and scales their product by lora_alpha / r. nestor's adapter
of the same weight is A [stack..., in..., rank], B [stack..., rank, out...] (models.lora), its in and out
dimensions split as the weight's are (orchestrator.hf.tensors): A = lora_A^T and B = lora_B^T, reshaped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np

from nestor.models import lora_names
from nestor.models.lora import SUFFIX
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.hf import safetensors
from nestor.orchestrator.hf.peft_config import CONFIG, KEY, WEIGHTS, read_config
from nestor.orchestrator.hf.tensors import Entry

PREFIX = "base_model.model."
# nestor's target -> (the last part of its weight's path in nestor's params, peft's module name)
WEIGHT_OF = {target: (target, peft) for peft, target in lora_names.PEFT_NAMES.items()}



def adapter_entries(model_entries: list[Entry], targets: tuple[str, ...]) -> list[tuple[Entry, str]]:
    """Returns (the base weight's entry, peft's name of the adapted module) of every adapted dense weight."""
    found = []
    for entry in model_entries:
        target = entry.path[-1]
        if target in targets and target in WEIGHT_OF and len(entry.stack) == 1 and \
                entry.path[-2] in ("attention", "mlp"):
            found.append((entry, target))
    return found


def _tensor_names(entry: Entry, layer: int) -> tuple[str, str]:
    weight = entry.name(layer)
    stem = weight[:-len(".weight")] if weight.endswith(".weight") else weight
    return f"{PREFIX}{stem}.lora_A.weight", f"{PREFIX}{stem}.lora_B.weight"


def _adapter_path(entry: Entry) -> tuple[str, ...]:
    return (*entry.path[:-1], entry.path[-1] + SUFFIX)


def load_adapters(config: Config, abstract: dict) -> dict:
    """Returns the adapters of `lora.init_from` laid out as `abstract` (the trained params, sharded
    jax.ShapeDtypeStructs); raises ConfigError naming a tensor that is missing or misshapen, or one the
    model has no adapter for."""
    from nestor.orchestrator.hf.load import checkpoint_entries  # the base's names, as model.init_from reads them

    directory = Path(config.lora.init_from)
    read_config(directory)
    if not config.model.init_from:
        raise ConfigError([(KEY, "an adapter adapts a Hugging Face checkpoint: set model.init_from to its base")])
    reader = safetensors.Reader(directory)
    rank = config.lora.rank
    loaded: dict = {}
    used = set()
    try:
        for entry, _ in adapter_entries(checkpoint_entries(config), tuple(lora_names.canonical(config.lora.targets))):
            out_shape, in_shape = entry.groups
            a_blocks, b_blocks = [], []
            for layer in range(entry.stack[0]):
                names = _tensor_names(entry, layer)
                expected = ((rank, math.prod(in_shape)), (math.prod(out_shape), rank))
                for name, shape in zip(names, expected):
                    tensor = reader.tensors.get(name)
                    if tensor is None or tensor.shape != shape:
                        found = "lacks it" if tensor is None else f"holds it as {list(tensor.shape)}"
                        raise ConfigError([(KEY, f"{directory / WEIGHTS}: tensor {name} {list(shape)}: the file "
                                                 f"{found}")])
                    if tensor.dtype not in safetensors.FLOATS:
                        raise ConfigError([(KEY, f"{directory / WEIGHTS}: tensor {name} has dtype "
                                                 f"{safetensors.NAMES[tensor.dtype]}, not a float type")])
                    used.add(name)
                a_blocks.append(reader.read(names[0]).astype(np.float32).T.reshape(*in_shape, rank))
                b_blocks.append(reader.read(names[1]).astype(np.float32).T.reshape(rank, *out_shape))
            node = loaded
            for part in _adapter_path(entry):
                node = node.setdefault(part, {})
            node["a"], node["b"] = np.stack(a_blocks), np.stack(b_blocks)
        surplus = sorted(set(reader.tensors) - used)
    finally:
        reader.close()
    if surplus:
        raise ConfigError([(KEY, f"{directory / WEIGHTS} holds tensors nestor's adapters (lora.targets) have no "
                                 f"place for: {', '.join(surplus[:3])}{' ...' if len(surplus) > 3 else ''}")])
    return jax.tree.map(lambda leaf, values: jax.make_array_from_callback(leaf.shape, leaf.sharding,
                                                                          lambda index: values[index]),
                        abstract, loaded)


def write_adapter(config: Config, model_entries: list[Entry], adapters: dict, out: Path, base_name: str) -> int:
    """Writes `adapters` (nestor's trained params, gathered to numpy) to `out` as a PEFT adapter directory
    (process 0); returns the tensors written. Raises ConfigError for adapters peft's LoRA of the dense
    projections cannot hold (the routed experts')."""
    targets = tuple(lora_names.canonical(config.lora.targets))
    if experts := [target for target in targets if target in lora_names.EXPERTS]:
        raise ConfigError([("lora.targets", f"{', '.join(experts)}: peft's adapter format holds the dense "
                                            "projections' adapters; export the merged model instead (no --adapters)")])
    tensors: dict[str, np.ndarray] = {}
    modules = []
    for entry, target in adapter_entries(model_entries, targets):
        node = adapters
        for part in _adapter_path(entry):
            node = node[part]
        a, b = np.asarray(node["a"], np.float32), np.asarray(node["b"], np.float32)
        rank = a.shape[-1]
        for layer in range(entry.stack[0]):
            a_name, b_name = _tensor_names(entry, layer)
            tensors[a_name] = a[layer].reshape(-1, rank).T
            tensors[b_name] = b[layer].reshape(rank, -1).T
        modules.append(WEIGHT_OF[target][1])
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        layout = {name: ("F32", values.shape) for name, values in sorted(tensors.items())}
        safetensors.create(out / WEIGHTS, layout, {"format": "pt"})
        head, offsets = safetensors.header_bytes(layout, {"format": "pt"})
        for name, values in tensors.items():
            tensor = safetensors.Tensor(out / WEIGHTS, np.dtype(np.float32), values.shape, len(head) + offsets[name])
            safetensors.write_box(out / WEIGHTS, tensor, tuple((0, size) for size in values.shape), values)
        (out / CONFIG).write_text(json.dumps(adapter_config(config, modules, base_name), indent=2, sort_keys=True)
                                  + "\n")
    return len(tensors)


def adapter_config(config: Config, modules: list[str], base_name: str) -> dict:
    """Returns the adapter_config.json of the run's adapters, with the keys peft 0.21 writes that matter."""
    return {
        "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": base_name, "bias": "none",
        "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "layer_replication": None, "layers_pattern": None, "layers_to_transform": None, "loftq_config": {},
        "lora_alpha": config.lora.alpha if config.lora.alpha != int(config.lora.alpha) else int(config.lora.alpha),
        "lora_bias": False, "lora_dropout": config.lora.dropout, "megatron_config": None,
        "megatron_core": "megatron.core", "modules_to_save": None, "peft_type": "LORA", "r": config.lora.rank,
        "rank_pattern": {}, "revision": None, "target_modules": modules, "target_parameters": None,
        "task_type": "CAUSAL_LM", "trainable_token_indices": None, "use_dora": False, "use_rslora": False,
    }
