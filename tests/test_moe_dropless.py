"""Dropless MoE (moe.capacity_factor=0): grouped matmuls over tokens sorted by expert against the
capacity path and a per-token reference, its exchange on an expert mesh and what explain reports.
Equivalence to one device is in test_moe.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nestor.models.moe import MoEFeedForward, MoELayerConfig, dropless_expert_outputs
from nestor.models.transformer import TransformerConfig, moe_feed_forward
from nestor.orchestrator.commands.explain import compile_step, explain
from nestor.orchestrator.job.build import build_job
from nestor.parallel.experts import ALL_GATHER
from nestor.parallel.hlo import collectives
from tests.helpers import mesh_overrides
from tests.test_moe import MOE, reference_output
from tests.test_moe_dispatch import output_stats_and_grads

EXPERTS = 8


def layer_with(top_k: int, capacity_factor: float, router: str = "softmax", shared: int = 0,
               dispatch: str = "sort") -> MoEFeedForward:
    moe = MoELayerConfig(num_experts=EXPERTS, every=1, top_k=top_k, capacity_factor=capacity_factor, router=router,
                         expert_mlp_dim=8, shared_experts=shared, dispatch=dispatch)
    cfg = TransformerConfig(vocab_size=8, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                            mlp_dim=24, init_std=0.5, moe=moe)
    return moe_feed_forward(cfg, nnx.Rngs(params=3))


@pytest.mark.slow
@pytest.mark.parametrize("top_k, random_second", [(1, False), (2, False), (2, True), (8, False)],
                         ids=["top1", "top2", "top2_random", "top8"])
def test_dropless_equals_the_capacity_path_when_nothing_drops(top_k, random_second):
    x = jax.random.normal(jax.random.key(7), (4, 16, 16), jnp.float32)
    key = jax.random.key(1) if random_second else None
    dropless = output_stats_and_grads(layer_with(top_k, 0.0), x, key)
    capacity = output_stats_and_grads(layer_with(top_k, EXPERTS / top_k), x, key)  # capacity = tokens per group
    np.testing.assert_allclose(dropless[0], capacity[0], rtol=1e-5, atol=1e-5)
    for name in capacity[1]:
        np.testing.assert_allclose(dropless[1][name], capacity[1][name], rtol=1e-6, err_msg=name)
    assert float(dropless[1]["moe_dropped_fraction"]) == 0.0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(dropless[2]), jax.tree.leaves(capacity[2])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("router, top_k, shared", [("sigmoid", 2, 1), ("sigmoid", 4, 1), ("softmax", 8, 2)],
                         ids=["sigmoid_top2_shared1", "sigmoid_top4_shared1", "softmax_top8_shared2"])
def test_dropless_equals_per_token_reference_with_shared_experts_and_sigmoid_routing(router, top_k, shared):
    layer = layer_with(top_k, 0.0, router, shared)
    x = jax.random.normal(jax.random.key(7), (2, 8, 16), jnp.float32)
    output, stats = layer(x)
    np.testing.assert_allclose(output, reference_output(layer, x, top_k, router), rtol=1e-5, atol=1e-5)
    assert float(stats["moe_tokens_per_expert"].sum()) == top_k * 16


def test_experts_outside_the_given_range_contribute_nothing():
    layer = layer_with(2, 0.0)
    tokens = jax.random.normal(jax.random.key(7), (6, 16), jnp.float32)
    experts = jnp.array([[0, 5], [5, 6], [7, 1], [4, 5], [2, 3], [6, 4]], jnp.int32)
    gates = jnp.full((6, 2), 0.5, jnp.float32)
    weights = (layer.gate[...], layer.up[...], layer.down[...])
    whole = dropless_expert_outputs(tokens, experts, gates, weights)
    # two devices' halves of the experts (4..7 on the second) add up to the whole
    halves = [dropless_expert_outputs(tokens, experts, gates, tuple(w[first:first + 4] for w in weights), first)
              for first in (0, 4)]
    np.testing.assert_allclose(halves[0] + halves[1], whole, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(halves[0])[[5]] == 0.0)  # token 5's experts (6, 4) are both on the second half


@pytest.mark.slow
def test_explain_reports_the_exchange_and_its_worst_case_buffer(tiny_config, capfd):
    config = tiny_config(*MOE, "moe.capacity_factor=0").replace(**mesh_overrides(expert=4, data=2))
    job = build_job(config, with_data=False)
    report = explain(config, job)["dropless_moe"]
    tokens_per_device = 16 * 32 // 8
    rows = tokens_per_device * 4 * 2  # every token of the 4 expert devices, k = 2 times
    assert report == {"exchange": ALL_GATHER, "grouped_matmul": "xla", "buffer_rows": rows,
                      "buffer_bytes_per_device": rows * (2 * 64 + 3 * 128) * 4}
    found = collectives(compile_step(job).as_text())
    assert found["all-to-all"]["count"] == 0
    assert found["reduce-scatter"]["count"] > 0
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
