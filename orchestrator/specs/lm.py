"""nestor's decoder LM (`model.class: lm`, built from the `model.*` and `moe.*` keys) as a model spec: its
checks of those keys (alone and against the mesh), analytic FLOPs (specs.lm_flops), decoding, Hugging Face
mapping (orchestrator.hf) and the layout of its pipelined `blocks` stack."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from flax import nnx

from nestor.backend.mosaic_gpu import TILE, tiles
from nestor.models import axes, lora_names
from nestor.models.lora import LoraConfig
from nestor.models.moe import MoELayerConfig, expert_capacity
from nestor.models.transformer import STACK, RopeScaling, Transformer, TransformerConfig
from nestor.orchestrator.config.keys import ARRAY_SOURCES, INT32_MAX, key_table, moe_on
from nestor.orchestrator.config.degrees import moe_tokens_per_device
from nestor.orchestrator.specs.base import ModelSpec, Problems
from nestor.orchestrator.specs.lm_flops import executed_flops_per_step, model_flops_per_step
from nestor.parallel.pipeline import Schedule
from nestor.parallel.rules import DEFAULT_RULES, resolve_rules, split_degree

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config

LM = "lm"  # the LM's name in `model.class`
ACTIVATION_AXES = (axes.BATCH, axes.LENGTH, axes.ACT_EMBED)  # of the stack's input and output
# the keys whose values shape a checkpoint's arrays, compared before launch (orchestrator.commands.launch_checks)
SHAPING = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
           "tie_embeddings", "qkv_bias", "out_bias", "qk_norm")
MOE_SHAPING = ("num_experts", "every", "expert_mlp_dim", "shared_experts", "first_dense_layers")
MOE_LAYOUT_KEYS = ("moe.num_experts", "moe.every")  # 0 and 0 make a dense model
# the key that sizes parameters along a logical axis (an out-of-memory message names it)
SIZE_KEYS = {axes.VOCAB: "model.vocab_size", axes.EMBED: "model.embed_dim", axes.MLP: "model.mlp_dim",
             axes.HEADS: "model.num_heads", axes.KV_HEADS: "model.num_kv_heads", axes.HEAD_DIM: "model.head_dim",
             axes.LAYERS: "model.num_layers", axes.DENSE_LAYERS: "moe.first_dense_layers",
             axes.EXPERT: "moe.num_experts"}


class LanguageModel(ModelSpec):
    """nestor's decoder LM: rows of tokens, analytic FLOPs, decoding, Hugging Face architectures, parameters
    laid out by construction."""

    counts_tokens = decodes = hugging_face = splits_rows = True
    layout_checked = False

    def build(self, config: Config, rngs: nnx.Rngs) -> nnx.Module:
        return Transformer(lm_config(config), rngs)

    def key_problems(self, config: Config) -> Problems:
        m = config.model
        problems = []
        if m.head_dim % 2:
            problems.append(("model.head_dim", f"RoPE needs an even head_dim, got {m.head_dim}"))
        if m.num_heads % m.num_kv_heads:
            problems.append(("model.num_kv_heads", f"must divide model.num_heads={m.num_heads}, got {m.num_kv_heads}"))
        problems += _rope_scaling_problems(m.rope_scaling)
        if config.pipeline.stack != STACK:
            problems.append(("pipeline.stack", f"nestor's LM pipelines its {STACK!r} stack (got {config.pipeline.stack!r})"))
        if m.attention == "cudnn" and m.dtype == "float32":
            problems.append(("model.attention", "cudnn flash attention needs model.dtype bfloat16 or float16; "
                                                "use auto or xla for float32"))
        if m.matmul_precision == "fp8" and m.dtype != "bfloat16":
            problems.append(("model.matmul_precision", f"fp8 runs with model.dtype bfloat16 (the dtype of everything "
                                                       f"that is not a weight matmul), not {m.dtype}"))
        if m.dtype == "float16" and config.cluster.accelerator == "cpu":  # configure_jax compiles it on XLA:CPU
            problems.append(("model.dtype", "float16 needs a GPU (cluster.accelerator=gpu): XLA:CPU, which compiles "
                                            "for cluster.accelerator=cpu (explain's too), has no float16 matmul "
                                            "with float32 sums; use bfloat16 or float32"))
        return problems + product_problems(config) + _data_problems(config) + _lora_problems(config)

    def mesh_problems(self, config: Config, degrees: dict[str, int] | None) -> Problems:
        return _moe_problems(config, degrees)

    def split_problems(self, config: Config, degrees: dict[str, int]) -> Problems:
        return _divisibility_problems(config, degrees) + _context_problems(config, degrees)

    def rule_axes(self):
        return DEFAULT_RULES

    def pipeline_units(self, config: Config, schedule: Schedule) -> tuple[int, str]:
        # With MoE the stack is made of units of moe.every layers (the last one MoE) after the first dense
        # layers, which run before the pipeline: stages split units.
        moe = config.moe
        every = moe.every if moe.num_experts and moe.every else 1
        first_dense = moe.first_dense_layers if moe.num_experts and moe.every else 0
        note = f" (counted in units of moe.every={every} layers)" if every > 1 else ""
        if first_dense:
            note += f" (after moe.first_dense_layers={first_dense}, which run before the pipeline)"
        return (config.model.num_layers - first_dense) // every, note

    def flops_per_step(self, config: Config) -> tuple[float, float]:
        return model_flops_per_step(config), executed_flops_per_step(config)

    def size_key(self, logical_axis: str | None) -> str:
        return SIZE_KEYS.get(logical_axis, "model.args")

    def checkpoint_shape_keys(self, current: dict, saved: dict) -> list[tuple[str, str]] | None:
        if saved.get("model", {}).get("class", LM) != LM:
            return None  # another model's checkpoint: the workers' restore names what differs
        keys = [("model", key) for key in SHAPING]
        if moe_on(saved.get("moe", {})) or moe_on(current["moe"]):
            both = moe_on(saved.get("moe", {})) and moe_on(current["moe"])
            keys += [("moe", key) for key in (MOE_SHAPING if both else ("num_experts", "every"))]
        return keys

    def activation_axes(self, ndim: int) -> tuple[str | None, ...]:
        return ACTIVATION_AXES

    def idle_modes(self, config: Config) -> list[tuple[tuple[str, ...], str]]:
        modes = [(("model.args",), "model.class=lm is built from the model.* keys; model.args is a model of "
                                   "your own's")]
        if config.moe.num_experts:
            return modes
        moe_keys = tuple(path for path, *_ in key_table(type(config)) if path.startswith("moe.") and
                         path not in MOE_LAYOUT_KEYS)
        return modes + [(moe_keys + ("metrics.image_every",), "moe.num_experts=0: a dense model")]

    def dropless_layers(self, config: Config) -> bool:
        return config.dropless_moe


def lm_config(config: Config) -> TransformerConfig:
    """Returns the built-in LM's own config from the run config's `model.*` and `moe.*` keys."""
    m = config.model
    return TransformerConfig(
        vocab_size=m.vocab_size, embed_dim=m.embed_dim, num_layers=m.num_layers,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        mlp_dim=m.mlp_dim, tie_embeddings=m.tie_embeddings, rope_theta=m.rope_theta,
        rope_scaling=rope_scaling(m.rope_scaling), qkv_bias=m.qkv_bias, out_bias=m.out_bias, qk_norm=m.qk_norm,
        norm_eps=m.norm_eps, init_std=m.init_std, dtype=m.dtype, moe=moe_layer_config(config),
        lora=lora_config(config),
    )


def lora_config(config: Config) -> LoraConfig:
    """Returns the LM's adapters from the run config's `lora` section (none when lora.rank is 0)."""
    section = config.lora
    return LoraConfig(rank=section.rank, alpha=section.alpha, targets=lora_names.canonical(section.targets),
                      dropout=section.dropout)


def moe_layer_config(config: Config) -> MoELayerConfig:
    """Returns the LM's MoE settings from the run config's `moe` section."""
    moe = config.moe
    return MoELayerConfig(
        num_experts=moe.num_experts, every=moe.every, top_k=moe.top_k, capacity_factor=moe.capacity_factor,
        eval_capacity_factor=moe.eval_capacity_factor, group_size=moe.group_size,
        second_expert_policy=moe.second_expert_policy, dispatch=moe.dispatch, router=moe.router,
        normalize_gates=moe.normalize_gates,
        expert_mlp_dim=moe.expert_mlp_dim, shared_experts=moe.shared_experts,
        first_dense_layers=moe.first_dense_layers, bias_update_rate=moe.bias_update_rate,
        aux_loss_weight=moe.aux_loss_weight, z_loss_weight=moe.z_loss_weight,
    )


def rope_scaling(keys: dict | None) -> RopeScaling | None:
    """Returns the LM's RoPE scaling from `model.rope_scaling` (validated: orchestrator.loader.validation)."""
    if not keys:
        return None
    return RopeScaling(factor=float(keys["factor"]), low_freq_factor=float(keys["low_freq_factor"]),
                       high_freq_factor=float(keys["high_freq_factor"]),
                       original_max_position_embeddings=int(keys["original_max_position_embeddings"]))


ROPE_SCALING_KEYS = ("type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_scaling_problems(scaling: dict | None) -> list[tuple[str, str]]:
    """model.rope_scaling: Llama 3.1's scaling, every number positive, the low frequency factor below the high."""
    if scaling is None:
        return []
    key = "model.rope_scaling"
    if scaling.get("type") != "llama3":
        return [(key, f"type {scaling.get('type')!r} is not implemented; nestor's LM implements llama3 (or null)")]
    if sorted(scaling) != sorted(ROPE_SCALING_KEYS):
        return [(key, f"llama3 scaling takes exactly {', '.join(ROPE_SCALING_KEYS)}; got {', '.join(scaling)}")]
    numbers = {name: scaling[name] for name in ROPE_SCALING_KEYS[1:]}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in numbers.values()):
        return [(key, f"factor, the frequency factors and original_max_position_embeddings are positive numbers; "
                      f"got {numbers}")]
    if numbers["low_freq_factor"] >= numbers["high_freq_factor"]:
        return [(key, f"low_freq_factor ({numbers['low_freq_factor']}) must be below high_freq_factor "
                      f"({numbers['high_freq_factor']})")]
    return []


TOKENS_KEY = "train.global_batch, train.seq_len"


def _lora_problems(config: Config) -> list[tuple[str, str]]:
    """Returns the problems of the `lora` keys: adapters on nothing, or on experts a dense model lacks."""
    section = config.lora
    if config.train.objective == "dpo":
        if config.pipeline.schedule not in ("gpipe", "circular") and config.mesh.pipeline != 1:
            return [("pipeline.schedule", f"train.objective=dpo runs under gpipe or circular; "
                                          f"{config.pipeline.schedule} runs the model's own loss in its loop")]
    if not section.rank:
        return []
    if unknown := [target for target in section.targets if target not in lora_names.ALL]:
        return [("lora.targets", f"{', '.join(map(repr, unknown))}: nestor's LM adapts "
                                 f"{', '.join(lora_names.TARGETS)} (or peft's {', '.join(lora_names.PEFT_NAMES)})")]
    targets = lora_names.canonical(section.targets)
    if not targets:
        return [("lora.targets", "lora.rank > 0 adapts the weights named here; name at least one")]
    experts = [target for target in targets if target in lora_names.EXPERTS]
    if experts and not moe_on(config.to_dict()["moe"]):
        return [("lora.targets", f"{', '.join(experts)} adapt routed experts, and the model is dense "
                                 "(moe.num_experts and moe.every are 0)")]
    return []


def product_problems(config: Config) -> list[tuple[str, str]]:
    """Returns (key path, message) for each product of keys past INT32_MAX in a step of nestor's LM: its
    tokens, and its MoE layers' routed tokens and slots."""
    t = config.train
    step = t.global_batch * (t.seq_len + 1)  # a row of tokens holds its last target too
    if step > INT32_MAX:
        return [(TOKENS_KEY, f"train.global_batch x (train.seq_len + 1) = {step:,} tokens a step, more than "
                             f"{INT32_MAX:,}; use a smaller batch or shorter sequences")]
    if config.moe.num_experts and config.moe.every:
        return _moe_products(config)
    return []


def _moe_products(config: Config) -> list[tuple[str, str]]:
    """The MoE layers' int32 indices: top_k choices of a step's tokens, and each group's expert slots
    (moe.num_experts x the capacity of each capacity factor; none when dropless)."""
    moe, t = config.moe, config.train
    routed = moe.top_k * t.global_batch * t.seq_len
    if routed > INT32_MAX:
        return [("moe.top_k", f"{moe.top_k} choices for each of the {t.global_batch * t.seq_len:,} tokens of a step "
                              f"= {routed:,} routed tokens, more than {INT32_MAX:,}; route fewer or shorten the step")]
    problems = []
    tokens_per_group = moe.group_size or t.seq_len
    for name in ("capacity_factor", "eval_capacity_factor") if moe.capacity_factor else ():  # 0: dropless
        factor = getattr(moe, name)
        slots = moe.num_experts * expert_capacity(tokens_per_group, moe.num_experts, moe.top_k, factor)
        if slots > INT32_MAX:
            most = INT32_MAX / (moe.top_k * tokens_per_group)
            problems.append((f"moe.{name}", f"{factor:g} gives a group's {moe.num_experts} experts {slots:,} slots, "
                                            f"more than {INT32_MAX:,}; use at most {most:.4g} (above "
                                            f"moe.num_experts / moe.top_k = {moe.num_experts / moe.top_k:g} no "
                                            "token is ever dropped)"))
    return problems


def _data_problems(config: Config) -> list[tuple[str, str]]:
    """data.mixture is for prepared token shards; each entry is {paths: [dirs], weight: w > 0}; the
    tokens source needs directories from data.paths or data.mixture."""
    data = config.data
    if config.train.objective == "dpo":
        return [] if data.source == "arrays" else [
            ("data.source", "train.objective=dpo reads preference pairs: data.source=arrays with data.paths the "
                            ".npz files `nestor data prepare` writes from prompt/chosen/rejected JSONL")]
    if data.source in ARRAY_SOURCES:
        return [("data.source", "named arrays feed a model.class of your own; nestor's language model (model.class: "
                                "lm) reads synthetic, text or tokens, and preference pairs with train.objective=dpo")]
    if data.mixture and data.source != "tokens":
        return [("data.mixture", f"mixes prepared token shards; set data.source=tokens (it is {data.source})")]
    if data.source == "tokens" and not data.paths and not data.mixture:
        return [("data.paths", "data.source=tokens needs directories written by `nestor data prepare` "
                               "(or a data.mixture)")]
    problems = []
    for index, entry in enumerate(data.mixture):
        where = f"data.mixture[{index}]"
        if unknown := sorted(set(entry) - {"paths", "weight"}):
            problems.append((f"{where}.{unknown[0]}", "unknown key; an entry has paths and weight"))
        paths = entry.get("paths")
        if not paths or not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            problems.append((f"{where}.paths", f"expected a directory or a list of them, got {paths!r}"))
        weight = entry.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or weight <= 0:
            problems.append((f"{where}.weight", f"must be a number > 0, got {weight!r}"))
    return problems


def _moe_problems(config: Config, degrees: dict[str, int] | None) -> list[tuple[str, str]]:
    """Returns the problems of the `moe` section; checks against the mesh need its `degrees`."""
    moe, m, t = config.moe, config.model, config.train
    if (moe.num_experts > 0) != (moe.every > 0):
        return [("moe.every", f"moe.every={moe.every} and moe.num_experts={moe.num_experts}: set both > 0 for an "
                              "MoE model or both 0 for a dense one")]
    if moe.num_experts == 0:
        return []
    problems = []
    stacked_layers = m.num_layers - moe.first_dense_layers
    if stacked_layers < 1:
        problems.append(("moe.first_dense_layers", f"{moe.first_dense_layers} leaves no MoE layer of "
                                                   f"model.num_layers={m.num_layers}; use fewer"))
    elif stacked_layers % moe.every:
        problems.append(("moe.every", f"{moe.every} does not divide the {stacked_layers} layers after "
                                      f"moe.first_dense_layers={moe.first_dense_layers}; the stacked unit is "
                                      "moe.every layers, so pick a divisor"))
    if moe.top_k > moe.num_experts:
        problems.append(("moe.top_k", f"must be at most moe.num_experts={moe.num_experts}, got {moe.top_k}"))
    tokens_per_group = moe.group_size or t.seq_len
    for key in ("capacity_factor", "eval_capacity_factor") if moe.capacity_factor else ():  # 0: dropless
        factor = getattr(moe, key)
        if expert_capacity(tokens_per_group, moe.num_experts, moe.top_k, factor) < 1:
            problems.append((f"moe.{key}", f"{factor:g} gives experts no capacity (under one token per group); raise it"))
    mlp_shards = 1 if degrees is None else split_degree("mlp", resolve_rules(config.mesh.rules), degrees)
    width = (moe.expert_mlp_dim or m.mlp_dim) // mlp_shards
    if moe.grouped_matmul == "mosaic_gpu" and config.dropless_moe and not tiles(m.embed_dim, width):
        problems.append(("moe.grouped_matmul", f"mosaic_gpu needs model.embed_dim ({m.embed_dim}) and each device's "
                                               f"expert width ({width}, over {mlp_shards} 'mlp' shards) multiples of "
                                               f"{TILE}; use auto or xla"))
    if degrees is None:
        return problems
    if moe.expert_mlp_dim % mlp_shards:
        problems.append(("moe.expert_mlp_dim", f"{moe.expert_mlp_dim} is not divisible by the {mlp_shards} devices "
                                               "'mlp' is sharded over; use a multiple of it"))
    if moe.num_experts % degrees["expert"]:
        problems.append(("moe.num_experts", f"{moe.num_experts} is not divisible by mesh.expert={degrees['expert']}; "
                                            "use a multiple of it or a smaller mesh.expert"))
    tokens_per_device = moe_tokens_per_device(config, degrees)
    if moe.group_size and tokens_per_device % moe.group_size:
        problems.append(("moe.group_size", f"{moe.group_size} does not divide the {tokens_per_device} tokens per "
                                           "device of a micro-batch; use a divisor of it or 0 (one group per sequence)"))
    return problems


def _context_problems(config: Config, degrees: dict[str, int] | None) -> list[tuple[str, str]]:
    """Where mesh.context splits the rows of nestor's LM: the sequence into 2 x context chunks, and MoE routing
    that takes the same tokens together on every mesh (groups of whole rows when dropless, else whole pieces
    of a chunk; no draws by place)."""
    if degrees is None:
        return []
    context = split_degree("length", resolve_rules(config.mesh.rules), degrees)
    t, moe = config.train, config.moe
    if context == 1:
        return []
    problems = []
    if t.seq_len % (2 * context):
        problems.append(("train.seq_len", f"{t.seq_len} does not split into 2 x {context} chunks (each context "
                                          f"device holds two); use a multiple of {2 * context}"))
        return problems
    chunk = t.seq_len // (2 * context)
    if not (moe.num_experts and moe.every):
        return problems
    if moe.second_expert_policy == "random":
        problems.append(("moe.second_expert_policy", f"random draws by a token's place in the row, and with rows "
                                                     f"split by mesh.context={context} the places hold other "
                                                     "positions than on other meshes; use all"))
    if chunk % moe.group_size if moe.group_size else not config.dropless_moe:
        problems.append(("moe.group_size", f"{moe.group_size or t.seq_len} tokens per routing group: with rows "
                                           f"split by mesh.context={context}, a group is a divisor of the "
                                           f"{chunk}-token chunk a device holds (or, dropless, 0: one per row), so "
                                           f"that every mesh routes the same groups; use a divisor of {chunk}"))
    return problems


def _divisibility_problems(config: Config, degrees: dict[str, int]) -> list[tuple[str, str]]:
    """Every sharded dimension must divide by the product of the mesh axes (of `degrees`) it maps to."""
    rules = resolve_rules(config.mesh.rules)
    m, t = config.model, config.train
    per_step_batch = t.global_batch // t.grad_accum
    problems = []
    if t.global_batch % t.grad_accum:
        problems.append(("train.global_batch", f"{t.global_batch} is not divisible by train.grad_accum={t.grad_accum}"))
    sized = {
        "vocab": ("model.vocab_size", m.vocab_size),
        "embed": ("model.embed_dim", m.embed_dim),
        "heads": ("model.num_heads", m.num_heads),
        "kv_heads": ("model.num_kv_heads", m.num_kv_heads),
        "mlp": ("model.mlp_dim", m.mlp_dim),
        "batch": ("train.global_batch", per_step_batch),
    }
    for logical, (key, size) in sized.items():
        axes = rules.get(logical) or ()
        shards = math.prod(degrees[a] for a in axes)
        if size % shards:
            names = " x ".join(f"mesh.{a}={degrees[a]}" for a in axes)
            fix = "change the size or the mesh"
            if logical == "batch":
                fix = f"use a global batch that is a multiple of {shards * t.grad_accum}"
            problems.append((key, f"{size} is not divisible by {names} (= {shards}), which '{logical}' is sharded over; {fix}"))
    return problems
