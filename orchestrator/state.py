"""The train state: built abstractly, laid out by logical names, initialised sharded.

The state is a plain dict `{"step", "params", "opt_state"}` whose params are a
nested dict of arrays with layers stacked `[layers, ...]`: the one canonical
layout checkpoints store, whatever the mesh. A model with auxiliary-loss-free
MoE balancing adds `"expert_bias"`: its `ExpertBias` variables, laid out as
the params are, which the step moves and the optimizer never sees.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.matmul import attention_name
from models.moe import ExpertBias
from models.transformer import Transformer, TransformerConfig
from orchestrator.config import Config, ConfigError
from orchestrator.moe import moe_layer_config
from orchestrator.optimizer import make_optimizer
from orchestrator.remat import target_platform
from parallel.rules import Rules, tree_shardings


def attention_implementation(choice: str, platform: str, dtype: str) -> str:
    """Returns `jax.nn.dot_product_attention`'s implementation for `model.attention` on `platform`.

    `auto` is cuDNN flash attention on GPUs in bfloat16 or float16 and XLA
    everywhere else (CPU, TPU, float32). Raises ConfigError when `cudnn` is asked
    for on a platform without it.
    """
    gpu = platform in ("gpu", "cuda", "rocm")
    if choice == "auto":
        return "cudnn" if gpu and dtype in ("bfloat16", "float16") else "xla"
    if choice == "cudnn" and not gpu:
        raise ConfigError([("model.attention", f"cudnn needs a GPU, the devices are {platform}; use auto or xla")])
    return choice


def model_config(config: Config, platform: str | None = None) -> TransformerConfig:
    """Returns the model's own config from the run config, attention resolved for `platform`
    (a jax platform name; default: jax's default backend). In bfloat16, for a run meant for CPUs
    (`target_platform`: not `nestor explain` on CPU for an H100), the weight matmuls and attention's
    products return float32 sums that the model rounds (models.matmul: XLA:CPU of jax 0.10 would upcast
    the dots)."""
    m = config.model
    platform = platform or jax.default_backend()
    attention = attention_implementation(m.attention, platform, m.dtype)
    return TransformerConfig(
        vocab_size=m.vocab_size, embed_dim=m.embed_dim, num_layers=m.num_layers,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        mlp_dim=m.mlp_dim, tie_embeddings=m.tie_embeddings, rope_theta=m.rope_theta,
        norm_eps=m.norm_eps, init_std=m.init_std, dtype=m.dtype, attention=attention,
        float32_matmul_outputs=target_platform(config, platform) == "cpu" and m.dtype == "bfloat16",
        moe=moe_layer_config(config, platform),
    )


def attention_run(config: Config, platform: str | None = None) -> str:
    """Returns, for reports, what the model's attention runs on `platform` (models.matmul.attention_name):
    `model.attention`'s implementation, or causal_attention where bfloat16 on CPU sums in float32.
    Raises ConfigError as model_config does (cuDNN asked for off a GPU)."""
    model = model_config(config, platform)
    return attention_name(model.float32_matmul_outputs, model.attention)


def build_model(config: Config, seed: int, platform: str | None = None) -> Transformer:
    """Returns a freshly initialised model for `platform` (call under jit or eval_shape for big ones)."""
    return Transformer(model_config(config, platform), nnx.Rngs(params=seed))


def _nest(flat: dict[tuple, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Everything known about the train state before any device holds it."""

    graphdef: Any            # the model's structure; merge with params to get a module
    logical: dict            # params tree of logical-axis tuples
    abstract: dict           # state tree of jax.ShapeDtypeStruct (with shardings)
    shardings: dict          # state tree of NamedSharding
    optimizer: optax.GradientTransformation


def split_model(model: Transformer) -> tuple[Any, nnx.State, nnx.State]:
    """Returns (graphdef, expert biases, everything else: the parameters); merge them back in that order."""
    return nnx.split(model, ExpertBias, ...)


def _logical_and_values(state: nnx.State) -> tuple[dict, dict]:
    """Returns (tree of logical-axes tuples, tree of values) of a model state's variables."""
    flat = nnx.to_flat_state(state)
    return (_nest({tuple(path): var.get_metadata()["logical_axes"] for path, var in flat}),
            _nest({tuple(path): var.get_value() for path, var in flat}))


def state_layout(config: Config, mesh: Mesh, rules: Rules) -> StateLayout:
    """Returns the abstract, sharded layout of the train state for `mesh`."""
    platform = mesh.devices.flat[0].platform
    abstract_model = nnx.eval_shape(lambda: build_model(config, config.run.seed, platform))
    graphdef, abstract_bias, abstract_params = split_model(abstract_model)
    logical, params_shape = _logical_and_values(abstract_params)
    bias_logical, bias_shape = _logical_and_values(abstract_bias)
    optimizer = make_optimizer(config, logical)
    opt_shape = jax.eval_shape(optimizer.init, params_shape)

    param_shardings = tree_shardings(logical, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, sharding: sharding, opt_shape, param_shardings,
        transform_non_params=lambda _: replicated,
    )
    shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings}
    shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params_shape, "opt_state": opt_shape}
    if bias_shape:
        shardings["expert_bias"] = tree_shardings(bias_logical, mesh, rules)
        shapes["expert_bias"] = bias_shape
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    return StateLayout(graphdef, logical, abstract, shardings, optimizer)


def init_state(config: Config, layout: StateLayout) -> dict:
    """Returns the train state initialised directly into its shardings (no full copy anywhere)."""

    def init() -> dict:  # only the variables are kept: attention's implementation does not matter here
        _, bias, params = split_model(build_model(config, config.run.seed))
        params = nnx.to_pure_dict(params)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": layout.optimizer.init(params)}
        return {**state, "expert_bias": nnx.to_pure_dict(bias)} if "expert_bias" in layout.shardings else state

    return jax.jit(init, out_shardings=layout.shardings)()

