"""A user's YAML, read within bounds: regular files only, at most MAX_BYTES, at most MAX_VALUES values once
aliases are expanded, no key written twice in a mapping. Anything else is a one-line ConfigError naming
the file (or the override), in milliseconds: a FIFO or /dev/zero would block or fill memory, an alias
bomb expands to billions of values, and a repeated key or section would silently drop the first."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import yaml

from nestor.orchestrator.errors import ConfigError

MAX_BYTES = 2**20       # base.yaml, every key with its comment, is 14 KiB; a run YAML a few hundred bytes
MAX_VALUES = 100_000    # scalars, sequences and mappings, each alias counted as what it expands to

# libyaml's loader where PyYAML was built with it: the same safe YAML 1.1, ~10x faster.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE = "tag:yaml.org,2002:merge"
_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class _Refused(Exception):
    """YAML that parses but is refused: what is wrong, in one line."""


def read_yaml(path: Path, key: str, empty_ok: bool = True) -> dict:
    """Returns the mapping a YAML file holds; anything else (missing, not a regular file, larger than
    MAX_BYTES, not UTF-8, not YAML, a key written twice, an alias bomb, not a mapping, empty unless
    `empty_ok`) raises a one-line ConfigError naming `key`."""
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError([(key, f"{path} is a directory; give a YAML file")])
        if not stat.S_ISREG(mode):  # checked before opening: opening a FIFO blocks until a writer comes
            raise ConfigError([(key, f"{path} is not a regular file (a pipe, a device or a socket); give a YAML "
                                     "file")])
        with path.open("rb") as file:
            raw = file.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError([(key, f"file not found: {path}")]) from None
    except OSError as error:
        raise ConfigError([(key, f"cannot read {path}: {error.strerror}")]) from None
    if len(raw) > MAX_BYTES:
        raise ConfigError([(key, f"{path} is larger than {MAX_BYTES // 2**10} KiB; a config is a few hundred "
                                 "bytes: give the run's YAML")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError([(key, f"{path} is not UTF-8 text (byte {error.start}); give a YAML file")]) from None
    try:
        data = _load(text)
    except yaml.YAMLError as error:
        raise ConfigError([(key, f"{path} is not valid YAML: {' '.join(str(error).split())}")]) from None
    except _Refused as error:
        raise ConfigError([(key, f"{path}: {error}")]) from None
    if data is None and empty_ok:
        return {}
    if data is None:
        raise ConfigError([(key, f"{path} is empty; write `{{}}` for a file that sets nothing")])
    if not isinstance(data, dict):
        raise ConfigError([(key, f"{path} must hold a mapping of sections")])
    return data


def override_value(text: str, key: str) -> Any:
    """Returns the value of an override `key=text` as YAML reads it (text that is not YAML stays a string);
    raises ConfigError naming `key` for a key written twice or more than MAX_VALUES values."""
    try:
        return _load(text)
    except yaml.YAMLError:
        return text
    except _Refused as error:
        raise ConfigError([(key, str(error))]) from None


def _load(text: str) -> Any:
    """Returns the data of one YAML document (safe tags only). Raises yaml.YAMLError for text that is not
    YAML and _Refused for what `_check_nodes` refuses."""
    loader = _SAFE_LOADER(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_nodes(root: yaml.Node) -> None:
    """Raises _Refused for a mapping that writes a key twice, a document of more than MAX_VALUES nodes (an
    alias counted as often as it is used: a recursive alias never ends, it is over the bound too) or a
    base-60 number (`1:30`, which YAML 1.1 reads as 90)."""
    # Each entry is (node, its place): a place is None for the root, else (the parent's place, a name).
    pending: list[tuple[yaml.Node, tuple | None]] = [(root, None)]
    visited = 0
    while pending:
        node, place = pending.pop()
        visited += 1
        if visited > MAX_VALUES:
            raise _Refused(f"expands to more than {MAX_VALUES:,} values (YAML aliases that repeat each other?); "
                           "write the config out")
        if isinstance(node, yaml.ScalarNode) and node.tag in _NUMBERS and ":" in node.value:
            number = yaml.safe_load(node.value)
            where = f"{_dotted(place)}: " if place is not None else ""
            raise _Refused(f"{where}{node.value} reads as {number} in YAML 1.1 (a base-60 number, as in a clock "
                           f"time); write {number}, or quote '{node.value}' for text")
        if isinstance(node, yaml.SequenceNode):
            pending += [(item, (place, f"[{index}]")) for index, item in enumerate(node.value)]
        elif isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE:
                    pending.append((value_node, place))
                    continue
                name = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                line = key_node.start_mark.line + 1
                if name is not None and name in lines:
                    raise _Refused(f"{_dotted((place, name))} is written twice (lines {lines[name]} and {line}); "
                                   "YAML would keep only the last: write it once")
                if name is not None:
                    lines[name] = line
                pending += [(key_node, place), (value_node, (place, str(name)))]


def _dotted(place: tuple | None) -> str:
    """Returns a node's place as a key path, e.g. `train.steps` or `data.mixture[0].paths`."""
    names = []
    while place is not None:
        place, name = place
        names.append(name)
    return "".join(name if name.startswith("[") or index == 0 else f".{name}"
                   for index, name in enumerate(reversed(names)))
