"""A Hugging Face `config.json` as nestor's `model.*` and `moe.*` keys, and back.

Six architectures map onto nestor's LM: Llama (3 and 3.1, with `llama3` RoPE scaling), Mistral, Mixtral,
Qwen2 (query/key/value biases), Qwen3 (per-head query/key RMSNorm) and Qwen3-MoE. Configs written by
transformers 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`, `dtype`) both
read. A field that would make the model differ from what nestor computes is a ConfigError naming it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nestor.orchestrator.errors import ConfigError

KEY = "model.init_from"
CONFIG = "config.json"
DENSE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3"}
MOE = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
ARCHITECTURES = {**DENSE, **MOE}

# Fields that name, describe or serve the model without changing what its forward pass computes.
DESCRIPTIVE = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "max_position_embeddings",
    "output_router_logits", "router_aux_loss_coef", "return_dict", "output_attentions", "output_hidden_states",
    "id2label", "label2id", "tokenizer_class", "pretraining_tp", "max_window_layers", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder", "problem_type",
    "task_specific_params", "torchscript", "use_bfloat16", "finetuning_task", "prefix", "sep_token_id",
    "decoder_start_token_id", "num_labels", "cross_attention_hidden_size", "pruned_heads",
    "_attn_implementation_autoset",
}
# Fields that change the model, each with the values nestor computes exactly.
REQUIRED = {"hidden_act": ("silu",), "mlp_bias": (False, None), "attention_dropout": (0, 0.0, None),
            "router_jitter_noise": (0, 0.0, None), "use_sliding_window": (False, None), "sliding_window": (None,),
            "shared_expert_intermediate_size": (0, None), "use_mrope": (False, None)}
# Qwen configs carry a sliding_window that only use_sliding_window switches on
SWITCHED_WINDOW = ("qwen2", "qwen3", "qwen3_moe")
MAPPED = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "tie_word_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
          "attention_bias", "layer_types", "num_local_experts", "num_experts", "num_experts_per_tok",
          "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read(directory: Path) -> dict:
    """Returns the parsed config.json of a checkpoint directory; raises ConfigError naming model.init_from
    when the directory or its config.json is missing or unreadable."""
    if not directory.is_dir():
        raise ConfigError([(KEY, f"{directory} is not a directory")])
    path = directory / CONFIG
    if not path.is_file():
        raise ConfigError([(KEY, f"{directory} has no {CONFIG}: give a Hugging Face checkpoint directory "
                                 "(config.json and *.safetensors)")])
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError([(KEY, f"{path} does not parse as JSON: {error}")]) from None
    if not isinstance(config, dict):
        raise ConfigError([(KEY, f"{path} holds no JSON object")])
    return config


def architecture(config: dict, path: Path) -> str:
    """Returns the config's architecture (`architectures[0]`); raises ConfigError unless nestor maps it."""
    names = config.get("architectures") or []
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise ConfigError([(KEY, f"{path / CONFIG}: architectures: {names!r} is not a list of class names")])
    name = names[0] if names else None
    if name not in ARCHITECTURES:
        raise ConfigError([(KEY, f"{path / CONFIG}: architecture {name!r} is not supported; nestor imports "
                                 f"{', '.join(sorted(ARCHITECTURES))}")])
    return name


def _count(value) -> bool:
    return type(value) is int and value > 0


def _positive(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0


def _list_of(kind) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(kind(item) for item in value)


# Every field nestor reads: (whether it must be there, the check its value passes, what the check says).
FIELDS = {
    "vocab_size": (True, _count, "a positive integer"), "hidden_size": (True, _count, "a positive integer"),
    "num_hidden_layers": (True, _count, "a positive integer"),
    "num_attention_heads": (True, _count, "a positive integer"),
    "intermediate_size": (True, _count, "a positive integer"),
    "num_key_value_heads": (False, _count, "a positive integer"), "head_dim": (False, _count, "a positive integer"),
    "tie_word_embeddings": (False, lambda v: isinstance(v, bool), "true or false"),
    "attention_bias": (False, lambda v: isinstance(v, bool), "true or false"),
    "norm_topk_prob": (False, lambda v: isinstance(v, bool), "true or false"),
    "rms_norm_eps": (False, _positive, "a positive number"), "rope_theta": (False, _positive, "a positive number"),
    "rope_scaling": (False, lambda v: isinstance(v, dict), "a mapping"),
    "rope_parameters": (False, lambda v: isinstance(v, dict), "a mapping"),
    "layer_types": (False, _list_of(lambda item: isinstance(item, str)), "a list of names"),
    "num_local_experts": (False, _count, "a positive integer"), "num_experts": (False, _count, "a positive integer"),
    "num_experts_per_tok": (False, _count, "a positive integer"),
    "moe_intermediate_size": (False, _count, "a positive integer"),
    "decoder_sparse_step": (False, _count, "a positive integer"),
    "mlp_only_layers": (False, _list_of(lambda item: type(item) is int and item >= 0), "a list of layer numbers"),
}
# The fields of a RoPE mapping (rope_parameters, rope_scaling) nestor reads.
ROPE_FIELDS = {"rope_theta": (_positive, "a positive number"), "rope_type": (lambda v: isinstance(v, str), "a name"),
               "type": (lambda v: isinstance(v, str), "a name"),
               **{name: (_positive, "a positive number") for name in LLAMA3_KEYS}}


def field_problems(config: dict, moe: bool) -> list[tuple[str, str]]:
    """Returns (field, what is wrong) for each field of a config.json that nestor reads and whose value is
    missing where required (the MoE fields only of an MoE architecture) or of the wrong type or range."""
    problems = []
    for field, (required, check, what) in FIELDS.items():
        value = config.get(field)
        if value is None:
            if required:
                problems.append((field, f"is missing; nestor needs {what}"))
        elif not check(value):
            problems.append((field, f"{value!r} is not {what}"))
    if moe and not (config.get("num_local_experts") or config.get("num_experts")):
        problems.append(("num_experts", "is missing (or num_local_experts); nestor needs a positive integer"))
    if moe and config.get("num_experts_per_tok") is None:
        problems.append(("num_experts_per_tok", "is missing; nestor needs a positive integer"))
    if config.get("architectures") == ["Qwen3MoeForCausalLM"] and config.get("moe_intermediate_size") is None:
        problems.append(("moe_intermediate_size", "is missing; nestor needs a positive integer"))
    for mapping in ("rope_parameters", "rope_scaling"):
        parameters = config.get(mapping)
        if isinstance(parameters, dict) and isinstance(parameters.get("full_attention"), dict):
            parameters = parameters["full_attention"]
        for field, (check, what) in ROPE_FIELDS.items():
            if isinstance(parameters, dict) and parameters.get(field) is not None and not check(parameters[field]):
                problems.append((f"{mapping}.{field}", f"{parameters[field]!r} is not {what}"))
    return problems


def _rope(config: dict, problem) -> tuple[float, dict | None]:
    """Returns (rope_theta, nestor's model.rope_scaling) from either spelling of the RoPE settings."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and "full_attention" in parameters:  # per layer type (transformers 5)
        parameters = parameters["full_attention"]
    if parameters is None:
        parameters = dict(config.get("rope_scaling") or {})
        parameters.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    theta = float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        problem("rope_scaling", f"rope_type {kind!r} is not implemented (nestor: default, llama3)")
        return theta, None
    missing = [name for name in LLAMA3_KEYS if name not in parameters]
    if missing:
        problem("rope_scaling", f"llama3 scaling without {', '.join(missing)}")
        return theta, None
    return theta, {"type": "llama3", **{name: parameters[name] for name in LLAMA3_KEYS}}


def sections(directory: Path) -> dict:
    """Returns {"model": {...}, "moe": {...}} for the checkpoint in `directory`: the nestor keys that build
    the same model. Raises ConfigError listing every field nestor cannot honour."""
    config = read(directory)
    name = architecture(config, directory)
    problems = []

    def problem(field: str, message: str) -> None:
        problems.append((KEY, f"{directory / CONFIG}: {field}: {message}"))

    family = ARCHITECTURES[name]
    if wrong := field_problems(config, name in MOE):  # each field nestor reads, before any is used
        raise ConfigError([(KEY, f"{directory / CONFIG}: {field}: {message}") for field, message in wrong])
    for field, value in config.items():
        if field in DESCRIPTIVE or field in MAPPED:
            continue
        if field == "sliding_window" and family in SWITCHED_WINDOW and not config.get("use_sliding_window"):
            continue
        if field in REQUIRED:
            if value not in REQUIRED[field]:
                problem(field, f"{value!r} is not implemented (nestor computes {REQUIRED[field][0]!r})")
            continue
        problem(field, "is a field nestor does not implement; it would change the model")
    heads = config["num_attention_heads"]
    theta, scaling = _rope(config, problem)
    if any(kind != "full_attention" for kind in config.get("layer_types") or []):
        problem("layer_types", f"{config['layer_types']}: nestor's layers are all full_attention")
    bias = bool(config.get("attention_bias", False))
    model = {
        "vocab_size": config["vocab_size"], "embed_dim": config["hidden_size"],
        "num_layers": config["num_hidden_layers"], "num_heads": heads,
        "num_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "mlp_dim": config["intermediate_size"], "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "rope_theta": theta, "rope_scaling": scaling, "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "qkv_bias": bias or family == "qwen2", "out_bias": bias, "qk_norm": family in ("qwen3", "qwen3_moe"),
    }
    moe: dict[str, Any] = {"num_experts": 0, "every": 0}
    if name in MOE:
        moe = _moe_keys(config, family, problem)
    if problems:
        raise ConfigError(problems)
    return {"model": model, "moe": moe}


def _moe_keys(config: dict, family: str, problem) -> dict:
    """Returns the moe.* keys of Mixtral or Qwen3-MoE: dropless routing (as transformers computes it)."""
    experts = config.get("num_local_experts") or config.get("num_experts")
    keys = {"num_experts": experts, "every": 1, "top_k": config["num_experts_per_tok"], "capacity_factor": 0.0,
            "router": "softmax", "normalize_gates": True, "expert_mlp_dim": 0, "first_dense_layers": 0}
    if family == "qwen3_moe":
        step = config.get("decoder_sparse_step", 1)
        dense = sorted(config.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))) or len(dense) % step:
            problem("mlp_only_layers", f"{dense} with decoder_sparse_step {step}: nestor keeps dense only the first "
                                       "layers, a multiple of the sparse step")
        keys.update(every=step, first_dense_layers=len(dense), normalize_gates=bool(config.get("norm_topk_prob")),
                    expert_mlp_dim=config["moe_intermediate_size"])
    return keys


def to_hf(model: dict, moe: dict, base: dict | None) -> dict:
    """Returns the config.json of nestor's LM with `model.*` and `moe.*` keys `model` and `moe`: `base` (the
    imported checkpoint's config) with every mapped field set from the keys, or else a new config of the
    architecture the keys describe. Raises ConfigError when no supported architecture computes that model."""
    name = (base.get("architectures") or [None])[0] if base else _architecture_of(model, moe)
    config = dict(base or {"architectures": [name], "model_type": ARCHITECTURES[name], "hidden_act": "silu",
                           "dtype": "float32"})
    family = ARCHITECTURES[name]
    if _architecture_of(model, moe, family) != name:
        raise ConfigError([("model", f"these model.* and moe.* keys are no {name}")])
    config.update(vocab_size=model["vocab_size"], hidden_size=model["embed_dim"],
                  num_hidden_layers=model["num_layers"], num_attention_heads=model["num_heads"],
                  intermediate_size=model["mlp_dim"], tie_word_embeddings=model["tie_embeddings"],
                  rms_norm_eps=model["norm_eps"])
    # fields a config may leave to their defaults are written where the base has them or they differ
    defaults = {"num_key_value_heads": model["num_heads"], "head_dim": model["embed_dim"] // model["num_heads"]}
    for field, key in (("num_key_value_heads", "num_kv_heads"), ("head_dim", "head_dim")):
        if field in config or model[key] != defaults[field]:
            config[field] = model[key]
    rope = {"rope_type": "llama3" if model["rope_scaling"] else "default", "rope_theta": model["rope_theta"],
            **{key: model["rope_scaling"][key] for key in LLAMA3_KEYS if model["rope_scaling"]}}
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"} if model["rope_scaling"] else None
    if "rope_parameters" in config or not base:  # transformers 5's spelling; a new config has both
        config["rope_parameters"] = rope
    if "rope_parameters" not in (base or {}):  # transformers 4's spelling, which vLLM on it reads
        config["rope_theta"] = model["rope_theta"]
        if scaling or "rope_scaling" in config:
            config["rope_scaling"] = scaling
    if family != "qwen2" and ("attention_bias" in config or model["out_bias"]):
        config["attention_bias"] = model["out_bias"]
    if family == "mixtral":
        config.update(num_local_experts=moe["num_experts"], num_experts_per_tok=moe["top_k"])
    if family == "qwen3_moe":
        config.update(num_experts=moe["num_experts"], num_experts_per_tok=moe["top_k"],
                      moe_intermediate_size=moe["expert_mlp_dim"] or model["mlp_dim"],
                      norm_topk_prob=moe["normalize_gates"], decoder_sparse_step=moe["every"],
                      mlp_only_layers=list(range(moe["first_dense_layers"])))
    return config


def _architecture_of(model: dict, moe: dict, family: str | None = None) -> str:
    """Returns the architecture that computes nestor's LM with these keys (preferring `family`'s); raises
    ConfigError naming what no supported architecture has."""
    problems = []
    if moe["num_experts"] and moe["every"]:
        if moe["router"] != "softmax" or moe["shared_experts"] or moe["bias_update_rate"]:
            problems.append(("moe", "only a softmax router without shared experts or expert biases exports "
                                    "(Mixtral, Qwen3-MoE)"))
        elif model["qk_norm"] and model["qkv_bias"] == model["out_bias"]:
            return "Qwen3MoeForCausalLM"
        elif (not model["qk_norm"] and not model["qkv_bias"] and not model["out_bias"] and moe["every"] == 1
              and not moe["first_dense_layers"] and moe["normalize_gates"] and not moe["expert_mlp_dim"]):
            return "MixtralForCausalLM"
        else:
            problems.append(("moe", "exports as Mixtral (every layer MoE, gates renormalised, no q/k norm, no "
                                    "biases) or Qwen3-MoE (q/k norm, all four attention biases or none)"))
    elif model["qk_norm"] and model["qkv_bias"] == model["out_bias"]:
        return "Qwen3ForCausalLM"
    elif model["qk_norm"]:
        problems.append(("model.qk_norm", "Qwen3 has all four attention biases or none (qkv_bias = out_bias)"))
    elif model["qkv_bias"] and not model["out_bias"]:
        return "Qwen2ForCausalLM"
    elif model["qkv_bias"] == model["out_bias"]:
        return {"mistral": "MistralForCausalLM"}.get(family or "", "LlamaForCausalLM")
    else:
        problems.append(("model.out_bias", "an output bias without query/key/value biases is no supported "
                                           "architecture"))
    raise ConfigError(problems)
