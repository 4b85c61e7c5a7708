"""GShard MoE: routing against a per-token reference, losses by hand, equivalence
to one device on expert meshes, all-to-all layout, config errors, FLOPs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nestor.models.moe import (MoEFeedForward, MoELayerConfig, expert_capacity, load_balancing_loss, moe_losses, route,
                               router_z_loss)
from nestor.models.transformer import TransformerConfig, moe_feed_forward
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.commands.explain import compile_step, param_table
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.specs.lm_flops import matmul_params_per_token
from nestor.parallel.hlo import collectives
from tests.settings import TINY
from tests.helpers import ONE_DEVICE, assert_same_training, mesh_overrides, run_fresh

EXPERTS = 4
MOE = ("moe.num_experts=4", "moe.every=2")
DEEPSEEK_STYLE = ("moe.num_experts=8", "moe.top_k=4", "moe.expert_mlp_dim=32", "moe.shared_experts=1", "moe.router=sigmoid")


def moe_layer(top_k: int, capacity_factor: float, groups_of: int = 0, eval_capacity_factor: float = 2.0):
    moe = MoELayerConfig(num_experts=EXPERTS, every=1, top_k=top_k, capacity_factor=capacity_factor,
                         eval_capacity_factor=eval_capacity_factor, group_size=groups_of, dispatch="einsum")
    cfg = TransformerConfig(vocab_size=8, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                            mlp_dim=24, init_std=0.5, moe=moe)
    return moe_feed_forward(cfg, nnx.Rngs(params=3))


def expert_output(layer: MoEFeedForward, expert: int, x: jax.Array) -> jax.Array:
    """One expert's SwiGLU on tokens x [n, embed], computed directly from its weights."""
    gate, up, down = layer.gate[...][expert], layer.up[...][expert], layer.down[...][expert]
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def reference_output(layer: MoEFeedForward, x: jax.Array, top_k: int, router: str = "softmax") -> jax.Array:
    """For each token: its top-k experts run directly, outputs summed with their (renormalised) gates,
    plus the shared experts' SwiGLU when the layer has them."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ layer.router[...]
    scores = jax.nn.sigmoid(logits) if router == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(scores, top_k)
    if top_k > 1:
        gates = gates / gates.sum(-1, keepdims=True)
    outputs = jnp.stack([expert_output(layer, e, tokens) for e in range(layer.gate.shape[0])])  # [experts, tokens, embed]
    picked = outputs[experts, jnp.arange(tokens.shape[0])[:, None]]  # [tokens, k, embed]
    routed = jnp.einsum("tk,tkd->td", gates, picked)
    if layer.shared_experts is not None:
        shared = layer.shared_experts
        routed = routed + (jax.nn.silu(tokens @ shared.gate[...]) * (tokens @ shared.up[...])) @ shared.down[...]
    return routed.reshape(x.shape)


def tokens(batch=2, length=8, dim=16):
    return jax.random.normal(jax.random.key(7), (batch, length, dim), jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_output_equals_per_token_reference_when_nothing_drops(top_k):
    layer = moe_layer(top_k, capacity_factor=EXPERTS / top_k)  # capacity = tokens per group
    x = tokens()
    output, stats = layer(x)
    np.testing.assert_allclose(output, reference_output(layer, x, top_k), rtol=1e-5, atol=1e-5)
    assert float(stats["moe_dropped_fraction"]) == 0.0
    assert float(stats["moe_tokens_per_expert"].sum()) == top_k * x.shape[0] * x.shape[1]


FINE_GRAINED = {"sigmoid_top2_shared1": ("sigmoid", 2, 1), "softmax_top8_shared2": ("softmax", 8, 2),
                "sigmoid_top8": ("sigmoid", 8, 0), "sigmoid_top1": ("sigmoid", 1, 0)}


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["sort", "einsum"])
@pytest.mark.parametrize("case", FINE_GRAINED, ids=list(FINE_GRAINED))
def test_fine_grained_shared_and_sigmoid_experts_equal_per_token_reference(case, dispatch):
    router, top_k, shared = FINE_GRAINED[case]
    experts, expert_width = 8, 8  # fine-grained: a third of the model's mlp_dim=24
    moe = MoELayerConfig(num_experts=experts, every=1, top_k=top_k, capacity_factor=experts / top_k, router=router,
                         expert_mlp_dim=expert_width, shared_experts=shared, dispatch=dispatch)
    cfg = TransformerConfig(vocab_size=8, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                            mlp_dim=24, init_std=0.5, moe=moe)
    layer = moe_feed_forward(cfg, nnx.Rngs(params=3))
    assert layer.gate.shape == (experts, 16, expert_width)
    assert (layer.shared_experts.gate.shape[1] if shared else 0) == shared * expert_width
    x = tokens()
    output, stats = layer(x)
    np.testing.assert_allclose(output, reference_output(layer, x, top_k, router), rtol=1e-5, atol=1e-5)
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


def test_eval_uses_the_eval_capacity_factor():
    layer = moe_layer(2, capacity_factor=0.01, eval_capacity_factor=EXPERTS / 2)
    x = tokens()
    _, train_stats = layer(x, train=True)
    eval_output, eval_stats = layer(x, train=False)
    assert float(train_stats["moe_dropped_fraction"]) > 0.5
    assert float(eval_stats["moe_dropped_fraction"]) == 0.0
    np.testing.assert_allclose(eval_output, reference_output(layer, x, 2), rtol=1e-5, atol=1e-5)


def test_top2_capacity_one_keeps_one_slot_per_chosen_expert():
    logits = jnp.log(jnp.array([[[0.5, 0.3, 0.1, 0.1], [0.6, 0.1, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]]))
    routing = route(logits, top_k=2, capacity=1)
    # first choices: 0, 0, 3 -> slots of experts 0 and 3; second choices 1, 2, 2 -> experts 1, 2 take one each
    np.testing.assert_array_equal(routing.dispatch[0, :, :, 0], [[1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    np.testing.assert_allclose(float(routing.stats["moe_dropped_fraction"]), 2 / 6, rtol=1e-6)
    np.testing.assert_allclose(routing.combine[0, 0, :, 0], [0.5 / 0.8, 0.3 / 0.8, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(routing.stats["moe_tokens_per_expert"], [2, 1, 2, 1])


def test_random_policy_keeps_the_second_expert_with_probability_twice_its_gate():
    # probabilities (0.5, 0.25, 0.15, 0.1): renormalised g2 = 0.25 / 0.75, kept with probability 2 * g2 = 2/3
    logits = jnp.broadcast_to(jnp.log(jnp.array([0.5, 0.25, 0.15, 0.1])), (8, 512, EXPERTS))
    routing = route(logits, top_k=2, capacity=512, routing_key=jax.random.key(0))
    second_expert_share = float(routing.stats["moe_tokens_per_expert"][1]) / (8 * 512)
    assert second_expert_share == pytest.approx(2 / 3, abs=0.02)
    assert float(routing.stats["moe_tokens_per_expert"][0]) == 8 * 512


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
    loss, metrics = moe_losses(stats, MoELayerConfig(aux_loss_weight=0.01, z_loss_weight=0.001))
    assert float(loss) == pytest.approx(2 * 0.01 + 6 * 0.001)
    assert {k: float(v) for k, v in metrics.items() if v.ndim == 0} == pytest.approx(
        {"moe_aux_loss": 1.0, "moe_z_loss": 3.0, "moe_dropped_fraction": 0.25})
    np.testing.assert_allclose(metrics["moe_expert_load"], np.full((2, EXPERTS), 1 / EXPERTS))


MESHES = {
    "expert4_data2": dict(expert=4, data=2),
    "expert2_tensor2_data2": dict(expert=2, tensor=2, data=2),
    "expert2_fsdp2_pipeline2": dict(expert=2, fsdp=2, pipeline=2),  # MoE inside the pipeline
}


@pytest.fixture(scope="module")
def one_device_runs(tmp_path_factory):
    """Returns make(*overrides) -> Config and a cache of one-device results by MoE overrides."""
    from nestor.orchestrator.loader import config as config_lib

    def make(*overrides):
        base = [*TINY, "model.num_kv_heads=4", *MOE,
                "moe.dispatch=einsum",  # GShard's reference, unless a test picks another dispatch
                f"run.dir={tmp_path_factory.mktemp('run')}"]
        return config_lib.load(None, base + list(overrides))

    cache = {}

    def reference(*overrides):
        if overrides not in cache:
            cache[overrides] = run_fresh(make(*overrides).replace(**ONE_DEVICE))
        return cache[overrides]

    return make, reference


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("mesh", MESHES, ids=list(MESHES))
def test_losses_and_params_match_one_device(one_device_runs, mesh, top_k):
    make, reference = one_device_runs
    overrides = (f"moe.top_k={top_k}",)
    pipelined = ("pipeline.microbatches=2",) if MESHES[mesh].get("pipeline") else ()
    result = run_fresh(make(*overrides, *pipelined).replace(**mesh_overrides(**MESHES[mesh])))
    assert_same_training(result, reference(*overrides))
    assert 0.0 < result.history[-1]["moe_dropped_fraction"] < 0.5  # capacity 1.25 does drop a few
    assert np.sum(result.history[-1]["moe_expert_load"], axis=1) == pytest.approx([1.0] * 2)


@pytest.mark.slow
def test_1f1b_carries_the_moe_losses_through_its_handwritten_backward(one_device_runs):
    make, reference = one_device_runs
    overrides = ("moe.top_k=2",)
    result = run_fresh(make(*overrides, "pipeline.microbatches=2", "pipeline.schedule=1f1b").replace(
        **mesh_overrides(**MESHES["expert2_fsdp2_pipeline2"])))
    assert_same_training(result, reference(*overrides))
    assert 0.0 < result.history[-1]["moe_dropped_fraction"] < 0.5


SORTED = ("moe.dispatch=sort",)


@pytest.mark.slow
# With Adam's default eps (1e-8) the shared/sigmoid experts on expert2_fsdp2_pipeline2 moved one embedding
# entry 1.7e-4 (einsum) / 2.2e-4 (sort) from one device in 5 steps; at TINY's 1e-6 (COMPARABLE_ADAM), 1.0e-6.
@pytest.mark.parametrize("mesh, overrides", [("expert4_data2", SORTED), ("expert2_tensor2_data2", SORTED + DEEPSEEK_STYLE),
                                             ("expert2_fsdp2_pipeline2", SORTED + DEEPSEEK_STYLE)],
                         ids=["expert4_data2_sort", "expert2_tensor2_data2_sort_shared_sigmoid",
                              "expert2_fsdp2_pipeline2_sort_shared_sigmoid"])
def test_sort_dispatch_and_shared_sigmoid_experts_match_one_device(one_device_runs, mesh, overrides):
    make, reference = one_device_runs
    pipelined = ("pipeline.microbatches=2",) if MESHES[mesh].get("pipeline") else ()
    result = run_fresh(make(*overrides, *pipelined).replace(**mesh_overrides(**MESHES[mesh])))
    assert_same_training(result, reference(*overrides))
    assert 0.0 < result.history[-1]["moe_dropped_fraction"] < 0.5
    assert np.sum(result.history[-1]["moe_expert_load"], axis=1) == pytest.approx([1.0] * 2)


DROPLESS_SHARED_SIGMOID = ("moe.capacity_factor=0", *DEEPSEEK_STYLE)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["expert4_data2", "expert2_tensor2_data2"])
def test_dropless_experts_match_one_device(one_device_runs, mesh):
    make, reference = one_device_runs
    result = run_fresh(make(*DROPLESS_SHARED_SIGMOID).replace(**mesh_overrides(**MESHES[mesh])))
    assert_same_training(result, reference(*DROPLESS_SHARED_SIGMOID))
    assert result.history[-1]["moe_dropped_fraction"] == 0.0
    assert np.sum(result.history[-1]["moe_expert_load"], axis=1) == pytest.approx([1.0] * 2)


@pytest.fixture(scope="module")
def deepseek_one_device(tmp_path_factory):
    """Returns (config, its one-device run) of the DeepSeek-style preset: first dense layer, shared and
    fine-grained experts, dropless, auxiliary-loss-free bias."""
    from nestor.orchestrator.loader import config as config_lib

    config = config_lib.load(None, [*TINY, "model.preset=deepseek-tiny", "pipeline.microbatches=2",
                                    f"run.dir={tmp_path_factory.mktemp('deepseek')}"])
    return config, run_fresh(config.replace(**ONE_DEVICE))


@pytest.mark.slow
@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)])
def test_deepseek_style_preset_matches_one_device_on_expert_fsdp_pipeline(deepseek_one_device, schedule, repeats):
    # 1F1B (and zero-bubble) runs the first dense layers with the embedding at the first stage, in its own
    # backward pass
    config, reference = deepseek_one_device
    result = run_fresh(config.replace(**mesh_overrides(expert=2, fsdp=2, pipeline=2),
                                      **{"pipeline.schedule": schedule, "pipeline.repeats": repeats}))
    assert_same_training(result, reference)
    assert result.history[-1]["moe_dropped_fraction"] == 0.0
    bias = [np.asarray(jax.tree.leaves(run.state["expert_bias"])[0]) for run in (result, reference)]
    assert bias[0].shape == (4, 16) and np.any(bias[0] != 0)
    np.testing.assert_array_equal(*bias)  # the same loads moved the same biases


@pytest.mark.slow
def test_random_second_expert_routing_is_the_same_on_every_mesh(one_device_runs):
    make, reference = one_device_runs
    overrides = ("moe.second_expert_policy=random",)
    result = run_fresh(make(*overrides).replace(**mesh_overrides(expert=4, data=2)))
    assert_same_training(result, reference(*overrides))
    # the share of second choices GShard's policy keeps is tested on the router itself
    assert np.sum(result.history[-1]["moe_expert_load"], axis=1) == pytest.approx([1.0] * 2)


def test_each_accumulated_micro_batch_draws_its_own_routing_noise():
    from nestor.orchestrator.job.step import _accumulated_grads

    def loss_fn(params, batch, key):  # the "metric" is the noise this micro-batch drew
        return jnp.sum(params["w"] * batch["tokens"]), {"draw": jax.random.uniform(key)}

    key, batch = jax.random.key(3), {"tokens": jnp.ones((4, 3))}
    _, metrics = _accumulated_grads(jax.value_and_grad(loss_fn, has_aux=True), {"w": jnp.ones(())}, batch, key, 2,
                                    lambda micro: micro)
    draws = [jax.random.uniform(jax.random.fold_in(key, i)) for i in range(2)]
    assert draws[0] != draws[1]
    np.testing.assert_allclose(metrics["draw"], np.mean(draws), rtol=1e-6)


def compiled_text(config) -> str:
    return compile_step(build_job(config)).as_text()


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["sort", "einsum"])
def test_tokens_move_by_all_to_all_and_are_never_gathered(tiny_config, capfd, dispatch):
    # without remat, which would run the forward's all-to-alls again in the backward pass
    config = tiny_config(*MOE, f"moe.dispatch={dispatch}", "model.remat=none").replace(
        **mesh_overrides(expert=4, data=2))
    found = collectives(compiled_text(config))
    capacity = expert_capacity(32, EXPERTS, 2, 1.25)
    slots_per_device_bytes = EXPERTS * 16 * capacity * 64 * 4 // 8  # [experts, groups, capacity, embed] f32
    # 2 MoE layers x (dispatch + combine) x (forward + backward)
    assert found["all-to-all"] == {"count": 8, "bytes": 8 * slots_per_device_bytes}
    assert found["all-gather"]["count"] == 0
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("mesh, experts", [(dict(expert=2, tensor=2, data=2), ()), (dict(expert=2, fsdp=2, tensor=2), ()),
                                           (dict(expert=2, tensor=2, data=2), DEEPSEEK_STYLE)],
                         ids=["expert2_tensor2_data2", "expert2_fsdp2_tensor2", "expert2_tensor2_data2_shared_sigmoid"])
def test_expert_weights_are_split_over_every_sharded_axis(tiny_config, capfd, mesh, experts):
    config = tiny_config(*MOE, *experts).replace(**mesh_overrides(**mesh))
    job = build_job(config)
    assert collectives(compile_step(job).as_text())["all-to-all"]["count"] > 0
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    expert_rows = [row for row in param_table(job.layout) if "expert" in row["logical_axes"]]
    assert len(expert_rows) == 3
    shards = mesh["expert"] * mesh.get("fsdp", 1) * mesh["tensor"]  # expert x embed (fsdp) x mlp (tensor)
    for row in expert_rows:
        assert row["bytes_per_device"] <= 1.10 * row["bytes_total"] / shards, row["name"]


@pytest.mark.parametrize("overrides, key", [
    (("moe.num_experts=6", "moe.every=2", "mesh.expert=4", "mesh.data=2"), "moe.num_experts"),
    (("moe.num_experts=4", "moe.every=2", "moe.top_k=5"), "moe.top_k"),
    (("moe.num_experts=4", "moe.every=2", "moe.capacity_factor=-1"), "moe.capacity_factor"),
    (("moe.num_experts=4", "moe.every=2", "moe.eval_capacity_factor=-1"), "moe.eval_capacity_factor"),
    (("moe.num_experts=4", "moe.every=2", "moe.group_size=48", "mesh.data=8"), "moe.group_size"),
    (("moe.num_experts=4", "moe.every=3"), "moe.every"),
    (("moe.num_experts=4", "moe.every=0"), "moe.every"),
    (("moe.num_experts=4", "moe.every=2", "moe.dispatch=scatter"), "moe.dispatch"),
    (("moe.num_experts=4", "moe.every=2", "moe.router=relu"), "moe.router"),
    (("moe.num_experts=4", "moe.every=2", "moe.shared_experts=-1"), "moe.shared_experts"),
    (("moe.num_experts=4", "moe.every=2", "moe.expert_mlp_dim=33", "mesh.tensor=2", "mesh.data=4"),
     "moe.expert_mlp_dim"),
    (("moe.num_experts=0", "moe.every=2"), "moe.every"),
], ids=["experts_vs_mesh", "top_k", "capacity", "eval_capacity", "group_size", "every_vs_layers",
        "experts_without_every", "dispatch", "router", "shared_experts", "expert_mlp_dim_vs_tensor",
        "every_without_experts"])
def test_invalid_moe_config_names_its_key(tiny_config, overrides, key):
    with pytest.raises(ConfigError) as error:
        tiny_config(*overrides)
    assert key in [problem_key for problem_key, _ in error.value.problems]


def test_flops_count_router_and_top_k_experts_only(tiny_config):
    dense = matmul_params_per_token(tiny_config())
    moe = matmul_params_per_token(tiny_config(*MOE, "moe.top_k=2"))
    feed_forward = 3 * 64 * 128
    moe_layers = 4 // 2
    assert moe - dense == moe_layers * (feed_forward + 64 * EXPERTS)  # one more active expert, plus the router


def test_flops_count_fine_grained_and_shared_experts(tiny_config):
    dense = matmul_params_per_token(tiny_config())
    moe = matmul_params_per_token(tiny_config(*MOE, *DEEPSEEK_STYLE))
    # per MoE layer: 4 routed + 1 shared experts 32 wide replace one 128-wide feed-forward; plus the 8-expert router
    assert moe - dense == 2 * (5 * 3 * 64 * 32 - 3 * 64 * 128 + 64 * 8)


def test_pipeline_stages_split_units_of_moe_every_layers():
    from nestor.orchestrator.loader import config as config_lib
    from nestor.orchestrator.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        config_lib.load(None, ["model.preset=tiny", *MOE, "mesh.pipeline=4", "mesh.data=2", "pipeline.microbatches=4"])
    assert [key for key, _ in caught.value.problems] == ["model.num_layers"]
    assert "moe.every=2" in caught.value.problems[0][1]


def test_group_size_must_divide_a_pipeline_micro_batch_per_device():
    from nestor.orchestrator.loader import config as config_lib
    from nestor.orchestrator.errors import ConfigError

    # 16 x 32 tokens, 4 micro-batches, 4 batch shards: 32 tokens per device per micro-batch.
    base = ["model.preset=tiny", *MOE, "train.seq_len=32", "mesh.pipeline=2", "mesh.data=4",
            "pipeline.microbatches=4"]
    config_lib.load(None, base + ["moe.group_size=32"])
    with pytest.raises(ConfigError) as caught:
        config_lib.load(None, base + ["moe.group_size=64"])
    assert [key for key, _ in caught.value.problems] == ["moe.group_size"]
