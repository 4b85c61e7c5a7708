"""Sort dispatch against GShard's einsum dispatch: the same routing decisions, outputs,
gradients and statistics; no [groups, tokens, experts, capacity] tensor. The all-to-alls
of both on an expert mesh are in test_moe.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nestor.models.moe import MoEFeedForward, MoELayerConfig, assign, expert_capacity, flat_slots, route
from nestor.models.transformer import TransformerConfig, moe_feed_forward

EXPERTS = 4
# (top_k, capacity_factor, random second expert); 0.3 leaves experts a third of the slots they are asked for
CASES = {"top1": (1, 1.25, False), "top2": (2, 1.25, False), "top2_random": (2, 1.25, True),
         "top2_tight": (2, 0.3, False), "top3_tight": (3, 0.5, False)}


def layer_with(dispatch: str, top_k: int, capacity_factor: float, experts: int = EXPERTS, embed: int = 16,
               mlp: int = 24) -> MoEFeedForward:
    moe = MoELayerConfig(num_experts=experts, every=1, top_k=top_k, capacity_factor=capacity_factor, dispatch=dispatch)
    cfg = TransformerConfig(vocab_size=8, embed_dim=embed, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                            mlp_dim=mlp, init_std=0.5, moe=moe)
    return moe_feed_forward(cfg, nnx.Rngs(params=3))


def output_stats_and_grads(layer: MoEFeedForward, x: jax.Array, key: jax.Array | None):
    """Returns (output, stats, gradient of a loss that uses the output and the aux loss w.r.t. every weight)."""
    graphdef, params = nnx.split(layer)
    probe = jax.random.normal(jax.random.key(11), x.shape)

    def loss(params):
        output, stats = nnx.merge(graphdef, params)(x, routing_key=key)
        return jnp.sum(output * probe) + stats["moe_aux_loss"] + stats["moe_z_loss"], (output, stats)

    grads, (output, stats) = jax.jit(jax.grad(loss, has_aux=True))(params)
    return output, stats, grads


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_sort_and_einsum_dispatch_make_the_same_slot_decisions(case):
    top_k, factor, random_second = CASES[case]
    logits = jax.random.normal(jax.random.key(5), (3, 32, EXPERTS)) * 2
    capacity = expert_capacity(32, EXPERTS, top_k, factor)
    key = jax.random.key(2) if random_second else None

    @jax.jit
    def decisions(logits, key):
        assignment = assign(logits, top_k=top_k, capacity=capacity, routing_key=key)
        routing = route(logits, top_k=top_k, capacity=capacity, routing_key=key)
        return routing, assignment, flat_slots(assignment, EXPERTS, capacity)  # slots [groups, choices, tokens]

    routing, assignment, slots = decisions(logits, key)
    # one past the last slot means dropped: one_hot of it is all zeros once that column is cut
    chosen = jax.nn.one_hot(slots, EXPERTS * capacity + 1)[..., :-1]  # [groups, choices, tokens, slots]
    np.testing.assert_array_equal(chosen.sum(1), routing.dispatch.reshape(*logits.shape[:2], -1))
    gates = jnp.stack(assignment.gates, axis=1)[..., None]
    np.testing.assert_allclose((gates * chosen).sum(1), routing.combine.reshape(*logits.shape[:2], -1), rtol=1e-7)
    if factor < 1:
        assert float(routing.stats["moe_dropped_fraction"]) > 0.2
    if random_second:  # some second choices were not routed at all
        assert float(routing.stats["moe_tokens_per_expert"].sum()) < top_k * 3 * 32


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_sort_dispatch_output_stats_and_grads_equal_einsum(case):
    top_k, factor, random_second = CASES[case]
    x = jax.random.normal(jax.random.key(7), (4, 16, 16), jnp.float32)
    key = jax.random.key(1) if random_second else None
    sort = output_stats_and_grads(layer_with("sort", top_k, factor), x, key)
    einsum = output_stats_and_grads(layer_with("einsum", top_k, factor), x, key)
    np.testing.assert_allclose(sort[0], einsum[0], rtol=1e-6, atol=1e-6)
    for name in einsum[1]:
        np.testing.assert_array_equal(sort[1][name], einsum[1][name], err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(sort[2]), jax.tree.leaves(einsum[2])):
        # weight gradients sum over tokens, in another order: float32 rounding of values up to ~20
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert float(np.abs(sort[0]).max()) > 0.1


def largest_hlo_array(layer: MoEFeedForward, x: jax.Array) -> int:
    """Returns the element count of the largest array in the optimized HLO of the layer's forward and backward."""
    graphdef, params = nnx.split(layer)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x)[0])

    text = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
    shapes = re.findall(r"\b(?:f32|s32|pred|u32|f16|bf16)\[([\d,]+)\]", text)
    return max(int(np.prod([int(d) for d in shape.split(",")])) for shape in shapes)


def test_sort_dispatch_has_no_token_by_slot_tensor():
    # 4 groups x 64 tokens, 16 experts x 16 slots: the one-hot [g, s, e, c] is 65,536 elements, 8x the
    # next largest array (the expert weights, 16 x 16 x 16 = 4,096; the slots' hidden [e, g, c, mlp] 16,384)
    experts, top_k, factor = 16, 2, 2.0
    x = jax.random.normal(jax.random.key(7), (4, 64, 16), jnp.float32)
    capacity = expert_capacity(64, experts, top_k, factor)
    one_hot_size = 4 * 64 * experts * capacity
    assert largest_hlo_array(layer_with("einsum", top_k, factor, experts, mlp=16), x) >= one_hot_size
    assert largest_hlo_array(layer_with("sort", top_k, factor, experts, mlp=16), x) <= one_hot_size // 4
