"""LoRA: adapters laid out as the weights they adapt, a frozen base, and training on any mesh that matches
one device."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.evaluation.commands import logits_of
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.job.state import init_state
from nestor.orchestrator.loader import config as config_lib
from tests.settings import TINY
from tests.helpers import ONE_DEVICE, assert_same_training, equations, mesh_overrides, run, run_fresh

LORA = ("lora.rank=4", "lora.alpha=8", "optimizer.lr=1e-2")
MOE_DROPLESS = ("moe.num_experts=4", "moe.every=2", "moe.capacity_factor=0",
                "lora.targets=[query,value,gate,expert_gate,expert_up,expert_down]")


def load(run_dir, *overrides):
    return config_lib.load(None, [*TINY, "model.num_kv_heads=4", *LORA, f"run.dir={run_dir}", *overrides])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """Returns runs(*overrides) -> the one-device LoRA run of those overrides, trained once each."""
    cache = {}

    def runs(*overrides):
        if overrides not in cache:
            cache[overrides] = run_fresh(load(tmp_path_factory.mktemp("one"), *overrides).replace(**ONE_DEVICE))
        return cache[overrides]

    return runs


def flat(tree) -> dict:
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_adapters_take_their_weights_logical_names_and_only_they_have_optimizer_state(tmp_path):
    job = build_job(load(tmp_path).replace(**mesh_overrides(fsdp=4, tensor=2)), with_data=False)
    shardings = flat(job.layout.shardings["params"])
    spec = {name: tuple(sharding.spec) + (None,) * 4 for name, sharding in shardings.items()}
    # A [layers, in..., rank] and B [layers, rank, out...]: split as the weight's in and out dims, rank whole
    assert spec["blocks/attention/query"][:4] == ("pipeline", "fsdp", "tensor", None)
    assert spec["blocks/attention/query_lora/a"][:3] == ("pipeline", "fsdp", None)
    assert spec["blocks/attention/query_lora/b"][:4] == ("pipeline", None, "tensor", None)
    assert spec["blocks/attention/out_lora/a"][:4] == ("pipeline", "tensor", None, None)
    assert spec["blocks/attention/out_lora/b"][:3] == ("pipeline", None, "fsdp")
    assert spec["blocks/mlp/down_lora/a"][:3] == ("pipeline", "tensor", None)
    assert spec["blocks/mlp/down_lora/b"][:3] == ("pipeline", None, "fsdp")
    trained = set(flat(job.layout.trained_part(job.layout.shardings["params"])))
    assert trained == {name for name in shardings if "_lora/" in name}
    assert len(trained) == 2 * 7  # q, k, v, o, gate, up, down: A and B each
    moments = [leaf.shape for leaf in jax.tree.leaves(job.layout.abstract["opt_state"]) if leaf.ndim]
    adapters = [leaf.shape for leaf in jax.tree.leaves(job.layout.trained_part(job.layout.abstract["params"]))]
    assert sorted(moments) == sorted(adapters * 2)  # Adam's two moments of each adapter, nothing of the base


def test_the_gradient_step_computes_no_weight_gradient_of_the_base(tmp_path):
    from nestor.orchestrator.job.step import make_grad_fn

    job = build_job(load(tmp_path).replace(**ONE_DEVICE), with_data=False)
    params = job.layout.abstract["params"]
    grad_fn = make_grad_fn(job.config, job.layout, job.mesh, job.rules, job.backend)
    tokens = jax.ShapeDtypeStruct((16, 33), np.int32)
    jaxpr = jax.make_jaxpr(lambda trained, frozen, batch: grad_fn(trained, batch, frozen=frozen))(
        job.layout.trained_part(params), params, {"tokens": tokens})
    base_shapes = {leaf.shape[1:] for name, leaf in flat(params["blocks"]).items() if "_lora" not in name}
    products = {tuple(eq.outvars[0].aval.shape) for eq in equations(jaxpr.jaxpr, "dot_general")}
    assert (64, 4, 16) in base_shapes and (128, 64) in base_shapes  # the query and down weights per layer
    assert not products & base_shapes, "a product the size of a base weight: its gradient"
    assert (64, 4) in products  # the gradient of an adapter's A [embed, rank]


EXPERTS_ADAPTED = ("moe.num_experts=4", "moe.every=2", "moe.expert_mlp_dim=96",
                   "lora.targets=[expert_gate,expert_up,expert_down]")
DISPATCHES = {"dropless": ("moe.capacity_factor=0",), "sort": ("moe.dispatch=sort",),
              "einsum": ("moe.dispatch=einsum",)}


def expert_adapted_job(tmp_path, dispatch):
    return build_job(load(tmp_path, *EXPERTS_ADAPTED, *DISPATCHES[dispatch]).replace(**ONE_DEVICE), with_data=False)


def with_b(params, b_of):
    """Returns `params` with every adapter's B replaced by b_of(path, B)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: b_of(path, leaf) if jax.tree_util.keystr(path).endswith("'b']") else leaf, params)


def merged_weights(params, scale):
    """Returns `params` with W + scale A B in place of every adapted weight W, and B zero: the same model."""
    from nestor.models.lora import update

    names = flat(params)

    def merged(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        if f"{name}_lora/a" not in names:
            return leaf
        a, b = names[f"{name}_lora/a"], names[f"{name}_lora/b"]
        return leaf + update(a, b, scale, a.ndim + b.ndim - 2 - leaf.ndim)

    return with_b(jax.tree_util.tree_map_with_path(merged, params), lambda path, b: jax.numpy.zeros_like(b))


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_the_gradient_step_forms_no_expert_sized_matrix_of_adapted_experts(dispatch, tmp_path):
    from nestor.orchestrator.job.step import make_grad_fn

    job = expert_adapted_job(tmp_path, dispatch)
    params = job.layout.abstract["params"]
    grad_fn = make_grad_fn(job.config, job.layout, job.mesh, job.rules, job.backend)
    jaxpr = jax.make_jaxpr(lambda trained, frozen, batch: grad_fn(trained, batch, frozen=frozen))(
        job.layout.trained_part(params), params, {"tokens": jax.ShapeDtypeStruct((16, 33), np.int32)})
    experts = {name: leaf.shape[1:] for name, leaf in flat(params["blocks"]).items()
               if name in ("expert_layer/mlp/gate", "expert_layer/mlp/up", "expert_layer/mlp/down")}
    assert set(experts.values()) == {(4, 64, 96), (4, 96, 64)}  # gate and up [experts, embed, mlp], down
    products = {tuple(eq.outvars[0].aval.shape) for primitive in ("dot_general", "ragged_dot_general")
                for eq in equations(jaxpr.jaxpr, primitive)}
    # neither a merged weight W + scale A B nor a weight gradient of the experts' size: (x A) B alone
    assert not products & set(experts.values())
    assert {(4, 64, 4), (4, 4, 96)} <= products  # the gradients of the gate's A and B


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_expert_adapters_beside_the_experts_matmuls_give_the_loss_of_their_merged_weights(dispatch, tmp_path):
    from nestor.orchestrator.job.step import make_loss_fn

    job = expert_adapted_job(tmp_path, dispatch)
    params = with_b(init_state(job.config, job.layout)["params"],  # B away from 0: the adapters change the loss
                    lambda path, b: jax.random.normal(jax.random.key(len(str(path))), b.shape) * 0.5)
    loss_fn = make_loss_fn(job.layout, job.mesh, job.rules, job.backend)
    batch = {"tokens": np.arange(16 * 33, dtype=np.int32).reshape(16, 33) % 256}
    loss = jax.jit(lambda whole: loss_fn(job.layout.trained_part(whole), batch, jax.random.key(0), frozen=whole)[0])
    low_rank = float(loss(params))
    merged = float(loss(merged_weights(params, job.config.lora.alpha / job.config.lora.rank)))
    base = float(loss(with_b(params, lambda path, b: jax.numpy.zeros_like(b))))
    assert abs(low_rank - base) > 1e-2  # the adapters matter
    np.testing.assert_allclose(low_rank, merged, rtol=2e-6)


def test_lora_trains_the_adapters_alone_and_starts_from_the_base(one_device, tmp_path):
    result = one_device()
    full = run_fresh(config_lib.load(None, [*TINY, "model.num_kv_heads=4", "train.steps=1",
                                            f"run.dir={tmp_path}"]).replace(**ONE_DEVICE))
    # B starts at zero: the first loss is the base model's
    np.testing.assert_allclose(result.losses[0], full.losses[0], rtol=1e-6)
    trained, start = flat(result.state["params"]), flat(full.state["params"])
    init = build_job(load(tmp_path).replace(**ONE_DEVICE), with_data=False)
    initial = flat(init_state(init.config, init.layout)["params"])
    for name, value in trained.items():
        if "_lora/" in name:
            continue
        np.testing.assert_array_equal(np.asarray(value), np.asarray(initial[name]), err_msg=name)
    moved = [name for name in trained if name.endswith("_lora/b") and np.abs(np.asarray(trained[name])).max() > 0]
    assert len(moved) == 7
    assert set(start) == {name for name in trained if "_lora/" not in name}


@pytest.mark.slow
@pytest.mark.parametrize("name, degrees, overrides", [
    ("fsdp4_tensor2", dict(fsdp=4, tensor=2), ()),
    ("data2_fsdp2_tensor2_accum2", dict(data=2, fsdp=2, tensor=2), ("train.grad_accum=2",)),
    ("pipeline2_data2_tensor2_1f1b", dict(pipeline=2, data=2, tensor=2),
     ("pipeline.microbatches=4", "pipeline.schedule=1f1b")),
    ("pipeline2_fsdp4_gpipe", dict(pipeline=2, fsdp=4), ("pipeline.microbatches=4",)),
])
def test_lora_training_on_a_mesh_matches_one_device(name, degrees, overrides, one_device, tmp_path):
    model_overrides = tuple(o for o in overrides if o.startswith("model."))
    result = run_fresh(load(tmp_path, *overrides).replace(**mesh_overrides(**degrees)))
    assert_same_training(result, one_device(*model_overrides))


@pytest.mark.slow
@pytest.mark.parametrize("name, degrees, overrides", [
    ("dropless_expert4_data2", dict(expert=4, data=2), MOE_DROPLESS),
    # the factors gathered along the embedding (fsdp) and split along the hidden dimension (tensor) as their weights
    ("dropless_expert2_fsdp2_tensor2", dict(expert=2, fsdp=2, tensor=2), MOE_DROPLESS),
    ("einsum_expert4_data2", dict(expert=4, data=2), (*MOE_DROPLESS[:2], "moe.dispatch=einsum", MOE_DROPLESS[3])),
])
def test_lora_on_experts_under_expert_parallelism_matches_one_device(name, degrees, overrides, one_device, tmp_path):
    result = run_fresh(load(tmp_path, *overrides).replace(**mesh_overrides(**degrees)))
    reference = one_device(*overrides)
    assert_same_training(result, reference)
    experts = flat(result.state["params"])["blocks/expert_layer/mlp/gate_lora/a"]
    assert experts.shape == (2, 4, 64, 4)  # [units, experts, embed, rank]
    assert tuple(experts.sharding.spec)[:2] == ("pipeline", "expert")


@pytest.mark.slow
def test_lora_resume_is_exact_on_another_mesh_and_checkpoints_hold_the_adapters_alone(tmp_path):
    import orbax.checkpoint as ocp

    from nestor.orchestrator.checkpoint.files import checkpoint_dir

    reference = run(load(tmp_path / "reference", "train.steps=4", "optimizer.decay_steps=4"))
    first = run(load(tmp_path / "run", "train.steps=2", "optimizer.decay_steps=4", "checkpoint.every=2"))
    saved = ocp.StandardCheckpointHandler().metadata(checkpoint_dir(tmp_path / "run") / "2" / "state")
    saved_params = flat(saved.item_metadata["params"] if hasattr(saved, "item_metadata") else saved["params"])
    assert saved_params and all("_lora/" in name for name in saved_params)
    second = run(load(tmp_path / "run", "train.steps=4", "optimizer.decay_steps=4").replace(
        **mesh_overrides(fsdp=4, tensor=2)))
    assert second.first_step == 2
    np.testing.assert_allclose(first.losses + second.losses, reference.losses, rtol=1e-5)
    assert_same_training(second, dataclasses.replace(reference, losses=reference.losses[2:]))


@pytest.mark.parametrize("overrides, key", [
    (("lora.targets=[]",), "lora.targets"),
    (("lora.targets=[expert_up]",), "lora.targets"),
    (("lora.targets=[qkv]",), "lora.targets"),
    (("lora.dropout=1.0",), "lora.dropout"),
])
def test_lora_config_errors_name_their_key(overrides, key, tmp_path):
    with pytest.raises(ConfigError) as error:
        build_job(load(tmp_path, *overrides), with_data=False)
    assert key in str(error.value)


FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf"


def fixture_config(run_dir, *overrides):
    return config_lib.load(None, [f"model.init_from={FIXTURES / 'llama3-chat'}",
                                  f"lora.init_from={FIXTURES / 'llama3-lora'}", f"run.dir={run_dir}", *overrides])


@pytest.mark.parametrize("mesh", [("cluster.devices_per_host=1",), ("mesh.fsdp=2", "mesh.tensor=2", "mesh.data=2")],
                         ids=["one device", "fsdp2 x tensor2 x data2"])
def test_a_peft_adapter_on_its_base_gives_the_logits_peft_computes(mesh, tmp_path):
    want = dict(np.load(FIXTURES / "llama3-lora" / "reference.npz"))
    config = fixture_config(tmp_path, *mesh)
    assert (config.lora.rank, config.lora.alpha) == (4, 8.0)  # from adapter_config.json
    logits, _ = logits_of(config, want["input_ids"])
    scale = np.max(np.abs(want["logits_with_adapter"]))
    assert np.max(np.abs(logits - want["logits_with_adapter"])) / scale < 1e-4
    assert np.max(np.abs(logits - want["logits_base"])) / scale > 0.1  # the adapter changes them


def test_an_adapter_config_that_conflicts_with_the_lora_keys_is_named(tmp_path):
    with pytest.raises(ConfigError) as error:
        fixture_config(tmp_path, "lora.rank=8")
    assert "lora.rank" in str(error.value) and "adapter_config.json" in str(error.value)


def saved_at_step_0(config) -> None:
    """Saves the freshly imported state as checkpoint 0 of config.run.dir, the source's files kept beside."""
    from nestor.orchestrator.checkpoint.owner import Checkpointer
    from nestor.orchestrator.hf.load import keep_source_files

    layout = build_job(config, with_data=False).layout
    saver = Checkpointer(config, layout, log=lambda *_: None)
    saver.save(0, init_state(config, layout), {"next_step": 0}, force=True)
    saver.close()
    keep_source_files(config)


def test_an_imported_adapter_exports_as_the_same_peft_tensors_and_config(tmp_path):
    from safetensors.numpy import load_file

    from nestor.orchestrator.commands.hf_export import export

    config = fixture_config(tmp_path / "run", "mesh.fsdp=2", "mesh.tensor=2", "mesh.data=2")
    saved_at_step_0(config)
    written = export(config, tmp_path / "out", adapters=True)
    source = FIXTURES / "llama3-lora"
    got, want = load_file(tmp_path / "out" / "adapter_model.safetensors"), load_file(source / "adapter_model.safetensors")
    assert written.tensors == len(want) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert sorted(got) == sorted(want)
    for name, values in want.items():
        np.testing.assert_array_equal(got[name], values, err_msg=name)
    got_config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    want_config = json.loads((source / "adapter_config.json").read_text())
    assert set(got_config["target_modules"]) == set(want_config["target_modules"])
    differing = {key for key in got_config if key != "target_modules" and got_config[key] != want_config.get(key, "-")}
    assert differing == set()
    assert len(got_config) >= 25  # peft's keys, not a few of them


def test_a_lora_run_exports_merged_weights_with_the_logits_of_the_adapted_model(tmp_path):
    from nestor.orchestrator.commands.hf_export import export

    config = fixture_config(tmp_path / "run", "cluster.devices_per_host=1")
    saved_at_step_0(config)
    export(config, tmp_path / "merged")
    want = dict(np.load(FIXTURES / "llama3-lora" / "reference.npz"))
    merged = config_lib.load(None, [f"model.init_from={tmp_path / 'merged'}", f"run.dir={tmp_path / 'again'}",
                                    "cluster.devices_per_host=1"])
    assert merged.lora.rank == 0
    logits, _ = logits_of(merged, want["input_ids"])
    scale = np.max(np.abs(want["logits_merged"]))
    assert np.max(np.abs(logits - want["logits_merged"])) / scale < 1e-4


def test_adapters_export_needs_a_lora_run(tmp_path):
    from nestor.orchestrator.commands.hf_export import export

    config = config_lib.load(None, [f"model.init_from={FIXTURES / 'llama3-chat'}", f"run.dir={tmp_path / 'run'}",
                                    "cluster.devices_per_host=1"])
    with pytest.raises(ConfigError) as error:
        export(config, tmp_path / "out", adapters=True)
    assert "--adapters" in str(error.value)


def test_a_lora_checkpoint_refuses_a_base_other_than_the_one_its_adapters_adapt(tmp_path):
    import shutil

    from nestor.orchestrator.checkpoint.reader import restore_state

    base = tmp_path / "base"
    shutil.copytree(FIXTURES / "llama3-chat", base)
    config = config_lib.load(None, [f"model.init_from={base}", f"lora.init_from={FIXTURES / 'llama3-lora'}",
                                    f"run.dir={tmp_path / 'run'}", "cluster.devices_per_host=1"])
    saved_at_step_0(config)
    layout = build_job(config, with_data=False).layout
    step, state = restore_state(config, layout)  # the same base: restored, the base read again under the adapters
    assert step == 0 and "query" in state["params"]["blocks"]["attention"]
    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = np.float32(0.5).tobytes()  # the last weight of the file changed
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as error:
        restore_state(config, layout)
    assert "model.init_from" in str(error.value) and "fingerprint" in str(error.value)


def test_explain_counts_trainable_and_frozen_parameters_and_measures_memory_against_full_fine_tuning(tmp_path):
    from nestor.orchestrator.commands.explain import explain, format_report

    config = load(tmp_path).replace(**mesh_overrides(fsdp=4, tensor=2))
    report = explain(config)
    lora = report["lora"]
    d, h, k, m, layers, rank = 64, 4, 16, 128, 4, 4
    per_layer = rank * ((d + h * k) * 4 + (d + m) * 3)  # q, k, v (kv_heads 4), o; gate, up, down: A and B
    assert lora["trainable_params"] == layers * per_layer
    assert lora["frozen_params"] + lora["trainable_params"] == report["param_count"]
    full, saved = lora["full_fine_tuning_per_device_bytes"], lora["saved_per_device_bytes"]
    ours = report["memory_per_device_bytes"]
    assert full["optimizer"] - saved["optimizer"] == ours["optimizer"]
    assert ours["optimizer"] < full["optimizer"] / 3  # the adapters' moments alone (rank 4 of 64 is 8% here)
    assert saved["peak_estimate"] > 0
    assert "trainable parameters" in format_report(report)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, mesh", [
    ((), ONE_DEVICE),
    ((*EXPERTS_ADAPTED, *DISPATCHES["dropless"]), mesh_overrides(expert=4, data=2)),  # inside the exchange
    ((*EXPERTS_ADAPTED, *DISPATCHES["sort"]), ONE_DEVICE),
], ids=["dense", "dropless experts on expert4 x data2", "sort experts"])
def test_lora_dropout_draws_from_the_steps_key_and_leaves_evaluation_alone(overrides, mesh, tmp_path):
    from nestor.orchestrator.job.step import make_loss_fn

    batch = {"tokens": np.arange(16 * 33, dtype=np.int32).reshape(16, 33) % 256}

    def losses(dropout):  # -> loss(key, train)
        job = build_job(load(tmp_path, *overrides, f"lora.dropout={dropout}").replace(**mesh), with_data=False)
        params = jax.tree.map(lambda leaf: leaf + 0.01, init_state(job.config, job.layout)["params"])  # B off 0
        trained = job.layout.trained_part(params)
        by_mode = {train: jax.jit(lambda key, fn=make_loss_fn(job.layout, job.mesh, job.rules, job.backend,
                                                              train=train): fn(trained, batch, key, frozen=params)[0])
                   for train in (True, False)}
        return lambda key, train=True: float(by_mode[train](key))

    dropped, plain = losses(0.3), losses(0.0)
    key, other = jax.random.key(1), jax.random.key(2)
    assert dropped(key) == dropped(key) != dropped(other)  # a function of the step's key
    assert plain(key) == plain(other) != dropped(key)
    assert dropped(key, train=False) == plain(key, train=False)  # evaluation drops nothing


USER_LORA = ("lora.rank=4", "lora.targets=[blocks/blocks/*]", "optimizer.lr=1e-2")


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """tests/test_user_model.py's model (a classifier whose blocks are a Stack) and config in a fresh
    directory, nestor pointed at it."""
    from nestor.cluster.connect import USER_CODE_ENV
    from tests.test_user_model import write_user_directory

    directory = write_user_directory(tmp_path / "project")
    monkeypatch.chdir(directory)
    monkeypatch.setenv(USER_CODE_ENV, str(directory))
    return directory


@pytest.mark.slow
def test_lora_on_a_users_model_adapts_its_named_parameters_on_a_mesh_as_on_one_device(user_dir):
    from tests.test_user_model import user_config

    one = run_fresh(user_config(*USER_LORA, **ONE_DEVICE))
    meshed = run_fresh(user_config(*USER_LORA, **mesh_overrides(data=2, fsdp=2, tensor=2)))
    assert_same_training(meshed, one)
    params, start = flat(meshed.state["params"]), flat(init_state(*(lambda job: (job.config, job.layout))(
        build_job(user_config(*USER_LORA, **mesh_overrides(data=2, fsdp=2, tensor=2)), with_data=False)))["params"])
    assert {name for name in params if name.startswith("lora/")} == {
        f"lora/blocks/blocks/{weight}/{factor}" for weight in ("up", "down") for factor in "ab"}
    for name, value in params.items():  # the model's own parameters stay as they started
        if not name.startswith("lora/"):
            np.testing.assert_array_equal(np.asarray(value), np.asarray(start[name]), err_msg=name)
    assert np.abs(np.asarray(params["lora/blocks/blocks/up/b"])).max() > 0
    up, a = params["blocks/blocks/up"], params["lora/blocks/blocks/up/a"]  # [layers, embed, mlp], [layers, embed, r]
    assert a.shape == (2, 32, 4) and tuple(a.sharding.spec)[:2] == tuple(up.sharding.spec)[:2]


def test_a_lora_target_that_names_no_parameter_of_a_users_model_is_named(user_dir):
    from tests.test_user_model import user_config

    with pytest.raises(ConfigError) as error:
        build_job(user_config("lora.rank=4", "lora.targets=[blocks/attention/*]"), with_data=False)
    assert "lora.targets" in str(error.value) and "blocks/blocks/up" in str(error.value)
