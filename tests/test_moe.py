"""GShard MoE: routing against a per-token reference, losses by hand, equivalence
to one device on expert meshes, all-to-all layout, config errors, FLOPs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.moe import MoEFeedForward, MoELayerConfig, expert_capacity, load_balancing_loss, route, router_z_loss
from models.transformer import TransformerConfig
from orchestrator.config import ConfigError, MoEConfig
from orchestrator.explain import compile_step, param_table
from orchestrator.flops import matmul_params_per_token
from orchestrator.moe import moe_loss_and_metrics
from orchestrator.train import build_job
from parallel.hlo import collectives
from tests.helpers import ONE_DEVICE, assert_same_training, mesh_overrides, run

EXPERTS = 4
MOE = ("moe.num_experts=4", "moe.every=2")


def moe_layer(top_k: int, capacity_factor: float, groups_of: int = 0) -> MoEFeedForward:
    moe = MoELayerConfig(num_experts=EXPERTS, every=1, top_k=top_k, capacity_factor=capacity_factor,
                         group_size=groups_of)
    cfg = TransformerConfig(vocab_size=8, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                            mlp_dim=24, init_std=0.5, moe=moe)
    return MoEFeedForward(cfg, nnx.Rngs(params=3))


def expert_output(layer: MoEFeedForward, expert: int, x: jax.Array) -> jax.Array:
    """One expert's SwiGLU on tokens x [n, embed], computed directly from its weights."""
    gate, up, down = layer.gate[...][expert], layer.up[...][expert], layer.down[...][expert]
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def reference_output(layer: MoEFeedForward, x: jax.Array, top_k: int) -> jax.Array:
    """For each token: its top-k experts run directly, outputs summed with their (renormalised) gates."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = jax.nn.softmax(tokens @ layer.router[...], axis=-1)
    gates, experts = jax.lax.top_k(probs, top_k)
    if top_k > 1:
        gates = gates / gates.sum(-1, keepdims=True)
    outputs = jnp.stack([expert_output(layer, e, tokens) for e in range(EXPERTS)])  # [experts, tokens, embed]
    picked = outputs[experts, jnp.arange(tokens.shape[0])[:, None]]  # [tokens, k, embed]
    return jnp.einsum("tk,tkd->td", gates, picked).reshape(x.shape)


def tokens(batch=2, length=8, dim=16):
    return jax.random.normal(jax.random.key(7), (batch, length, dim), jnp.float32)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_output_equals_per_token_reference_when_nothing_drops(top_k):
    layer = moe_layer(top_k, capacity_factor=EXPERTS / top_k)  # capacity = tokens per group
    x = tokens()
    output, stats = layer(x)
    np.testing.assert_allclose(output, reference_output(layer, x, top_k), rtol=1e-5, atol=1e-5)
    assert float(stats["moe_dropped_fraction"]) == 0.0
    assert float(stats["moe_tokens_per_expert"].sum()) == top_k * x.shape[0] * x.shape[1]


def test_capacity_one_drops_all_but_the_first_token_of_each_expert():
    layer = moe_layer(1, capacity_factor=0.01, groups_of=4)
    x = tokens()
    assert expert_capacity(4, EXPERTS, 1, 0.01) == 1
    output, stats = layer(x)
    choice = np.asarray(jnp.argmax(x.reshape(-1, 4, 16) @ layer.router[...], axis=-1))  # [groups, tokens]
    first = np.array([[e not in row[:s] for s, e in enumerate(row)] for row in choice])  # first of its expert
    output = np.asarray(output).reshape(-1, 4, 16)
    assert np.all(output[~first] == 0.0)
    kept_reference = np.asarray(reference_output(layer, x, 1)).reshape(-1, 4, 16)[first]
    np.testing.assert_allclose(output[first], kept_reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(stats["moe_dropped_fraction"]), 1 - first.mean(), rtol=1e-6)


def test_top2_capacity_one_keeps_one_slot_per_chosen_expert():
    logits = jnp.log(jnp.array([[[0.5, 0.3, 0.1, 0.1], [0.6, 0.1, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]]))
    routing = route(logits, top_k=2, capacity=1)
    # first choices: 0, 0, 3 -> slots of experts 0 and 3; second choices 1, 2, 2 -> experts 1, 2 take one each
    np.testing.assert_array_equal(routing.dispatch[0, :, :, 0], [[1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    np.testing.assert_allclose(float(routing.stats["moe_dropped_fraction"]), 2 / 6, rtol=1e-6)
    np.testing.assert_allclose(routing.combine[0, 0, :, 0], [0.5 / 0.8, 0.3 / 0.8, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(routing.stats["moe_tokens_per_expert"], [2, 1, 2, 1])


def test_aux_loss_matches_hand_computed_value():
    probs = jnp.array([[[0.8, 0.2], [0.6, 0.4], [0.3, 0.7], [0.9, 0.1]]])
    first_choice = jax.nn.one_hot(jnp.argmax(probs, -1), 2)
    # shares (3/4, 1/4), mean probabilities (0.65, 0.35): mean(0.4875, 0.0875) * 2^2
    np.testing.assert_allclose(float(load_balancing_loss(probs, first_choice)), 1.15, rtol=1e-6)
    stats = route(jnp.zeros((2, 8, EXPERTS)), top_k=2, capacity=8).stats
    assert float(stats["moe_aux_loss"]) == pytest.approx(1.0)
    assert float(router_z_loss(jnp.zeros((2, 8, EXPERTS)))) == pytest.approx(math.log(EXPERTS) ** 2)


def test_train_loss_adds_weighted_aux_and_z_loss_of_every_moe_layer():
    stats = {"moe_aux_loss": jnp.array([1.0, 1.0]), "moe_z_loss": jnp.array([2.0, 4.0]),
             "moe_dropped_fraction": jnp.array([0.0, 0.5]), "moe_tokens_per_expert": jnp.ones((2, EXPERTS))}
    loss, metrics = moe_loss_and_metrics(stats, MoEConfig(aux_loss_weight=0.01, z_loss_weight=0.001))
    assert float(loss) == pytest.approx(2 * 0.01 + 6 * 0.001)
    assert {k: float(v) for k, v in metrics.items() if v.ndim == 0} == pytest.approx(
        {"moe_aux_loss": 1.0, "moe_z_loss": 3.0, "moe_dropped_fraction": 0.25})
    assert metrics["moe_tokens_per_expert"].shape == (2, EXPERTS)
