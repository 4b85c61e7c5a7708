"""One typed, frozen config from `configs/base.yaml`, a run YAML and dotted overrides.

Layering, lowest first: base.yaml, the model preset (`model.preset`), the run
YAML, then `key=value` overrides. Everything that can be checked without a
device is checked by `orchestrator.validation.validate`, which lists every
problem with its key path.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from parallel.rules import MESH_AXES

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
    compile_cache: str | None = "~/.cache/nestor/xla"


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
    attention: str = "auto"
    remat: str = "none"
    remat_names: tuple[str, ...] = ()


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
    decay_steps: int | None = None
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
    document_mask: bool = True


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
    remat: str | None = None  # deprecated alias of model.remat


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 0
    every: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    group_size: int = 0
    second_expert_policy: str = "all"
    dispatch: str = "einsum"
    router: str = "softmax"
    expert_mlp_dim: int = 0
    shared_experts: int = 0
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
    launcher: str = "ray"
    address: str | None = None
    hosts: int = 1
    devices_per_host: int = 8
    accelerator: str = "cpu"
    max_failures: int = 0
    init_timeout_s: float = 120.0
    tpu_topology: str | None = None
    tpu_type: str | None = None
    dashboard: bool = True
    worker_logs: bool = False


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
        return _validated(from_dict(tree))


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


def presets() -> list[str]:
    """Returns the model preset names: the stems of configs/models/*.yaml."""
    return sorted(path.stem for path in (CONFIGS_DIR / "models").glob("*.yaml"))


def _preset_path(preset: Any) -> Path:
    # A preset is a name, never a path: `../base` must not reach another YAML file.
    if preset not in presets():
        raise ConfigError([("model.preset", f"{preset!r} is not a preset; the presets (configs/models/) are "
                                            f"{', '.join(presets())}; model keys of your own go in the run "
                                            "YAML's model: section")])
    return CONFIGS_DIR / "models" / f"{preset}.yaml"


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
        tree = _merge(tree, {"model": _read_yaml(_preset_path(preset), "model.preset")})
    tree = _merge(_merge(tree, user), extra)
    return _validated(from_dict(tree))


def _absolute(path: str, base: Path) -> str:
    expanded = Path(path).expanduser()
    return str(expanded if expanded.is_absolute() else base / expanded)


def resolve_paths(config: Config, base: Path) -> Config:
    """Returns `config` with every path a user writes (run.dir, run.compile_cache, data.paths globs,
    data.tokenizer) made absolute against `base`, `~` expanded.

    `load` resolves against the directory `nestor` runs in, before the config
    reaches any other process: a Ray worker's working directory is Ray's, not the user's.
    """
    run, data = config.run, config.data
    return dataclasses.replace(
        config,
        run=dataclasses.replace(run, dir=_absolute(run.dir, base),
                                compile_cache=run.compile_cache and _absolute(run.compile_cache, base)),
        data=dataclasses.replace(data, paths=tuple(_absolute(p, base) for p in data.paths),
                                 tokenizer=data.tokenizer and _absolute(data.tokenizer, base)))


def _validated(config: Config) -> Config:
    """Returns `config` with its paths resolved against the working directory, validated."""
    from orchestrator.validation import validate, without_deprecated_keys  # they import this module's types

    return without_deprecated_keys(validate(resolve_paths(config, Path.cwd())))


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
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value), None
            except ValueError:
                pass
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
