"""Loading the run config: one typed, frozen config (its schema: orchestrator.config.schema) from
`configs/base.yaml`, a run YAML and dotted overrides.

Layering, lowest first: base.yaml, the model preset (`model.preset`), the run
YAML, then `key=value` overrides. Everything that can be checked without a
device is checked by `orchestrator.loader.validation.validate`, which lists every
problem with its key path.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from nestor.orchestrator.config import schema as config_schema
from nestor.orchestrator.config.keys import INT32_MAX, YAML_NAMES, Key, moe_on  # noqa: F401 - INT32_MAX, Key: for callers
from nestor.orchestrator.config.schema import _set_dotted, key_table  # noqa: F401 - key_table: for callers
from nestor.orchestrator.data.shards import METADATA, VOCAB_MULTIPLE
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.hf.architectures import sections
from nestor.orchestrator.hf.peft_config import lora_sections
from nestor.models.lora_names import canonical as canonical_targets
from nestor.orchestrator.data.tokenizer import BYTES
from nestor.orchestrator.loader.validation import validate
from nestor.orchestrator.config.yaml_files import override_value, read_yaml

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


class Config(config_schema.Config):
    """A run's config as loaded: the schema's keys, and `replace`, which checks the copy as `load` does."""

    def replace(self, **dotted: Any) -> "Config":
        """Returns a copy with dotted keys (`mesh.tensor=2`) replaced, validated."""
        tree = self.to_dict()
        for key, value in dotted.items():
            _set_dotted(tree, key, value)
        return _validated(from_dict(tree))


def from_dict(tree: dict) -> Config:
    """Returns a Config built from nested plain data (config_schema.from_dict); unknown keys and wrong types
    raise."""
    return config_schema.from_dict(tree, Config)


def _merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "rules":
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


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


def preset_sections(preset: Any) -> dict:
    """Returns the config sections model preset `preset` sets: its model keys, and its `moe:` mapping
    when it has one (an MoE architecture is part of the model; a run YAML may still override it).

    Raises ConfigError when `preset` is not a preset name.
    """
    keys = read_yaml(_preset_path(preset), "model.preset")
    moe = keys.pop("moe", None)
    return {"model": keys} if moe is None else {"model": keys, "moe": moe}


# the keys chosen for a step's speed on its target (nestor explain says where each value came from; fp8 also
# rounds differently); `auto` values are the backend's to resolve
SPEED_KEYS = ("model.scan_layers", "model.remat", "model.attention", "model.matmul_precision", "moe.grouped_matmul",
              "moe.exchange")


def speed_key_sources(config: Config) -> list[tuple[str, Any, str]]:
    """Returns (dotted key, value, where it came from) for each of SPEED_KEYS: `preset NAME` when the model
    preset sets that value, `the run` (its YAML or overrides) when the preset sets another or the value is not
    base.yaml's, else `default`."""
    plain = config.to_dict()
    defaults = {path: default for path, _, default, _ in key_table()}
    preset = preset_sections(config.model.preset) if config.model.preset else {}
    sources = []
    for path in SPEED_KEYS:
        section, name = path.split(".")
        value = plain[section][name]
        preset_value = preset.get(section, {}).get(name, _UNSET)
        if preset_value == value:
            where = f"preset {config.model.preset}"
        else:
            where = "default" if defaults[path] == value and preset_value is _UNSET else "the run"
        sources.append((path, value, where))
    return sources


_UNSET = object()


def parse_overrides(overrides: list[str]) -> dict:
    """Returns a nested dict from `a.b=value` strings; values are parsed as YAML."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError([(item, "overrides are written key.path=value")])
        if "" in key.split("."):
            raise ConfigError([(key, f"a key path has a name between every two dots; write "
                                     f"{'.'.join(part for part in key.split('.') if part)}={raw}")])
        _set_dotted(tree, key, override_value(raw, key) if raw else "")
    return tree


def load(path: str | Path | dict | None = None, overrides: list[str] | dict | None = None,
         device_checks: bool = True) -> Config:
    """Returns the validated Config for a run YAML (or its plain data: a checkpoint's config) plus overrides.

    `overrides` holds `key.path=value` strings and, layered first in order,
    paths of further YAML files (mesh presets, say). Without `device_checks`,
    a mesh with a -1 axis is validated as if the device count were not known
    (no split of the batch or the model over it is checked, no value chosen
    for it): a plan's config, whose mesh the plan chooses.

    Raises ConfigError (with every problem's key path) when the YAML, an
    override or the combination is invalid.
    """
    tree = read_yaml(CONFIGS_DIR / "base.yaml", "base.yaml")
    user = dict(path) if isinstance(path, dict) else read_yaml(Path(path), "CONFIG", empty_ok=False) \
        if path is not None else {}
    if isinstance(overrides, list):
        # Further YAML files (e.g. configs/meshes/fsdp8.yaml) layer over CONFIG in order.
        for layer in [item for item in overrides if "=" not in item and item.endswith((".yaml", ".yml"))]:
            user = _merge(user, read_yaml(Path(layer), layer, empty_ok=False))
        overrides = [item for item in overrides if not ("=" not in item and item.endswith((".yaml", ".yml")))]
    extra = parse_overrides(overrides) if isinstance(overrides, list) else (overrides or {})
    preset = _given_last((user, extra), "model", "preset", None)
    if preset:
        tree = _merge(tree, preset_sections(preset))
    init_from = _given_last((user, extra), "model", "init_from", None)
    if init_from:
        run = _merge(_merge(tree, user), extra).get("run")
        run_dir = run.get("dir") if isinstance(run, dict) else None
        tree = _merge(tree, checkpoint_sections(init_from, preset, (user, extra), run_dir))
    tree = _merge(_merge(tree, user), extra)
    tree = _merge(tree, shards_tokenizer(tree, (user, extra), bool(init_from)))
    adapter = _given_last((user, extra), "lora", "init_from", None)
    if adapter:
        tree = _merge(tree, adapter_sections(adapter, (user, extra)))
    config = from_dict(tree)
    if device_checks:
        return _validated(config)
    per_host = config.cluster.devices_per_host
    unknown = _validated(dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, devices_per_host=-1)))
    checked = dataclasses.replace(unknown, cluster=dataclasses.replace(unknown.cluster, devices_per_host=per_host))
    object.__setattr__(checked, "chosen", unknown.chosen)  # not a key: replace does not carry it
    return checked


def adapter_sections(init_from: Any, layers: tuple[dict, ...]) -> dict:
    """Returns the lora keys a PEFT adapter's adapter_config.json implies (orchestrator.hf.peft); raises
    ConfigError when a key of `layers` (the run YAML, the overrides) sets one to another value."""
    if not isinstance(init_from, str):
        raise ConfigError([("lora.init_from", f"expected a directory, got {init_from!r}")])
    derived = lora_sections(Path(_absolute(init_from, Path.cwd())))
    problems = []
    for name, value in derived["lora"].items():
        given = _given_last(layers, "lora", name, value)
        if given != value and not (isinstance(given, list) and list(canonical_targets(tuple(given))) == value):
            problems.append((f"lora.{name}", f"{given!r} conflicts with {init_from}, whose adapter_config.json "
                                             f"makes it {value!r}"))
    if problems:
        raise ConfigError(problems)
    return derived


def _given(layers: tuple[dict, ...], section: str, name: str) -> bool:
    """Returns whether a run YAML or override layer sets `section.name`."""
    return any(isinstance(layer.get(section), dict) and name in layer[section] for layer in layers)


def shards_tokenizer(tree: dict, layers: tuple[dict, ...], model_given: bool) -> dict:
    """Returns the keys prepared token shards imply when the run reads them (`data.source: tokens`): the
    tokenizer they were prepared with as `data.tokenizer` unless the run names one, and a `model.vocab_size`
    that holds its ids (rounded up to a multiple of 128) unless the run or a checkpoint sets one. A
    directory that is not prepared is left to the data source to report."""
    data = tree.get("data")
    if not isinstance(data, dict) or not isinstance(tree.get("model"), dict):
        return {}  # a section written as a value: validation names it
    if data.get("source") != "tokens" or _given(layers, "data", "tokenizer") or data.get("tokenizer"):
        return {}  # the run's own tokenizer, or a checkpoint's (model.init_from), is checked against the shards
    def paths_of(value: Any) -> list:  # a path or a list of them; anything else is validation's to name
        return [value] if isinstance(value, str) else [p for p in value if isinstance(p, str)] \
            if isinstance(value, list) else []

    mixture = data.get("mixture") if isinstance(data.get("mixture"), list) else []
    entries = paths_of(data.get("paths")) + [path for entry in mixture if isinstance(entry, dict)
                                             for path in paths_of(entry.get("paths"))]
    for path in entries:
        metadata_file = Path(_absolute(str(path), Path.cwd())) / METADATA
        try:
            tokenizer = dict(json.loads(metadata_file.read_text())["tokenizer"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        path = tokenizer.get("path")
        # the file the shards were prepared with, where it still is (else the shards' fingerprint check says so)
        found = isinstance(path, str) and path != BYTES and Path(path).is_file()
        keys: dict = {"data": {"tokenizer": path}} if found else {}
        ids = tokenizer.get("vocab_size")
        vocab = tree["model"].get("vocab_size")
        if not model_given and not _given(layers, "model", "vocab_size") and isinstance(ids, int) and \
                isinstance(vocab, int) and ids > vocab:
            keys["model"] = {"vocab_size": -(-ids // VOCAB_MULTIPLE) * VOCAB_MULTIPLE}
        return keys
    return {}


# the moe.* keys that are part of an imported model's architecture; its capacity is the run's choice
MOE_ARCHITECTURE = ("num_experts", "every", "top_k", "router", "normalize_gates", "expert_mlp_dim",
                    "first_dense_layers")


def checkpoint_sections(init_from: Any, preset: Any, layers: tuple[dict, ...], run_dir: Any = None) -> dict:
    """Returns the model and moe sections a Hugging Face checkpoint's config.json implies (orchestrator.hf),
    its tokenizer.json as data.tokenizer when it has one; once the source has moved, the copies a run
    started from it kept in `run_dir`/hf serve. Raises ConfigError when a preset is named too, or when a key
    of `layers` (the run YAML, the overrides) sets a model key to another value."""
    if not isinstance(init_from, str):
        raise ConfigError([("model.init_from", f"expected a directory, got {init_from!r}")])
    if preset:
        raise ConfigError([("model.preset", f"{preset!r} and model.init_from both describe the model; the "
                                            "checkpoint's config.json does, so drop the preset")])
    directory = Path(_absolute(init_from, Path.cwd()))
    kept = Path(_absolute(run_dir, Path.cwd())) / "hf" if isinstance(run_dir, str) else None
    if not (directory / "config.json").is_file() and kept is not None and (kept / "config.json").is_file():
        directory = kept  # the run's copies (orchestrator.hf.load.keep_source_files)
    derived = sections(directory)
    given = {section: {name: _given_last(layers, section, YAML_NAMES.get(name, name), value)
                       for name, value in keys.items()} for section, keys in derived.items()}
    dense = not moe_on(derived["moe"]) and not moe_on(given["moe"])  # then no moe key shapes the model
    problems = []
    for section, keys in derived.items():
        for name, value in keys.items():
            if section == "moe" and (dense or name not in MOE_ARCHITECTURE):
                continue  # a routing choice (capacity), the run's to make
            if given[section][name] != value:
                problems.append((f"{section}.{name}", f"{given[section][name]!r} conflicts with "
                                                      f"{directory / 'config.json'}, which makes it {value!r}"))
    if problems:
        raise ConfigError(problems)
    tokenizer = directory / "tokenizer.json"
    if tokenizer.is_file():
        from nestor.orchestrator.data.tokenizer import open_tokenizer

        ids, vocab = open_tokenizer(str(tokenizer), "model.init_from").vocab_size, derived["model"]["vocab_size"]
        if ids > vocab:
            raise ConfigError([("model.init_from", f"{tokenizer} has {ids} tokens, more than config.json's "
                                                   f"vocab_size {vocab}: the tokenizer is not this model's")])
        derived["data"] = {"tokenizer": str(tokenizer)}
    return derived


def _given_last(layers: tuple[dict, ...], section: str, name: str, default: Any) -> Any:
    """Returns `section.name` as the last of `layers` (the run YAML, then the overrides) that sets it gives
    it, else `default`: the merged config is judged, not each layer, and a later layer's null unsets what an
    earlier one set (`model.preset=null`)."""
    for layer in reversed(layers):
        if isinstance(layer.get(section), dict) and name in layer[section]:
            return layer[section][name]
    return default


def _absolute(path: str, base: Path) -> str:
    expanded = Path(path).expanduser()
    return str(expanded if expanded.is_absolute() else base / expanded)


def resolve_paths(config: Config, base: Path) -> Config:
    """Returns `config` with every path a user writes (run.dir, run.compile_cache, data.paths globs,
    data.tokenizer, data.mixture's paths, eval.paths) made absolute against `base`, `~` expanded.

    `load` resolves against the directory `nestor` runs in, before the config
    reaches any other process: a Ray worker's working directory is Ray's, not the user's.
    """
    run, data = config.run, config.data
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, init_from=config.model.init_from and
                                  _absolute(config.model.init_from, base)),
        lora=dataclasses.replace(config.lora, init_from=config.lora.init_from and
                                 _absolute(config.lora.init_from, base)),
        run=dataclasses.replace(run, dir=_absolute(run.dir, base),
                                compile_cache=run.compile_cache and _absolute(run.compile_cache, base)),
        data=dataclasses.replace(data, paths=tuple(_absolute(p, base) for p in data.paths),
                                 tokenizer=data.tokenizer and _absolute(data.tokenizer, base),
                                 mixture=tuple(_resolved_entry(entry, base) for entry in data.mixture)),
        eval=dataclasses.replace(config.eval, paths=tuple(_absolute(p, base) for p in config.eval.paths)))


def _resolved_entry(entry: dict, base: Path) -> dict:
    """Returns a data.mixture entry with its paths (a string or a list) made absolute; an entry of
    another shape is returned as it is, for validation to name."""
    paths = entry.get("paths")
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        return entry
    return {**entry, "paths": [_absolute(p, base) for p in paths]}


def _validated(config: Config) -> Config:
    """Returns `config` with its paths resolved against the working directory, validated."""

    return validate(resolve_paths(config, Path.cwd()))
