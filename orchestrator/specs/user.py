"""A user's Flax NNX module (`model.class: module:Name`, resolved in the directory nestor runs in, built from
`model.args`) as a model spec: the base's answers, and the checks that do not depend on the model; its
parameters' names and shapes are checked against the mesh once it is built (orchestrator.job.state).

`Name` is called as `Name(**model.args, rngs=nnx.Rngs(params=seed))`; where its first parameter is
annotated with a dataclass, as `Name(Dataclass(**model.args), rngs=...)`. It may be a class or any
function returning a module. The module's `loss(batch) -> (loss, metrics)` is the task contract
(models.task; docs/models.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING

from flax import nnx

from nestor.models import task
from nestor.orchestrator.config.keys import ARRAY_SOURCES
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.specs.base import ModelSpec, Problems
from nestor.orchestrator.specs.lm import LM
from nestor.orchestrator.user_code import UserCodeError, import_object
from nestor.parallel.rules import resolve_rules, split_degree

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config


class UserModel(ModelSpec):
    """A model of the user's: what the task contract and the base's defaults say."""

    def build(self, config: Config, rngs: nnx.Rngs) -> nnx.Module:
        """Raises ConfigError naming model.class or model.args when the model cannot be built or has no
        `loss` method (the task contract)."""
        path, args = config.model.class_, dict(config.model.args)
        factory = import_model_class(path)
        dataclass = _config_dataclass(factory)
        with nnx.use_eager_sharding(False):  # the job lays parameters out itself (orchestrator.job.state)
            try:
                model = factory(dataclass(**args), rngs=rngs) if dataclass else factory(**args, rngs=rngs)
            except (TypeError, ValueError) as error:  # arguments the class does not take, or refuses
                target = f"{path}'s {dataclass.__name__}" if dataclass else path
                raise UserCodeError("model.args", "", error, problems=[
                    ("model.args", f"{target} cannot be built from {args}: {error}")]) from None
            except Exception as error:  # noqa: BLE001 - the user's code raised: shown with its own frames
                raise UserCodeError("model.class", f"building {path} from model.args {args}", error) from None
        if not isinstance(model, nnx.Module):
            raise ConfigError([("model.class", f"{path} returned a {type(model).__name__}, not a flax.nnx.Module")])
        if not callable(getattr(model, task.LOSS_METHOD, None)):
            raise ConfigError([("model.class", f"{path} has no method {task.LOSS_METHOD}(batch) -> (loss, metrics), "
                                               "the task contract the training step calls (docs/models.md)")])
        return model

    def user_code(self, config: Config) -> list[str]:
        return [config.model.class_]

    def key_problems(self, config: Config) -> Problems:
        if problem := _not_an_import_path(config.model.class_):  # what else is wrong follows from it
            return [("model.class", problem)]
        problems = []
        if config.data.source not in ARRAY_SOURCES:
            problems.append(("data.source", f"model.class {config.model.class_} reads named arrays: use data.source="
                                            "arrays or python (the token sources feed nestor's language model, "
                                            f"model.class: {LM})"))
        if config.data.source == "python" and not config.data.factory:
            problems.append(("data.factory", "data.source=python needs module:function returning the named arrays"))
        if config.moe.num_experts:
            problems.append(("moe.num_experts", "the moe section configures nestor's language model; a model of your "
                                                "own builds its expert layers itself (docs/models.md)"))
        if config.train.objective != "lm":
            problems.append(("train.objective", f"{config.train.objective} trains nestor's language model; a model "
                                                "of your own returns its loss from loss(batch)"))
        if config.lora.rank and config.pipeline.schedule not in ("gpipe", "circular") and config.mesh.pipeline != 1:
            problems.append(("pipeline.schedule", f"LoRA on a model of your own runs under gpipe or circular; "
                                                  f"{config.pipeline.schedule} runs its stack's own weights"))
        if config.lora.init_from:
            problems.append(("lora.init_from", "a PEFT adapter adapts nestor's language model (model.class: lm)"))
        if config.model.init_from:
            problems.append(("model.init_from", "a Hugging Face checkpoint holds the weights of nestor's language "
                                                f"model (model.class: {LM}); a model of your own starts from "
                                                "run.seed"))
        return problems

    def split_problems(self, config: Config, degrees: dict[str, int]) -> Problems:
        t = config.train
        shards = split_degree("batch", resolve_rules(config.mesh.rules), degrees)
        if t.global_batch % t.grad_accum or (t.global_batch // t.grad_accum) % shards:
            return [("train.global_batch", f"{t.global_batch} rows do not split into train.grad_accum="
                                           f"{t.grad_accum} micro-batches of a multiple of the {shards} "
                                           "devices the batch is split over")]
        return []


def _not_an_import_path(path: str) -> str | None:
    """Returns why `model.class` `path` names no model (neither nestor's nor module:Name), or None."""
    if ":" in path:
        return None
    hint = f"; did you mean {LM!r}?" if path.strip().lower() == LM else ""
    return f"{path!r} is neither {LM!r} nor an import path module:Name (e.g. mypackage.vit:ViT){hint}"


def import_model_class(path: str) -> Callable[..., nnx.Module]:
    """Returns the callable `module:Name` names (orchestrator.user_code). Raises ConfigError (model.class)
    when it does not resolve."""
    if problem := _not_an_import_path(path):
        raise ConfigError([("model.class", problem)])
    return import_object(path, "model.class", "mypackage.vit:ViT")


def _config_dataclass(factory: Callable) -> type | None:
    """Returns the dataclass the first parameter of `factory` is annotated with, else None."""
    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        parameters = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]
        annotations = typing.get_type_hints(target)
    except (TypeError, ValueError, NameError):
        return None
    if not parameters:
        return None
    hint = annotations.get(parameters[0].name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None
