"""Checks a Config before any device is touched; every problem is listed with its key path.

Divisibility follows the logical-axis rules: a dimension must split evenly
over the product of the mesh axes its logical name maps to.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

from nestor.backend.mosaic_gpu import TILE, tiles
from nestor.backend.remat import NAMED_POLICIES
from nestor.models.moe import expert_capacity
from nestor.models.transformer import STACK
from nestor.orchestrator.config_keys import ARRAY_SOURCES, key_table
from nestor.orchestrator.degrees import (REPEATED_SCHEDULES, mesh_axes_key, mesh_degrees, moe_tokens_per_device,
                                       schedule_for, total_devices)
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.memory_fit import DEVICE_MEMORY_GIB, table_entry
from nestor.orchestrator.products import evaluation_problems, product_problems
from nestor.parallel.rules import DEFAULT_RULES, resolve_rules, split_degree, unknown_rule_problems

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config import Config


def table_problems(config: Config) -> list[tuple[str, str]]:
    """Returns (key path, message) for every value outside its key's declared range or choices."""
    plain = config.to_dict()
    problems = []
    for path, _, _, spec in key_table(type(config)):
        value = plain
        for part in path.split("."):
            value = value[part]
        if value is None or isinstance(value, dict):
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if (message := spec.problem(item)) is not None:
                problems.append((path if index is None else f"{path}[{index}]", message))
    return problems


def validate(config: Config) -> Config:
    """Returns `config` unchanged if it is consistent; otherwise raises ConfigError listing every problem.

    First every key against its own range and choices (the key table in
    orchestrator.config); only when all hold, the checks across keys, which
    rely on them. Checks that need the device count (the mesh product) are
    done here when the mesh has no -1 or when `cluster.hosts *
    cluster.devices_per_host` is known.
    """
    problems = table_problems(config)
    if problems:
        raise ConfigError(problems)
    m = config.model
    if not m.builtin_lm:
        return _user_model_validated(config)
    if m.head_dim % 2:
        problems.append(("model.head_dim", f"RoPE needs an even head_dim, got {m.head_dim}"))
    if m.num_heads % m.num_kv_heads:
        problems.append(("model.num_kv_heads", f"must divide model.num_heads={m.num_heads}, got {m.num_kv_heads}"))
    problems += _remat_problems(config)
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
    problems += product_problems(config)
    problems += _device_memory_problems(config)
    problems += _data_problems(config)
    if config.eval.every:
        problems += eval_problems(config)
    problems += _profile_problems(config)
    problems += _schedule_problems(config)
    problems += _mesh_problems(config)
    problems += _moe_problems(config, None if problems else _known_degrees(config))
    if not problems:
        problems += _divisibility_problems(config)
        problems += _pipeline_problems(config)
        problems += _context_problems(config, _known_degrees(config))
    if problems:
        raise ConfigError(problems)
    return config


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


def _user_model_validated(config: Config) -> Config:
    """`validate` for a model of the user's (model.class module:Name): the checks that do not depend on
    the model; its parameters' names and shapes are checked against the mesh once it is built
    (orchestrator.state)."""
    problems = _remat_problems(config) + _device_memory_problems(config) + _profile_problems(config)
    problems += _schedule_problems(config) + _mesh_problems(config, known_axes=None)
    if config.data.source not in ARRAY_SOURCES:
        problems.append(("data.source", f"model.class {config.model.class_} reads named arrays: use data.source="
                                        "arrays or python (the token sources feed nestor's language model, "
                                        "model.class: lm)"))
    if config.data.source == "python" and not config.data.factory:
        problems.append(("data.factory", "data.source=python needs module:function returning the named arrays"))
    if config.eval.every:
        problems += eval_problems(config)
    if config.moe.num_experts:
        problems.append(("moe.num_experts", "the moe section configures nestor's language model; a model of your "
                                            "own builds its expert layers itself (docs/models.md)"))
    if not problems and not (total_devices(config) is None and -1 in config.mesh.ici_shape().values()):
        degrees = mesh_degrees(config)
        problems += _pipeline_problems(config, builtin_lm=False)
        t = config.train
        shards = split_degree("batch", resolve_rules(config.mesh.rules), degrees)
        if t.global_batch % t.grad_accum or (t.global_batch // t.grad_accum) % shards:
            problems.append(("train.global_batch", f"{t.global_batch} rows do not split into train.grad_accum="
                                                   f"{t.grad_accum} micro-batches of a multiple of the {shards} "
                                                   "devices the batch is split over"))
    if problems:
        raise ConfigError(problems)
    return config


def _device_memory_problems(config: Config) -> list[tuple[str, str]]:
    """cluster.device_kind names a device of the memory table unless cluster.device_memory_gb gives the
    memory itself."""
    kind, memory = config.cluster.device_kind, config.cluster.device_memory_gb
    if kind is not None and memory is None and table_entry(kind) is None:
        return [("cluster.device_kind", f"{kind!r} is not in the device memory table "
                                        f"({', '.join(DEVICE_MEMORY_GIB)}); pick one or set cluster.device_memory_gb")]
    return []


def _data_problems(config: Config) -> list[tuple[str, str]]:
    """data.mixture is for prepared token shards; each entry is {paths: [dirs], weight: w > 0}; the
    tokens source needs directories from data.paths or data.mixture."""
    data = config.data
    if data.source in ARRAY_SOURCES:
        return [("data.source", "named arrays feed a model.class of your own; nestor's language model (model.class: "
                                "lm) reads synthetic, text or tokens")]
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


def eval_problems(config: Config) -> list[tuple[str, str]]:
    """Returns (key path, message) when the eval source cannot be read: `heldout` needs prepared shards
    (data.source=tokens), `text` and `tokens` need eval.paths. Checked when eval.every is set, and by
    `nestor eval`, with an evaluation's size (`evaluation_problems`)."""
    if problems := evaluation_problems(config):
        return problems
    source = config.eval.source
    if source == "heldout" and config.data.source not in ("tokens", "python"):
        example = ""
        if config.data.source == "text" and not config.data.paths:  # the standard library's top-level sources
            package = Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py"
            example = (f"; the default text is the standard library's top-level modules, so its packages are "
                       f"held out: eval.source=text 'eval.paths=[{package}]'")
        return [("eval.source", f"heldout is the eval split of prepared shards, and data.source is "
                                f"{config.data.source}; set eval.source to text, tokens, synthetic or arrays (with "
                                f"eval.paths), or train on data.source=tokens{example}")]
    if source == "arrays" and not config.eval.paths:
        return [("eval.paths", "eval.source=arrays needs .npz files or directories of .npy files held out from "
                               "training")]
    if (source == "arrays") != (config.data.source in ARRAY_SOURCES) and source != "heldout":
        return [("eval.source", f"evaluates a model trained on data.source={config.data.source} on {source} batches; "
                                "named arrays evaluate a model of your own, the token sources nestor's LM")]
    if source == "tokens" and not config.eval.paths:
        return [("eval.paths", "eval.source=tokens needs directories written by `nestor data prepare`")]
    if source == "text" and not config.eval.paths:
        # Without globs the text source reads the standard library's sources: the quickstart's training text.
        return [("eval.paths", "eval.source=text needs globs of held-out text files; without them it would "
                               "evaluate on the standard library's sources, the default training text")]
    return []


def _profile_problems(config: Config) -> list[tuple[str, str]]:
    profile, steps = config.profile, config.train.steps
    problems: list[tuple[str, str]] = []
    if profile.start_step > steps:
        problems.append(("profile.start_step", f"step {profile.start_step} is past train.steps={steps}"))
    elif profile.start_step and profile.start_step + profile.steps - 1 > steps:
        problems.append(("profile.steps", f"steps {profile.start_step}..{profile.start_step + profile.steps - 1} "
                                          f"run past train.steps={steps}; trace at most {steps - profile.start_step + 1}"))
    return problems


def _remat_problems(config: Config) -> list[tuple[str, str]]:
    """model.remat_names need a policy that saves by name."""
    m = config.model
    if m.remat_names and m.remat not in NAMED_POLICIES:
        return [("model.remat_names", f"model.remat={m.remat} does not save by name; names apply to "
                                      f"{' and '.join(NAMED_POLICIES)}")]
    return []


def _schedule_problems(config: Config) -> list[tuple[str, str]]:
    """The learning-rate schedule's lengths; a null decay_steps (train.steps) cuts the warmup instead."""
    opt = config.optimizer
    problems = []
    if opt.decay_steps is not None:
        if opt.warmup_steps > opt.decay_steps:
            problems.append(("optimizer.warmup_steps", f"{opt.warmup_steps} exceeds optimizer.decay_steps="
                                                       f"{opt.decay_steps}; warm up for at most the decay steps"))
    return problems


def _mesh_problems(config: Config, known_axes=DEFAULT_RULES) -> list[tuple[str, str]]:
    problems = []
    mesh = config.mesh
    fills = [axis for axis, size in mesh.ici_shape().items() if size == -1]
    if len(fills) > 1:
        problems.append((f"mesh.{fills[1]}", f"only one mesh axis may be -1; found {', '.join('mesh.' + a for a in fills)}"))
    problems += unknown_rule_problems(mesh.rules, known_axes)
    if (config.cluster.min_hosts or 0) > config.cluster.hosts:
        problems.append(("cluster.min_hosts", f"{config.cluster.min_hosts} is more than cluster.hosts="
                                              f"{config.cluster.hosts}; at most that many hosts run"))
    devices = total_devices(config)
    if devices is not None and not problems:
        dcn = math.prod(mesh.dcn_shape().values())
        if devices % dcn:
            problems.append(("mesh.dcn", f"the dcn degrees multiply to {dcn}, which does not divide {devices} devices"))
        elif config.cluster.hosts % dcn:
            problems.append(("mesh.dcn", f"the dcn degrees multiply to {dcn}, which does not divide cluster.hosts={config.cluster.hosts}"))
        else:
            per_slice = devices // dcn
            known = math.prod(size for size in mesh.ici_shape().values() if size != -1)
            if fills and per_slice % known:
                problems.append((f"mesh.{fills[0]}", f"the other axes multiply to {known}, which does not divide {per_slice} devices per slice"))
            elif not fills and known != per_slice:
                problems.append((mesh_axes_key(config), f"multiply to {known} but each slice has {per_slice} "
                                 f"devices (cluster.hosts={config.cluster.hosts} x cluster.devices_per_host="
                                 f"{config.cluster.devices_per_host} / {dcn} slices); set one axis to -1, change "
                                 "a degree or cluster.devices_per_host"))
    return problems


def _known_degrees(config: Config) -> dict[str, int] | None:
    """Returns the mesh degrees, or None while a -1 axis waits for the device count."""
    if total_devices(config) is None and -1 in config.mesh.ici_shape().values():
        return None
    return mesh_degrees(config)


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


def _divisibility_problems(config: Config) -> list[tuple[str, str]]:
    """Every sharded dimension must divide by the product of the mesh axes it maps to."""
    if total_devices(config) is None and -1 in config.mesh.ici_shape().values():
        return []
    degrees = mesh_degrees(config)
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


def _pipeline_problems(config: Config, builtin_lm: bool = True) -> list[tuple[str, str]]:
    """Every check a pipeline schedule needs: layers into stages x repeats (nestor's LM; a model of the user's
    has its stack checked once built, orchestrator.state), batch into micro-batches."""
    p, t = config.pipeline, config.train
    problems = []
    if p.repeats > 1 and p.schedule not in REPEATED_SCHEDULES:
        problems.append(("pipeline.repeats", f"repeats={p.repeats} needs pipeline.schedule=circular or "
                                             f"interleaved_1f1b (got {p.schedule}); set repeats to 1 or use one "
                                             "of those"))
    if total_devices(config) is None and -1 in config.mesh.ici_shape().values():
        return problems
    degrees = mesh_degrees(config)
    if degrees["pipeline"] == 1:
        return problems
    moe = config.moe
    schedule = schedule_for(config, degrees["pipeline"])
    keys = {"layers": "model.num_layers", "microbatches": "pipeline.microbatches", "repeats": "pipeline.repeats"}
    # With MoE the stack is made of units of moe.every layers (the last one MoE) after the first dense
    # layers, which run before the pipeline: stages split units.
    every = moe.every if moe.num_experts and moe.every else 1
    first_dense = moe.first_dense_layers if moe.num_experts and moe.every else 0
    note = f" (counted in units of moe.every={every} layers)" if every > 1 else ""
    if first_dense:
        note += f" (after moe.first_dense_layers={first_dense}, which run before the pipeline)"
    units = (config.model.num_layers - first_dense) // every if builtin_lm else schedule.stages * schedule.repeats
    problems += [(keys[what], message + (note if what == "layers" else ""))
                 for what, message in schedule.problems(units)]
    per_step_batch = t.global_batch // t.grad_accum
    if per_step_batch % p.microbatches:
        problems.append(("train.global_batch", f"the per-step batch {per_step_batch} (global_batch / grad_accum) "
                                               f"does not split into pipeline.microbatches={p.microbatches}; "
                                               f"use a multiple of {p.microbatches * t.grad_accum}"))
        return problems
    batch_axes = resolve_rules(config.mesh.rules).get("batch") or ()
    shards = math.prod(degrees[a] for a in batch_axes)
    microbatch = per_step_batch // p.microbatches
    if microbatch % shards:
        names = " x ".join(f"mesh.{a}={degrees[a]}" for a in batch_axes)
        problems.append(("pipeline.microbatches", f"a micro-batch of {microbatch} sequences does not split over "
                                                  f"{names} (= {shards}); use at most "
                                                  f"{max(per_step_batch // shards, 1)} micro-batches or a larger global batch"))
    return problems
