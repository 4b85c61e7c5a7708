"""Which spec a run's `model.class` names (`spec_of`), and what every model is asked through it: building,
and the user's code a run imports."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flax import nnx

from nestor.orchestrator.specs.base import ModelSpec
from nestor.orchestrator.specs.lm import LM, LanguageModel
from nestor.orchestrator.specs.user import UserModel, import_model_class
from nestor.orchestrator.user_code import code_paths, import_object

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config

SPECS: dict[str, ModelSpec] = {LM: LanguageModel()}  # model.class names of nestor's own models
USER_MODEL = UserModel()  # any other model.class: an import path module:Name


def spec_of(config: Config) -> ModelSpec:
    """Returns the spec of the run's `model.class`."""
    return SPECS.get(config.model.class_, USER_MODEL)


def build_model(config: Config, seed: int) -> nnx.Module:
    """Returns the run's model, freshly initialised (call under jit or eval_shape for big ones). Raises
    ConfigError as the spec's `build` does."""
    return spec_of(config).build(config, nnx.Rngs(params=seed))


def resolve_user_code(config: Config) -> None:
    """Imports the run's `model.class` and `data.factory` (neither called): raises ConfigError where one
    does not resolve, for a driver that checks before its workers build anything."""
    for path in spec_of(config).user_code(config):
        import_model_class(path)
    if config.data.source == "python" and config.data.factory:
        import_object(config.data.factory, "data.factory", "mypackage.data:images")


def user_code_paths(config: Config) -> tuple[str, ...]:
    """Returns the user's modules and packages the run imports (`model.class`, `data.factory`) that live in
    the directory nestor runs in: what a remote cluster's workers and a submitted job receive."""
    paths = list(spec_of(config).user_code(config))
    if config.data.source == "python" and config.data.factory:
        paths.append(config.data.factory)
    return code_paths(paths)
