"""Context parallelism (parallel.context): a row's positions split over `mesh.context`, balanced under the causal
mask, packed documents kept apart; training on such meshes matches one device, and a long sequence's memory
falls with the context degree."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nestor.models import ops
from nestor.models.axes import activation_sharding
from nestor.models.transformer import Transformer, TransformerConfig
from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.job.context_wiring import ATTENTION_AXES
from nestor.orchestrator.data.batches import DataPipeline, document_ids
from nestor.orchestrator.data.separator import BYTES_SEPARATOR as DOCUMENT_SEPARATOR
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.commands.explain import explain, format_report
from nestor.orchestrator.job.build import make_mesh
from nestor.orchestrator.loader.memory_fit import GIB
from nestor.orchestrator.job.step import backend_for
from nestor.orchestrator.loader.validation import validate
from nestor.parallel import context
from nestor.parallel.context import SequenceLayout, context_attention
from nestor.parallel.hlo import collectives, conditional_branch_ops
from nestor.parallel.mesh import build_mesh
from nestor.parallel.pipeline import BUFFERED, PER_STAGE_SKIPPING
from nestor.parallel.rules import MESH_AXES, activation_constrainer, resolve_rules
from tests.settings import TINY
from tests.helpers import ONE_DEVICE, assert_same_training, mesh_overrides, run_fresh
from tests.test_cli import nestor

STRATEGIES = context.STRATEGIES
RULES = resolve_rules()


def mesh_of(**degrees):
    return build_mesh({axis: 1 for axis in MESH_AXES} | degrees)


def test_a_balanced_layout_gives_every_device_an_early_and_a_late_chunk():
    layout = SequenceLayout(4)
    positions = layout.positions(16)  # 8 chunks of 2 places
    assert positions.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    rows = np.arange(48).reshape(3, 16)
    np.testing.assert_array_equal(layout.arrange(rows), rows[:, positions])
    np.testing.assert_array_equal(np.asarray(layout.arrange(jnp.asarray(rows))), rows[:, positions])
    np.testing.assert_array_equal(SequenceLayout(4, balanced=False).positions(16), np.arange(16))


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
def test_a_skipped_chunk_pair_is_exactly_one_the_causal_mask_hides_entirely(balanced):
    layout = SequenceLayout(4, balanced)
    positions = layout.positions(32).reshape(4, 2, 4)  # [device, chunk, place]
    for device in range(4):
        for q, query_chunk in enumerate(layout.device_chunks(device)):
            for other in range(4):
                for k, key_chunk in enumerate(layout.device_chunks(other)):
                    visible = (positions[device, q][:, None] >= positions[other, k][None, :]).any()
                    assert visible == (key_chunk <= query_chunk)


@pytest.mark.slow
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_context_attention_and_its_gradients_equal_one_devices_within_documents(strategy, balanced, monkeypatch):
    monkeypatch.setattr(context, "QUERY_BLOCK", 2)  # several query blocks per chunk pair
    mesh = mesh_of(data=2, context=2, tensor=2)
    layout = SequenceLayout(2, balanced)
    attention = context_attention(strategy, mesh, RULES, ATTENTION_AXES, layout)
    batch, length, heads, kv_heads, head_dim = 2, 16, 4, 2, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (batch, length, h, head_dim))
               for i, h in enumerate((heads, kv_heads, kv_heads)))
    segments = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], [5, 6, 5], axis=1))  # documents across chunks

    def one_device(q, k, v):
        mask = (segments[:, :, None] == segments[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)

    def split(q, k, v):
        arranged = [layout.arrange(x) for x in (q, k, v, segments)]
        return attention(*arranged, layout.positions(length))

    order = layout.positions(length)
    np.testing.assert_allclose(jax.jit(split)(q, k, v), one_device(q, k, v)[:, order], rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda *x: (f(*x) ** 2).sum()  # noqa: E731
    got = jax.jit(jax.grad(loss(split), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(one_device), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_positions_not_of_the_installed_layout_are_refused():
    attention = context_attention("ring", mesh_of(context=8), RULES, ATTENTION_AXES, SequenceLayout(8))
    q = jnp.zeros((1, 32, 2, 4))
    with pytest.raises(ValueError, match="not those of the installed sequence layout"):
        attention(q, q, q, None, np.arange(32))


@pytest.mark.slow
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_pair_the_causal_mask_hides_is_never_computed(strategy, balanced):
    # NaN values in the last chunk: a query chunk that computed a pair with it would turn NaN (0 x NaN), so
    # every query chunk but the last staying finite shows the program skips those pairs
    layout = SequenceLayout(4, balanced)
    attention = context_attention(strategy, mesh_of(data=2, context=4), RULES, ATTENTION_AXES, layout)
    length, chunk = 64, 8
    values = np.ones((2, length, 2, 16), np.float32)
    values[:, -chunk:] = np.nan
    q = jax.random.normal(jax.random.key(0), (2, length, 2, 16))
    arranged = [layout.arrange(jnp.asarray(x)) for x in (q, q, values)]
    out = jax.jit(lambda *x: attention(*x, None, layout.positions(length)))(*arranged)
    natural = np.asarray(out)[:, np.argsort(layout.positions(length))]
    assert np.isfinite(natural[:, :-chunk]).all() and np.isnan(natural[:, -chunk:]).all()


def compiled_attention(strategy: str, layout: SequenceLayout, length: int = 64):
    mesh = mesh_of(data=2, context=layout.context)
    attention = context_attention(strategy, mesh, RULES, ATTENTION_AXES, layout)
    shape = jax.ShapeDtypeStruct((2, length, 2, 16), jnp.float32)
    segments = jax.ShapeDtypeStruct((2, length), jnp.int32)
    positions = layout.positions(length)
    return jax.jit(lambda q, k, v, s: attention(q, k, v, s, positions)).lower(shape, shape, shape, segments).compile()


def pair_flops(chunk: int) -> float:
    """XLA's FLOPs for one (query chunk, key chunk) pair: the work a device does for every pair it computes."""
    q = jax.ShapeDtypeStruct((2, chunk, 2, 1, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, chunk, 2, 16), jnp.float32)
    segments = jax.ShapeDtypeStruct((2, chunk), jnp.int32)
    state = (jax.ShapeDtypeStruct((2, chunk, 2, 1, 16), jnp.float32),) + (
        jax.ShapeDtypeStruct((2, chunk, 2, 1), jnp.float32),) * 2
    compiled = jax.jit(context._attend_chunk).lower(state, q, 1, segments, kv, kv, 0, segments).compile()
    return compiled.cost_analysis()["flops"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_balanced_chunks_give_every_device_the_same_attention_flops_and_contiguous_ones_do_not(strategy):
    per_device = {}
    for balanced in (True, False):
        layout = SequenceLayout(4, balanced)
        text = compiled_attention(strategy, layout).as_text()
        # each pair's work sits in a conditional's branch: a device pays only for the pairs it computes (4 per
        # step: the loop's body, and for the ring its last step, outside the loop without a send)
        branches = conditional_branch_ops(text, "dot")
        assert len(branches) == {"all_gather": 4, "ring": 8}[strategy]
        assert all(sorted(counts) == [0, 2] for counts in branches)
        flops = pair_flops(64 // 8)
        per_device[balanced] = [layout.visible_pairs(d) * flops for d in range(4)]
    assert max(per_device[True]) <= 1.10 * min(per_device[True])
    assert max(per_device[False]) >= 4 * min(per_device[False])  # 15 pairs on the last device, 3 on the first
    assert sum(per_device[True]) == sum(per_device[False])  # the same work, shared evenly


def test_each_strategy_receives_the_exchange_bytes_explain_reports():
    layout = SequenceLayout(4)
    ring, gathered = (collectives(compiled_attention(s, layout).as_text()) for s in ("ring", "all_gather"))
    # [2 rows over data2, 64 places, 2 kv heads, 16] float32 keys and values and int32 segment ids
    received = context.exchange_bytes(layout, 1, 64, 2, 16, 4)
    assert ring["all-gather"]["count"] == 0 and ring["collective-permute"]["bytes"] == received  # 3 steps of 3 sends
    assert ring["collective-permute"]["count"] == 3 * 3
    assert gathered["collective-permute"]["count"] == 0 and gathered["all-gather"]["count"] == 3  # once each
    assert gathered["all-gather"]["bytes"] * 3 / 4 == received  # the gathered whole, less this device's share


def two_documents(first_seed: int) -> np.ndarray:
    """Rows of 32 tokens: a first document of 9 tokens, its separator at position 9 (inside the chunk of
    positions 8-11), then a second document (that never changes)."""
    rng = np.random.default_rng(first_seed)
    first = rng.integers(1, 64, (2, 9))
    second = np.random.default_rng(100).integers(1, 64, (2, 22))
    return np.concatenate([first, np.full((2, 1), DOCUMENT_SEPARATOR), second], axis=1).astype(np.int32)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_documents_logits_do_not_see_another_documents_tokens_on_four_context_devices(strategy):
    cfg = TransformerConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                            mlp_dim=64, init_std=0.2)
    model = Transformer(cfg, nnx.Rngs(params=0))
    mesh = mesh_of(context=4, data=2)
    layout = SequenceLayout(4)
    installed = dataclasses.replace(ops.PLAIN, context_attention=context_attention(
        strategy, mesh, RULES, ATTENTION_AXES, layout))
    order = np.argsort(layout.positions(32))

    @jax.jit
    def split_logits(tokens):
        with activation_sharding(activation_constrainer(mesh, RULES), layout), ops.installed(installed):
            logits, _ = model(layout.arrange(tokens), segment_ids=layout.arrange(document_ids(tokens, DOCUMENT_SEPARATOR)))
        return logits[:, order]  # back in the sequence's order

    logits = [split_logits(two_documents(seed)) for seed in (1, 2)]
    np.testing.assert_allclose(logits[0], model(jnp.asarray(two_documents(1)),
                                                segment_ids=document_ids(jnp.asarray(two_documents(1)), DOCUMENT_SEPARATOR))[0],
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits[0][:, :9], logits[1][:, :9])  # the first document changed
    np.testing.assert_allclose(logits[0][:, 10:], logits[1][:, 10:], rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """Returns the glob of 400 text files of 4 to 30 bytes: most rows of 33 tokens pack two or more."""
    directory = tmp_path_factory.mktemp("documents")
    rng = np.random.default_rng(0)
    words = ["attention", "ring", "chunk", "device", "token", "mask", "of", "a", "the", "sequence"]
    for index in range(400):
        text = " ".join(rng.choice(words, 8))[:rng.integers(4, 31)]
        (directory / f"{index:03d}.txt").write_text(text)
    return str(directory / "*.txt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, short_documents):
    def make(*overrides):
        return config_lib.load(None, [*TINY, "model.num_kv_heads=4", "data.source=text",
                                      f"data.paths=[{short_documents}]", f"run.dir={tmp_path_factory.mktemp('run')}",
                                      *overrides])

    return make, run_fresh(make().replace(**ONE_DEVICE))


def test_the_reference_rows_pack_several_documents(reference):
    make, _ = reference
    config = make()
    batch = DataPipeline(config, make_mesh(config), resolve_rules()).batch(0)
    assert config.data.document_mask and (np.asarray(batch["segment_ids"]).max(axis=1) > 0).all()


CONTEXT_MESHES = {"context2_fsdp2_tensor2": dict(context=2, fsdp=2, tensor=2),
                  "context4_data2": dict(context=4, data=2)}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", CONTEXT_MESHES, ids=list(CONTEXT_MESHES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_with_split_rows_matches_one_device(reference, strategy, mesh):
    make, one_device = reference
    config = make(f"model.context_attention={strategy}").replace(**mesh_overrides(**CONTEXT_MESHES[mesh]))
    assert_same_training(run_fresh(config), one_device)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_accumulation_with_split_rows_matches_one_big_batch(reference, strategy):
    make, one_device = reference
    config = make(f"model.context_attention={strategy}", "train.grad_accum=2").replace(
        **mesh_overrides(context=2, data=2, tensor=2))
    assert_same_training(run_fresh(config), one_device)


MOE = ("model.num_layers=4", "moe.num_experts=4", "moe.every=2")
ROUTING = {"dropless": ("moe.capacity_factor=0",), "capacity": ("moe.group_size=8",)}  # chunks of 8 on context 2


@pytest.fixture(scope="module")
def moe_reference(reference):
    make, _ = reference
    runs = {}

    def one_device(routing: str):
        if routing not in runs:
            runs[routing] = run_fresh(make(*MOE, *ROUTING[routing]).replace(**ONE_DEVICE))
        return runs[routing]

    return one_device


@pytest.mark.slow
@pytest.mark.parametrize("strategy, schedule, routing", [
    ("all_gather", "1f1b", "dropless"), ("ring", "1f1b", "dropless"), ("all_gather", "gpipe", "capacity")])
def test_pipelined_moe_with_split_rows_matches_one_device(reference, moe_reference, strategy, schedule, routing):
    make, _ = reference
    config = make(*MOE, *ROUTING[routing], f"model.context_attention={strategy}", f"pipeline.schedule={schedule}",
                  "pipeline.microbatches=4").replace(**mesh_overrides(context=2, pipeline=2, expert=2))
    assert_same_training(run_fresh(config), moe_reference(routing))


def test_on_cpu_split_rows_keep_every_pipeline_stage_in_one_program(tiny_config):
    # XLA:CPU's collective-permute meets every device: a stage skipping its bubble would leave the others waiting
    loops = {(context, strategy): backend_for(config, make_mesh(config)).pipeline_loop
             for context in (1, 2) for strategy in STRATEGIES
             for config in [tiny_config(f"mesh.context={context}", "mesh.pipeline=2", f"mesh.data={4 // context}",
                                        f"model.context_attention={strategy}")]}
    assert loops == {(1, "all_gather"): PER_STAGE_SKIPPING, (1, "ring"): PER_STAGE_SKIPPING,
                     (2, "all_gather"): BUFFERED, (2, "ring"): BUFFERED}


LONG = ("model.preset=tiny", "train.seq_len=4096", "train.global_batch=1", "model.remat=full", "data.source=synthetic",
        "mesh.data=1", "run.compile_cache=null")


@pytest.mark.slow
def test_temporaries_per_device_fall_as_one_over_the_context_degree_and_explain_says_how_rows_split():
    temporaries = {}
    for degree in (1, 2, 4, 8):
        config = config_lib.load(None, [*LONG, f"mesh.context={degree}", f"cluster.devices_per_host={degree}"])
        report = explain(config)
        temporaries[degree] = report["memory_per_device_bytes"]["temporaries"]
        if degree == 1:
            assert report["context"] is None
            continue
        assert report["context"] == {
            "devices": degree, "attention": "all_gather", "layout": "balanced", "positions_per_device": 4096 // degree,
            "pairs_per_device": [2 * degree + 1] * degree,
            # keys and values [1 row, 4096 / degree, 2 kv heads, 16] float32 and int32 segment ids, from every
            # other device
            "exchange_bytes_per_layer": (degree - 1) * (4096 // degree) * (2 * 2 * 16 * 4 + 4)}
        assert (f"context: rows split over {degree} devices (balanced, {4096 // degree:,} positions each), attention "
                "all_gather") in format_report(report)
    for degree in (2, 4, 8):
        assert temporaries[degree] <= 1.3 * temporaries[1] / degree, temporaries


LLAMA_128K = ("configs/quickstart.yaml", "model.preset=llama3-8b", "train.seq_len=131072", "model.dtype=bfloat16",
              "model.remat=full", "mesh.data=1", "mesh.pipeline=1", "mesh.expert=1", "mesh.tensor=1",
              "moe.num_experts=0", "moe.every=0", "pipeline.microbatches=1", "cluster.device_kind=h100",
              "cluster.hosts=8", "cluster.devices_per_host=8", "run.compile_cache=null", "--json")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_llama3_8b_at_128k_tokens_fits_an_h100_only_with_its_rows_split_over_context():
    split = nestor("explain", *LLAMA_128K, "mesh.context=8", "mesh.fsdp=8", "train.global_batch=8")
    assert split.returncode == 0, split.stderr[-3000:]
    report = json.loads(split.stdout)
    assert report["context"]["devices"] == 8 and report["context"]["positions_per_device"] == 16384
    assert report["fit"]["fits"] and report["fit"]["total_bytes"] < 80 * GIB
    whole = nestor("explain", *LLAMA_128K, "mesh.context=1", "mesh.fsdp=64", "train.global_batch=64")
    assert whole.returncode == 0, whole.stderr[-3000:]
    fit = json.loads(whole.stdout)["fit"]
    assert not fit["fits"] and fit["verdict"].startswith("does not fit")


@pytest.mark.parametrize("overrides, key", [
    (("mesh.context=4", "mesh.data=2", "train.seq_len=36"), "train.seq_len"),
    (("mesh.context=2", "mesh.data=4", "model.attention=cudnn", "model.dtype=bfloat16",
      "cluster.device_kind=h100"), "model.attention"),
    (("mesh.context=2", "mesh.data=4", "moe.num_experts=4", "moe.every=2", "moe.group_size=6"), "moe.group_size"),
    (("mesh.context=2", "mesh.data=4", "moe.num_experts=4", "moe.every=2", "moe.group_size=8",
      "moe.second_expert_policy=random"), "moe.second_expert_policy"),
])
def test_a_row_split_the_run_cannot_take_is_a_config_error_naming_the_key(tiny_config, overrides, key):
    with pytest.raises(ConfigError) as caught:
        config = tiny_config(*overrides)
        backend_for(config, make_mesh(config))
    assert key in str(caught.value)


MOE_ON_CONTEXT = ("mesh.context=2", "mesh.data=4", "moe.num_experts=4", "moe.every=2")  # seq_len 32: chunks of 8


def test_an_unset_moe_group_size_on_context_devices_is_the_chunk_and_said(tiny_config):
    chosen = tiny_config(*MOE_ON_CONTEXT)
    assert chosen.moe.group_size == 8 and chosen.chosen == (
        "moe.group_size=8 chosen for mesh.context=2: the largest routing group that divides the 8-token chunk a "
        "device holds; set moe.group_size to choose another",)
    assert backend_for(chosen, make_mesh(chosen)).context_attention == "all_gather"
    assert validate(chosen) is chosen  # chosen once: a key set from then on
    for kept, size in ((("moe.group_size=4",), 4), (("moe.capacity_factor=0",), 0),
                         (("mesh.context=1", "mesh.data=8"), 0)):
        config = tiny_config(*MOE_ON_CONTEXT, *kept)  # set by the run, dropless (whole rows), or no context
        assert (config.moe.group_size, config.chosen) == (size, ())
    with pytest.raises(ConfigError) as caught:  # set by the run to what the chunk cannot take: refused as before
        tiny_config(*MOE_ON_CONTEXT, "moe.group_size=16")
    assert caught.value.problems == [("moe.group_size", "16 tokens per routing group: with rows split by "
                                      "mesh.context=2, a group is a divisor of the 8-token chunk a device holds, so "
                                      "that every mesh routes the same groups; use a divisor of 8, or 0 to let "
                                      "nestor choose")]


def test_the_quickstarts_moe_on_two_context_devices_trains_without_a_group_size_and_the_cli_says_it(tmp_path,
                                                                                                     capsys):
    from nestor.orchestrator.commands.cli import main

    quickstart = ("mesh.context=2", "mesh.tensor=1", f"run.dir={tmp_path / 'none'}")
    config = config_lib.load(config_lib.CONFIGS_DIR / "quickstart.yaml", list(quickstart))
    assert config.moe.group_size == 16  # seq_len 64 on context 2: chunks of 16, 64 tokens per device
    assert main(["eval", str(config_lib.CONFIGS_DIR / "quickstart.yaml"), *quickstart]) == 2  # nothing trained
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == f"nestor: {config.chosen[0]}" and "run.dir" in err and "chosen" not in out


@pytest.mark.parametrize("routing", [("moe.capacity_factor=0", "moe.group_size=0"), ("moe.capacity_factor=0",
                                     "moe.group_size=4"), ("moe.group_size=8",)], ids=["dropless rows", "dropless 4",
                                                                                    "capacity 8"])
def test_moe_groups_of_whole_rows_when_dropless_or_of_pieces_of_a_chunk_are_accepted(tiny_config, routing):
    # seq_len 32 on context 2: chunks of 8 tokens
    config = tiny_config("mesh.context=2", "mesh.data=4", "moe.num_experts=4", "moe.every=2", *routing)
    assert validate(config) is config and backend_for(config, make_mesh(config)).context_attention == "all_gather"
