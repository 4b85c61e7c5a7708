"""Which model a run trains (`model.class`): nestor's decoder LM (`lm`, built from the `model.*` keys) or a
user's Flax NNX module named by an import path `module:Name`, resolved in the directory nestor runs in
and built from `model.args` (docs/models.md).

`Name` is called as `Name(**model.args, rngs=nnx.Rngs(params=seed))`; where its first parameter is
annotated with a dataclass, as `Name(Dataclass(**model.args), rngs=...)`. It may be a class or any
function returning a module. The module's `loss(batch) -> (loss, metrics)` is the task contract
(models.task).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable

from flax import nnx

from nestor.models import task
from nestor.models.transformer import RopeScaling, Transformer, TransformerConfig
from nestor.orchestrator.config import Config, ConfigError
from nestor.orchestrator.moe_step import moe_layer_config
from nestor.orchestrator.user_code import code_paths, import_object

LM = "lm"  # the built-in decoder LM's name in `model.class`


def is_builtin_lm(config: Config) -> bool:
    """Returns whether the run trains nestor's own decoder LM (model.class: lm)."""
    return config.model.class_ == LM


def lm_config(config: Config) -> TransformerConfig:
    """Returns the built-in LM's own config from the run config's `model.*` and `moe.*` keys."""
    m = config.model
    return TransformerConfig(
        vocab_size=m.vocab_size, embed_dim=m.embed_dim, num_layers=m.num_layers,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        mlp_dim=m.mlp_dim, tie_embeddings=m.tie_embeddings, rope_theta=m.rope_theta,
        rope_scaling=rope_scaling(m.rope_scaling), qkv_bias=m.qkv_bias, out_bias=m.out_bias, qk_norm=m.qk_norm,
        norm_eps=m.norm_eps, init_std=m.init_std, dtype=m.dtype, moe=moe_layer_config(config),
    )


def rope_scaling(keys: dict | None) -> RopeScaling | None:
    """Returns the LM's RoPE scaling from `model.rope_scaling` (validated: orchestrator.validation)."""
    if not keys:
        return None
    return RopeScaling(factor=float(keys["factor"]), low_freq_factor=float(keys["low_freq_factor"]),
                       high_freq_factor=float(keys["high_freq_factor"]),
                       original_max_position_embeddings=int(keys["original_max_position_embeddings"]))


def import_model_class(path: str) -> Callable[..., nnx.Module]:
    """Returns the callable `module:Name` names (orchestrator.user_code). Raises ConfigError (model.class)
    when it does not resolve."""
    if ":" not in path:
        raise ConfigError([("model.class", f"{path!r} is neither {LM!r} nor an import path module:Name "
                                           "(e.g. mypackage.vit:ViT)")])
    return import_object(path, "model.class", "mypackage.vit:ViT")


def resolve_user_code(config: Config) -> None:
    """Imports the run's `model.class` and `data.factory` (neither called): raises ConfigError where one
    does not resolve, for a driver that checks before its workers build anything."""
    if not is_builtin_lm(config):
        import_model_class(config.model.class_)
    if config.data.source == "python" and config.data.factory:
        import_object(config.data.factory, "data.factory", "mypackage.data:images")


def user_code_paths(config: Config) -> tuple[str, ...]:
    """Returns the user's modules and packages the run imports (`model.class`, `data.factory`) that live in
    the directory nestor runs in: what a remote cluster's workers and a submitted job receive."""
    paths = [] if is_builtin_lm(config) else [config.model.class_]
    if config.data.source == "python" and config.data.factory:
        paths.append(config.data.factory)
    return code_paths(paths)


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


def build_model(config: Config, seed: int) -> nnx.Module:
    """Returns the run's model, freshly initialised (call under jit or eval_shape for big ones).

    Raises ConfigError naming model.class or model.args when the user's model cannot be built or has no
    `loss` method (the task contract)."""
    rngs = nnx.Rngs(params=seed)
    if is_builtin_lm(config):
        return Transformer(lm_config(config), rngs)
    path, args = config.model.class_, dict(config.model.args)
    factory = import_model_class(path)
    dataclass = _config_dataclass(factory)
    with nnx.use_eager_sharding(False):  # the job lays parameters out itself (orchestrator.state)
        try:
            model = factory(dataclass(**args), rngs=rngs) if dataclass else factory(**args, rngs=rngs)
        except (TypeError, ValueError) as error:  # arguments the class does not take, or refuses
            target = f"{path}'s {dataclass.__name__}" if dataclass else path
            raise ConfigError([("model.args", f"{target} cannot be built from {args}: {error}")]) from None
    if not isinstance(model, nnx.Module):
        raise ConfigError([("model.class", f"{path} returned a {type(model).__name__}, not a flax.nnx.Module")])
    if not callable(getattr(model, task.LOSS_METHOD, None)):
        raise ConfigError([("model.class", f"{path} has no method {task.LOSS_METHOD}(batch) -> (loss, metrics), "
                                           "the task contract the training step calls (docs/models.md)")])
    return model
