"""How the CLI shows an exception the user's own code raised (`model.class`, `data.factory`): the user's frames
(orchestrator.user_code), the keys that name that code and, for a field the batches lack, the fields they hold."""

from __future__ import annotations

from nestor.orchestrator.config.keys import ARRAY_SOURCES
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.specs.registry import spec_of
from nestor.orchestrator.user_code import user_code_report


def user_code_keys(config: Config) -> list[str]:
    """Returns the keys that name the user's code in `config`, with their values (`model.class mlp:MLP`)."""
    keys = [f"model.class {path}" for path in spec_of(config).user_code(config)]
    if config.data.source == "python" and config.data.factory:
        keys.append(f"data.factory {config.data.factory}")
    return keys or ["the config"]


def missing_field_line(config: Config, error: BaseException) -> str:
    """Returns a line naming the fields the batches hold where `error` is a KeyError for a field they lack
    (the model reads a field the data files or the factory do not give), else ""."""
    if not isinstance(error, KeyError) or config.data.source not in ARRAY_SOURCES or not error.args:
        return ""
    from nestor.orchestrator.data.batches import batch_fields

    fields = sorted(batch_fields(config))
    if error.args[0] in fields:
        return ""
    where = (f"data.paths: {', '.join(config.data.paths)} hold" if config.data.source == "arrays"
             else f"data.factory: {config.data.factory} returns")
    return f"\nnestor: {where} the fields {', '.join(fields)}, not {error.args[0]!r}, which your code reads"


def user_error_report(config: Config, error: BaseException) -> str | None:
    """Returns what the CLI prints for `error` when the user's own code raised it (`user_code_report`, and
    `missing_field_line`), or None for an exception of nestor's own."""
    report = user_code_report(error, user_code_keys(config))
    return None if report is None else report + missing_field_line(config, error)
