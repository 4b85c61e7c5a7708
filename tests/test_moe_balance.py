"""DeepSeek-V3's MoE stack: the first layers dense (`moe.first_dense_layers`) and auxiliary-loss-free
balancing (`moe.bias_update_rate`, arXiv 2408.15664): the bias balances a biased router, stays out
of the optimizer and survives a checkpoint exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nestor.models.moe import EXPERT_LOAD, ExpertBias, MoELayerConfig
from nestor.models.transformer import TransformerConfig, moe_feed_forward
from nestor.orchestrator.checkpoint.reader import restore_state
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.loop.metrics import expert_bias_scalars, moe_layer_indices
from nestor.orchestrator.job.moe_wiring import EXPERT_BIAS, balanced_expert_bias
from nestor.orchestrator.specs.lm_flops import matmul_params_per_token
from tests.helpers import run

FIRST_DENSE = ("moe.num_experts=4", "moe.every=1", "moe.first_dense_layers=2")


def test_first_dense_layers_are_a_dense_stack_before_the_moe_units(tiny_config):
    config = tiny_config(*FIRST_DENSE)
    layout = build_job(config, with_data=False).layout
    shapes = jax.tree.map(lambda leaf: leaf.shape, layout.abstract["params"])
    assert shapes["dense_blocks"]["mlp"]["up"] == (2, 64, 128)  # layers 0 and 1: dense
    assert shapes["blocks"]["expert_layer"]["mlp"]["up"] == (2, 4, 64, 128)  # layers 2 and 3: MoE
    assert layout.logical["dense_blocks"]["mlp"]["up"] == ("dense_layers", "embed", "mlp")
    assert config.moe_layers == 2 and moe_layer_indices(config, 2) == [2, 3]
    feed_forward = 3 * 64 * 128
    assert matmul_params_per_token(config) - matmul_params_per_token(tiny_config()) == 2 * (feed_forward + 64 * 4)


def test_deepseek_style_preset_has_the_parameters_its_comment_gives(tiny_config):
    config = tiny_config("model.preset=deepseek-tiny")
    layout = build_job(config, with_data=False).layout
    assert sum(leaf.size for leaf in jax.tree.leaves(layout.abstract["params"])) == 541_376
    assert matmul_params_per_token(config) == 229_376
    assert (config.moe_layers, config.moe.top_k, config.moe.capacity_factor) == (4, 4, 0.0)


@pytest.mark.parametrize("overrides, key", [
    (("moe.num_experts=4", "moe.every=1", "moe.first_dense_layers=4"), "moe.first_dense_layers"),
    (("moe.num_experts=4", "moe.every=2", "moe.first_dense_layers=1"), "moe.every"),
    (("moe.num_experts=4", "moe.every=1", "moe.first_dense_layers=1", "mesh.pipeline=2", "mesh.data=4",
      "pipeline.microbatches=2"), "model.num_layers"),  # 3 MoE units on 2 stages
], ids=["no_moe_layer_left", "every_vs_layers_after", "units_vs_stages"])
def test_first_dense_layers_config_errors_name_their_key(tiny_config, overrides, key):
    with pytest.raises(ConfigError) as error:
        tiny_config(*overrides)
    assert key in [problem_key for problem_key, _ in error.value.problems]


def test_bias_update_balances_a_router_biased_to_one_expert():
    experts, steps = 8, 40
    moe = MoELayerConfig(num_experts=experts, every=1, top_k=2, capacity_factor=0, router="sigmoid",
                         bias_update_rate=0.01)
    cfg = TransformerConfig(vocab_size=8, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                            mlp_dim=16, init_std=0.5, moe=moe)
    layer = moe_feed_forward(cfg, nnx.Rngs(params=3))
    layer.router[...] = layer.router[...].at[0, 0].add(5.0)  # with feature 0 at 1: expert 0's logit + 5
    graphdef, bias, params = nnx.split(layer, ExpertBias, ...)

    def tokens(index):  # feature 0 is always 1, so every token favours expert 0
        return jax.random.normal(jax.random.key(index), (16, 32, 16), jnp.float32).at[..., 0].set(1.0)

    @jax.jit
    def step(bias, x):  # the router does not learn: the bias alone must balance it
        counts = nnx.merge(graphdef, bias, params)(x)[1]["moe_tokens_per_expert"]
        load = counts / jnp.sum(counts)
        return balanced_expert_bias(bias, load, 0.01), jnp.max(load) / jnp.mean(load)

    imbalance = []
    for index in range(steps):
        bias, ratio = step(bias, tokens(index))
        imbalance.append(float(ratio))
    assert imbalance[0] > 3.0  # expert 0 is in nearly every token's top 2 (4 x the even share of 8 at most)
    assert max(imbalance[25:]) < 1.5, imbalance  # balanced within 25 steps of 0.01, and stays so
    assert float(bias["selection_bias"][...][0]) < -0.1  # expert 0 is held back


@pytest.mark.slow
def test_bias_moves_outside_the_optimizer_and_survives_a_checkpoint_exactly(tiny_config):
    config = tiny_config("moe.num_experts=4", "moe.every=2", "moe.bias_update_rate=0.01", "moe.aux_loss_weight=0",
                         "train.steps=3", "checkpoint.every=3", "metrics.image_every=1", "mesh.data=1",
                         "mesh.expert=2", "mesh.fsdp=4")
    result = run(config)
    bias = np.asarray(result.state["expert_bias"]["blocks"]["expert_layer"]["mlp"]["selection_bias"])
    assert bias.shape == (2, 4) and np.any(bias != 0)  # layers 1 and 3
    assert np.max(np.abs(bias)) <= 3 * 0.01 + 1e-6  # each step moves a bias by +-rate at most
    np.testing.assert_array_equal(bias, result.history[-1][EXPERT_BIAS])
    assert "selection_bias" not in str(jax.tree_util.tree_structure(result.state["opt_state"]))
    assert np.sum(result.history[-1][EXPERT_LOAD], axis=1) == pytest.approx([1.0, 1.0])
    step, restored = restore_state(config, build_job(config, with_data=False).layout)
    assert step == 3
    np.testing.assert_array_equal(restored["expert_bias"]["blocks"]["expert_layer"]["mlp"]["selection_bias"], bias)
    tags = expert_bias_scalars(config, bias)
    assert tags["moe/expert_bias/layer_3/expert_0"] == pytest.approx(float(bias[1, 0]))
    assert len(tags) == 8
