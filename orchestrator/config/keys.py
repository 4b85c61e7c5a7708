"""The key table's machinery: how a config key declares its default, comment and range (`key`, `Key`),
and the table of every key of a config dataclass (`key_table`). The keys themselves are declared in
nestor.orchestrator.config.schema."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

INT32_MAX = 2**31 - 1  # steps, sizes and counts live in int32 on the device
ARRAY_SOURCES = ("arrays", "python")  # the data sources of named arrays, for a model.class of the user's


def moe_on(section: dict) -> bool:
    """Returns whether an `moe` section (plain data) places expert layers: experts, and an interval."""
    return bool(section.get("num_experts")) and bool(section.get("every"))


@dataclasses.dataclass(frozen=True)
class Key:
    """What one config key may hold, declared beside its default.

    base.yaml's comment for the key is `comment()` (tests/test_config_table.py
    checks every line), so the comment, the type and the range cannot drift.
    Integers are at most INT32_MAX unless `maximum` says otherwise; floats are
    finite. For a list key, `choices` applies to each element.
    """

    doc: str
    minimum: float | None = None  # inclusive
    maximum: float | None = None  # inclusive
    above: float | None = None    # exclusive lower bound
    below: float | None = None    # exclusive upper bound
    also: tuple = ()              # values allowed outside the range, e.g. -1 = fill the mesh
    choices: tuple = ()

    def bounds(self) -> str:
        """Returns the range as base.yaml shows it, e.g. `[>= 1 or -1]`; empty when unbounded."""
        parts = [f"{sign} {_number(bound)}" for sign, bound in
                 ((">=", self.minimum), (">", self.above), ("<=", self.maximum), ("<", self.below))
                 if bound is not None]
        if not parts:
            return ""
        return "[" + ", ".join(parts) + "".join(f" or {_number(v)}" for v in self.also) + "]"

    def comment(self) -> str:
        """Returns the key's comment in base.yaml: the doc, then the range."""
        return " ".join(part for part in (self.doc, self.bounds()) if part)

    def problem(self, value: Any) -> str | None:
        """Returns what is wrong with a value of the right type, or None."""
        if self.choices and value not in self.choices:
            return f"{value!r} is not one of {', '.join(map(str, self.choices))}"
        if isinstance(value, str) and value not in self.also and any(isinstance(v, str) for v in self.also):
            return f"{value!r} is not a number {self.bounds()[1:-1]}"  # a key of a number or a name
        if value in self.also or isinstance(value, (bool, str)):
            return None
        maximum = self.maximum if self.maximum is not None or not isinstance(value, int) else INT32_MAX
        failed = [text for text, broken in (
            (f">= {_number(self.minimum)}", self.minimum is not None and value < self.minimum),
            (f"> {_number(self.above)}", self.above is not None and value <= self.above),
            (f"<= {_number(maximum)}", maximum is not None and value > maximum),
            (f"< {_number(self.below)}", self.below is not None and value >= self.below)) if broken]
        if not failed:
            return None
        allowed = "".join(f" or {_number(v)}" for v in self.also)
        return f"must be {' and '.join(failed)}{allowed}, got {value:g}" if isinstance(value, float) \
            else f"must be {' and '.join(failed)}{allowed}, got {value}"


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def key(default: Any, doc: str, **limits: Any) -> Any:
    """Returns a dataclass field with `default` and its Key (doc, range, choices) as metadata."""
    factory = {"default_factory": type(default)} if isinstance(default, dict) else {"default": default}
    return dataclasses.field(**factory, metadata={"key": Key(doc, **limits)})


YAML_NAMES = {"async_save": "async", "class_": "class"}  # fields whose YAML key is a Python keyword
FIELD_NAMES = {yaml_name: field for field, yaml_name in YAML_NAMES.items()}


def hints(cls: type) -> dict[str, Any]:
    """Returns the type hints of the dataclass `cls` by field name (its annotations resolved)."""
    return typing.get_type_hints(cls)


@functools.cache
def key_table(cls: type, prefix: str = "") -> tuple[tuple[str, Any, Any, Key], ...]:
    """Returns (dotted path, type hint, default, Key) for every key of the config dataclass `cls` (sections
    are nested dataclasses), in declaration order."""
    rows = ()
    for field in dataclasses.fields(cls):
        path = prefix + YAML_NAMES.get(field.name, field.name)
        hint = hints(cls)[field.name]
        if dataclasses.is_dataclass(hint):
            rows += key_table(hint, path + ".")
        else:
            default = field.default_factory() if field.default is dataclasses.MISSING else field.default
            rows += ((path, hint, default, field.metadata["key"]),)
    return rows
