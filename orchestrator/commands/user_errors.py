"""An exception the user's own code raised (`model.class`, `data.factory`) as a config error: the user's frames
(orchestrator.user_code), the keys that name that code and, for a field the batches lack, the fields they hold."""

from __future__ import annotations

from nestor.orchestrator.config.keys import ARRAY_SOURCES
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.specs.registry import spec_of
from nestor.orchestrator.user_code import UserCodeError, user_frames


def user_code_keys(config: Config) -> list[str]:
    """Returns the keys that name the user's code in `config`, with their values (`model.class mlp:MLP`)."""
    keys = [f"model.class {path}" for path in spec_of(config).user_code(config)]
    if config.data.source == "python" and config.data.factory:
        keys.append(f"data.factory {config.data.factory}")
    return keys or ["model.class"]


def missing_field(config: Config, error: BaseException) -> list[tuple[str, str]]:
    """Returns the problem of a KeyError for a field the batches lack (the model reads a field the data files
    or the factory do not give), naming the data key and the fields they hold; [] for any other error."""
    if not isinstance(error, KeyError) or config.data.source not in ARRAY_SOURCES or not error.args:
        return []
    from nestor.orchestrator.data.batches import batch_fields

    fields = sorted(batch_fields(config))
    if error.args[0] in fields:
        return []
    key, where = (("data.paths", f"{', '.join(config.data.paths)} hold") if config.data.source == "arrays"
                  else ("data.factory", f"{config.data.factory} returns"))
    return [(key, f"{where} the fields {', '.join(fields)}, not {error.args[0]!r}, which your code reads")]


def user_code_error(config: Config, error: BaseException) -> UserCodeError | None:
    """Returns `error`, raised in the user's own code, as a UserCodeError (its frames, the key of the code,
    `missing_field`), which the CLI shows and a Ray worker hands to the driver; None for an error of nestor's
    own, which keeps its whole traceback."""
    if not user_frames(error):
        return None
    keys = user_code_keys(config)
    problem = (keys[0].split(" ")[0], f"your code ({' and '.join(keys)}) raised {type(error).__name__}: "
                                      f"{str(error)[:300]}")
    return UserCodeError(problem[0], "", error, problems=[problem, *missing_field(config, error)])
