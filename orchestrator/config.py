"""One typed, frozen config from `configs/base.yaml`, a run YAML and dotted overrides.

Layering, lowest first: base.yaml, the model preset (`model.preset`), the run
YAML, then `key=value` overrides. Everything that can be checked without a
device is checked in `validate`, which lists every problem with its key path.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from models.moe import expert_capacity
from parallel.pipeline import Schedule
from parallel.rules import MESH_AXES, resolve_rules, unknown_rule_problems

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A config a user wrote is wrong; `problems` holds (key path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        lines = [f"  {key}: {message}" for key, message in self.problems]
        super().__init__("invalid config:\n" + "\n".join(lines))

    def __reduce__(self):
        # Ray ships a worker's exception to the driver by pickling it.
        return ConfigError, (self.problems,)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    preset: str | None = None
    vocab_size: int = 256
    embed_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    mlp_dim: int = 128
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    global_batch: int = 16
    seq_len: int = 64
    grad_accum: int = 1
    log_every: int = 1


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"
    paths: tuple[str, ...] = ()
    tokenizer: str | None = None


@dataclasses.dataclass(frozen=True)
class DcnConfig:
    pipeline: int = 1
    data: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    pipeline: int = 1
    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    dcn: DcnConfig = DcnConfig()
    rules: dict = dataclasses.field(default_factory=dict)

    def ici_shape(self) -> dict[str, int]:
        """Returns the per-slice degrees by axis name, -1 still unresolved."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def dcn_shape(self) -> dict[str, int]:
        """Returns the across-slice degrees by axis name."""
        return {axis: getattr(self.dcn, axis) for axis in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    microbatches: int = 1
    schedule: str = "gpipe"
    repeats: int = 1
    remat: str = "none"


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 0
    every: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    group_size: int = 0
    second_expert_policy: str = "all"
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0
    keep: int = 3
    # `async` is a Python keyword, so the field is `async_save`; the YAML key stays `async`.
    async_save: bool = True


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    tensorboard: bool = True
    image_every: int = 100
    peak_tflops: float | None = None


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    launcher: str = "inprocess"
    address: str | None = None
    hosts: int = 1
    devices_per_host: int = 8
    accelerator: str = "cpu"
    max_failures: int = 0
    init_timeout_s: float = 120.0
    tpu_topology: str | None = None
    tpu_type: str | None = None
    dashboard: bool = False


@dataclasses.dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    pipeline: PipelineConfig = PipelineConfig()
    moe: MoEConfig = MoEConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    cluster: ClusterConfig = ClusterConfig()

    def to_dict(self) -> dict[str, Any]:
        """Returns the config as plain YAML-able data, keys as users write them."""
        return _to_plain(self)

    def replace(self, **dotted: Any) -> "Config":
        """Returns a copy with dotted keys (`mesh.tensor=2`) replaced, validated."""
        tree = self.to_dict()
        for key, value in dotted.items():
            _set_dotted(tree, key, value)
        return validate(from_dict(tree))


_YAML_NAMES = {"async_save": "async"}
_FIELD_NAMES = {yaml_name: field for field, yaml_name in _YAML_NAMES.items()}


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {
            _YAML_NAMES.get(f.name, f.name): _to_plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
        }
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([(key, f"'{part}' is a value, not a section")])
        node = child
    node[parts[-1]] = value


def _merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "rules":
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: Path, key: str) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError([(key, f"file not found: {path}")]) from None
    except yaml.YAMLError as error:
        raise ConfigError([(key, f"{path} is not valid YAML: {error}")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([(key, f"{path} must hold a mapping of sections")])
    return data


def parse_overrides(overrides: list[str]) -> dict:
    """Returns a nested dict from `a.b=value` strings; values are parsed as YAML."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError([(item, "overrides are written key.path=value")])
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def load(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    """Returns the validated Config for a run YAML plus overrides.

    `overrides` holds `key.path=value` strings and, layered first in order,
    paths of further YAML files (mesh presets, say).

    Raises ConfigError (with every problem's key path) when the YAML, an
    override or the combination is invalid.
    """
    tree = _read_yaml(CONFIGS_DIR / "base.yaml", "base.yaml")
    user = _read_yaml(Path(path), "CONFIG") if path is not None else {}
    if isinstance(overrides, list):
        # Further YAML files (e.g. configs/meshes/fsdp8.yaml) layer over CONFIG in order.
        for layer in [item for item in overrides if "=" not in item and item.endswith((".yaml", ".yml"))]:
            user = _merge(user, _read_yaml(Path(layer), layer))
        overrides = [item for item in overrides if not ("=" not in item and item.endswith((".yaml", ".yml")))]
    extra = parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})
    preset = (
        (extra.get("model") or {}).get("preset")
        or (user.get("model") or {}).get("preset")
    )
    if preset:
        preset_tree = _read_yaml(CONFIGS_DIR / "models" / f"{preset}.yaml", "model.preset")
        tree = _merge(tree, {"model": preset_tree})
    tree = _merge(_merge(tree, user), extra)
    return validate(from_dict(tree))


def from_dict(tree: dict) -> Config:
    """Returns a Config built from nested plain data; unknown keys and wrong types raise."""
    problems: list[tuple[str, str]] = []
    config = _build(Config, tree, "", problems)
    if problems:
        raise ConfigError(problems)
    return config


def _build(cls: type, tree: Any, prefix: str, problems: list) -> Any:
    if not isinstance(tree, dict):
        problems.append((prefix.rstrip(".") or "<root>", "must be a mapping"))
        return cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, raw in tree.items():
        name = _FIELD_NAMES.get(key, key)
        path = prefix + str(key)
        if name not in fields:
            problems.append((path, f"unknown key; known keys: {', '.join(sorted(_YAML_NAMES.get(n, n) for n in fields))}"))
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw, path + ".", problems)
        else:
            coerced, error = _coerce(raw, hint)
            if error:
                problems.append((path, error))
            else:
                values[name] = coerced
    return cls(**values)


def _coerce(value: Any, hint: Any) -> tuple[Any, str | None]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None, None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0])
    if hint is bool:
        return (value, None) if isinstance(value, bool) else (None, f"expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        return None, f"expected an integer, got {value!r}"
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), None
        return None, f"expected a number, got {value!r}"
    if hint is str:
        return (value, None) if isinstance(value, str) else (None, f"expected a string, got {value!r}")
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            return None, f"expected a list of strings, got {value!r}"
        return tuple(value), None
    if hint is dict or origin is dict:
        return (dict(value), None) if isinstance(value, dict) else (None, f"expected a mapping, got {value!r}")
    return value, None


def _check_choice(problems, key, value, choices):
    if value not in choices:
        problems.append((key, f"{value!r} is not one of {', '.join(choices)}"))


def _check_positive(problems, key, value, minimum=1):
    if value < minimum:
        problems.append((key, f"must be >= {minimum}, got {value}"))


def validate(config: Config) -> Config:
    """Returns `config` unchanged if it is consistent; otherwise raises ConfigError listing every problem.

    Checks that need the device count (the mesh product) are done here when the
    mesh has no -1 or when `cluster.hosts * cluster.devices_per_host` is known.
    """
    problems: list[tuple[str, str]] = []
    m, t, mesh = config.model, config.train, config.mesh
    for key in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
        _check_positive(problems, f"model.{key}", getattr(m, key))
    for key in ("steps", "global_batch", "seq_len", "grad_accum", "log_every"):
        _check_positive(problems, f"train.{key}", getattr(t, key))
    _check_choice(problems, "model.dtype", m.dtype, ("float32", "bfloat16", "float16"))
    if m.head_dim % 2:
        problems.append(("model.head_dim", f"RoPE needs an even head_dim, got {m.head_dim}"))
    if m.num_kv_heads and m.num_heads % m.num_kv_heads:
        problems.append(("model.num_kv_heads", f"must divide model.num_heads={m.num_heads}, got {m.num_kv_heads}"))
    _check_choice(problems, "data.source", config.data.source, ("synthetic", "text"))
    _check_choice(problems, "pipeline.schedule", config.pipeline.schedule, ("gpipe", "circular"))
    _check_choice(problems, "pipeline.remat", config.pipeline.remat,
                  ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"))
    _check_choice(problems, "moe.second_expert_policy", config.moe.second_expert_policy, ("all", "random"))
    _check_choice(problems, "cluster.launcher", config.cluster.launcher, ("ray", "inprocess"))
    _check_choice(problems, "cluster.accelerator", config.cluster.accelerator, ("cpu", "gpu", "tpu"))
    _check_positive(problems, "cluster.hosts", config.cluster.hosts)
    _check_positive(problems, "cluster.max_failures", config.cluster.max_failures, minimum=-1)
    if config.cluster.init_timeout_s <= 0:
        problems.append(("cluster.init_timeout_s", f"must be > 0 seconds, got {config.cluster.init_timeout_s:g}"))
    if config.cluster.devices_per_host == 0 or config.cluster.devices_per_host < -1:
        problems.append(("cluster.devices_per_host", "must be a positive count or -1 (all local devices)"))
    _check_positive(problems, "checkpoint.keep", config.checkpoint.keep)
    _check_positive(problems, "checkpoint.every", config.checkpoint.every, minimum=0)
    _check_positive(problems, "pipeline.microbatches", config.pipeline.microbatches)
    _check_positive(problems, "pipeline.repeats", config.pipeline.repeats)
    problems += _mesh_problems(config)
    problems += _moe_problems(config, None if problems else _known_degrees(config))
    if not problems:
        problems += _divisibility_problems(config)
        problems += _pipeline_problems(config)
    if problems:
        raise ConfigError(problems)
    return config


def _mesh_problems(config: Config) -> list[tuple[str, str]]:
    problems = []
    mesh = config.mesh
    fills = [axis for axis, size in mesh.ici_shape().items() if size == -1]
    if len(fills) > 1:
        problems.append((f"mesh.{fills[1]}", f"only one mesh axis may be -1; found {', '.join('mesh.' + a for a in fills)}"))
    for axis, size in mesh.ici_shape().items():
        if size == 0 or size < -1:
            problems.append((f"mesh.{axis}", f"must be a positive degree or -1, got {size}"))
    for axis, size in mesh.dcn_shape().items():
        if size < 1:
            problems.append((f"mesh.dcn.{axis}", f"must be >= 1, got {size}"))
    problems += unknown_rule_problems(mesh.rules)
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
                problems.append(("mesh", f"the axes multiply to {known} but each slice has {per_slice} devices "
                                         f"({devices} devices / {dcn} slices); set one axis to -1 or fix the degrees"))
    return problems


def total_devices(config: Config) -> int | None:
    """Returns the device count the run will use, or None when it is 'all local devices'."""
    if config.cluster.devices_per_host == -1:
        return None
    return config.cluster.hosts * config.cluster.devices_per_host


def mesh_degrees(config: Config, devices: int | None = None) -> dict[str, int]:
    """Returns the total degree of each mesh axis (ici x dcn) with -1 resolved."""
    devices = devices if devices is not None else total_devices(config)
    ici = config.mesh.ici_shape()
    dcn = config.mesh.dcn_shape()
    if -1 in ici.values():
        if devices is None:
            raise ConfigError([("cluster.devices_per_host", "needed to resolve a -1 mesh axis")])
        known = math.prod(size for size in ici.values() if size != -1)
        fill = devices // math.prod(dcn.values()) // known
        ici = {axis: fill if size == -1 else size for axis, size in ici.items()}
    return {axis: ici[axis] * dcn[axis] for axis in MESH_AXES}


def _known_degrees(config: Config) -> dict[str, int] | None:
    """Returns the mesh degrees, or None while a -1 axis waits for the device count."""
    if total_devices(config) is None and -1 in config.mesh.ici_shape().values():
        return None
    return mesh_degrees(config)


def _moe_problems(config: Config, degrees: dict[str, int] | None) -> list[tuple[str, str]]:
    """Returns the problems of the `moe` section; checks against the mesh need its `degrees`."""
    moe, m, t = config.moe, config.model, config.train
    if moe.num_experts < 0 or moe.every < 0 or moe.group_size < 0:
        key = next(k for k in ("num_experts", "every", "group_size") if getattr(moe, k) < 0)
        return [(f"moe.{key}", f"must be >= 0, got {getattr(moe, key)}")]
    if (moe.num_experts > 0) != (moe.every > 0):
        return [("moe.every", f"moe.every={moe.every} and moe.num_experts={moe.num_experts}: set both > 0 for an "
                              "MoE model or both 0 for a dense one")]
    if moe.num_experts == 0:
        return []
    problems = []
    if m.num_layers % moe.every:
        problems.append(("moe.every", f"{moe.every} does not divide model.num_layers={m.num_layers}; "
                                      "the stacked unit is moe.every layers, so pick a divisor"))
    if not 1 <= moe.top_k <= moe.num_experts:
        problems.append(("moe.top_k", f"must be between 1 and moe.num_experts={moe.num_experts}, got {moe.top_k}"))
    tokens_per_group = moe.group_size or t.seq_len
    for key in ("capacity_factor", "eval_capacity_factor"):
        factor = getattr(moe, key)
        if factor <= 0 or expert_capacity(tokens_per_group, moe.num_experts, moe.top_k, factor) < 1:
            problems.append((f"moe.{key}", f"{factor} gives experts no capacity; use a positive factor"))
    if degrees is None:
        return problems
    if moe.num_experts % degrees["expert"]:
        problems.append(("moe.num_experts", f"{moe.num_experts} is not divisible by mesh.expert={degrees['expert']}; "
                                            "use a multiple of it or a smaller mesh.expert"))
    batch_shards = math.prod(degrees[a] for a in resolve_rules(config.mesh.rules)["batch"])
    tokens_per_device = t.global_batch // t.grad_accum * t.seq_len // batch_shards
    if moe.group_size and tokens_per_device % moe.group_size:
        problems.append(("moe.group_size", f"{moe.group_size} does not divide the {tokens_per_device} tokens per "
                                           "device of a step; use a divisor of it or 0 (one group per sequence)"))
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


def _pipeline_problems(config: Config) -> list[tuple[str, str]]:
    """Every check a pipeline schedule needs: layers into stages x repeats, batch into micro-batches."""
    p, t = config.pipeline, config.train
    problems = []
    if p.repeats > 1 and p.schedule != "circular":
        problems.append(("pipeline.repeats", f"repeats={p.repeats} needs pipeline.schedule=circular "
                                             f"(got {p.schedule}); set repeats to 1 or use the circular schedule"))
    if total_devices(config) is None and -1 in config.mesh.ici_shape().values():
        return problems
    degrees = mesh_degrees(config)
    if degrees["pipeline"] == 1:
        return problems
    schedule = Schedule(degrees["pipeline"], p.microbatches, p.repeats if p.schedule == "circular" else 1)
    keys = {"layers": "model.num_layers", "microbatches": "pipeline.microbatches"}
    moe = config.moe
    # With MoE the stack is made of units of moe.every layers (the last one MoE): stages split units.
    every = moe.every if moe.num_experts and moe.every else 1
    note = f" (counted in units of moe.every={every} layers)" if every > 1 else ""
    problems += [(keys[what], message + (note if what == "layers" else ""))
                 for what, message in schedule.problems(config.model.num_layers // every)]
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
