"""Hugging Face checkpoints in and out (orchestrator.hf): the logits of the fixtures transformers wrote
(../shared/fixtures/hf, read as they are), on one device and on sharded meshes; export back bit for bit;
each process reading only its slices; one clear error per wrong input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nestor.models import moe, stack
from nestor.models.stack import unrolled_layers
from nestor.models.transformer import Transformer
from nestor.orchestrator.checkpoint.owner import Checkpointer
from nestor.orchestrator.loader.config import load
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.evaluation.commands import logits_of
from nestor.orchestrator.hf import safetensors
from nestor.orchestrator.commands.hf_export import export
from nestor.orchestrator.hf.load import load_params
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.specs.lm import lm_config
from nestor.orchestrator.job.state import init_state
from tests.settings import COMPARABLE_ADAM
from tests.helpers import (ONE_DEVICE, assert_same_training, last_lines_of_two_processes, mesh_overrides, run,
                           run_fresh)

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf"
NAMES = ("llama3", "mixtral", "qwen3")
MESHES = {  # one device; tensor and fsdp; pipeline (and expert for the MoE model); context
    "one device": ["cluster.devices_per_host=1"],
    "fsdp2 x tensor2 x data2": ["mesh.fsdp=2", "mesh.tensor=2", "mesh.data=2"],
    "pipeline2 x tensor2 x data2": ["mesh.pipeline=2", "mesh.tensor=2", "mesh.data=2", "pipeline.microbatches=2"],
    "pipeline2 x expert2 x tensor2": ["mesh.pipeline=2", "mesh.expert=2", "mesh.tensor=2", "pipeline.microbatches=2"],
    "context2 x expert2 x data2": ["mesh.context=2", "mesh.expert=2", "mesh.data=2"],  # training rows split
}
CASES = [(name, mesh) for name in NAMES for mesh in MESHES
         if mesh != ("pipeline2 x tensor2 x data2" if name == "mixtral" else "pipeline2 x expert2 x tensor2")]


def reference(name: str) -> dict:
    return dict(np.load(FIXTURES / name / "reference.npz"))


def fixture_config(directory: Path, run_dir: Path, *overrides: str):
    return load(None, [f"model.init_from={directory}", f"run.dir={run_dir}", *overrides])


def next_token_loss(logits: np.ndarray, ids: np.ndarray) -> float:
    return float(np.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])))


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh", CASES)
def test_logits_and_loss_equal_transformers(name, mesh, tmp_path):
    want = reference(name)
    config = fixture_config(FIXTURES / name, tmp_path, *MESHES[mesh])
    logits, source = logits_of(config, want["input_ids"])
    assert source == str(FIXTURES / name)
    scale = np.max(np.abs(want["logits"]))
    assert np.max(np.abs(logits - want["logits"])) / scale < 1e-4
    assert abs(next_token_loss(logits, want["input_ids"]) - float(want["loss"])) < 1e-5


@pytest.mark.slow
def test_mixtral_routes_every_token_to_the_reference_experts(tmp_path):
    want = reference("mixtral")
    config = fixture_config(FIXTURES / "mixtral", tmp_path, "cluster.devices_per_host=1")
    layout = build_job(config, devices=jax.devices()[:1], with_data=False).layout
    params, _ = load_params(config, layout.abstract["params"])
    model = nnx.merge(nnx.split(nnx.eval_shape(lambda: Transformer(lm_config(config), nnx.Rngs(0))))[0],
                      jax.tree.map(np.asarray, params))
    chosen, choose = [], moe.choose

    def recording(logits, **kwargs):
        choices = choose(logits, **kwargs)
        chosen.append(np.stack([np.asarray(e) for e in choices.experts], axis=-1))  # [groups = rows, tokens, k]
        return choices

    moe.choose = recording
    try:
        with stack.runners({None: unrolled_layers}):  # eager, layer by layer
            model(want["input_ids"], train=False)
    finally:
        moe.choose = choose
    assert len(chosen) == 2
    for layer, experts in enumerate(chosen):
        np.testing.assert_array_equal(experts, want[f"router_topk_layer{layer}"])


def test_transformers_4_configs_read_as_5(tmp_path):
    """config_v4_style.json (rope_theta and rope_scaling at the top, torch_dtype) builds the same model."""
    source = copy_of("llama3", tmp_path)
    (source / "config.json").write_text((source / "config_v4_style.json").read_text())
    want = reference("llama3")
    logits, _ = logits_of(fixture_config(source, tmp_path / "run", "cluster.devices_per_host=1"), want["input_ids"])
    assert np.max(np.abs(logits - want["logits"])) / np.max(np.abs(want["logits"])) < 1e-4


def saved_at_step_0(config) -> None:
    """Saves the freshly imported state as checkpoint 0 of config.run.dir."""
    layout = build_job(config, with_data=False).layout
    saver = Checkpointer(config, layout, log=lambda *_: None)
    saver.save(0, init_state(config, layout), {"next_step": 0}, force=True)
    saver.close()


def assert_same_checkpoint(exported: Path, source: Path) -> None:
    """Every tensor bit for bit (read with Hugging Face's safetensors package too) and config.json field
    for field."""
    from safetensors.numpy import load_file

    want = safetensors.Reader(source)
    index = json.loads((exported / safetensors.INDEX).read_text())
    got = {}
    for file in sorted(set(index["weight_map"].values())):
        got.update(load_file(exported / file))
    assert sorted(got) == sorted(want.tensors)
    for name, values in got.items():
        np.testing.assert_array_equal(values, want.read(name), err_msg=name)
        assert values.dtype == np.float32
    assert json.loads((exported / "config.json").read_text()) == json.loads((source / "config.json").read_text())


@pytest.mark.parametrize("name,mesh", [("llama3", "pipeline2 x tensor2 x data2"), ("mixtral", "one device"),
                                       ("qwen3", "fsdp2 x tensor2 x data2")])
def test_import_then_export_round_trips_every_tensor_and_config_field(name, mesh, tmp_path):
    config = fixture_config(FIXTURES / name, tmp_path / "run", *MESHES[mesh])
    saved_at_step_0(config)
    from nestor.orchestrator.hf.load import keep_source_files

    keep_source_files(config)
    written = export(config, tmp_path / "out", max_shard_gb=3e-4)  # several files, with their index
    assert written.files > 1 and written.step == 0
    assert_same_checkpoint(tmp_path / "out", FIXTURES / name)


@pytest.mark.slow
@pytest.mark.parametrize("architecture,keys", [
    ("Qwen3ForCausalLM", ["model.qk_norm=true"]),
    ("Qwen2ForCausalLM", ["model.qkv_bias=true"]),
    ("LlamaForCausalLM", ["model.qkv_bias=true", "model.out_bias=true", "model.rope_scaling={type: llama3, factor: 8, "
                          "low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 16}"]),
    ("Qwen3MoeForCausalLM", ["model.qk_norm=true", "moe.num_experts=4", "moe.every=2", "model.num_layers=4",
                             "moe.first_dense_layers=2", "moe.expert_mlp_dim=32", "moe.normalize_gates=false",
                             "moe.capacity_factor=0"]),
])
def test_a_model_trained_from_scratch_exports_as_the_architecture_of_its_keys(architecture, keys, tmp_path):
    """Exported without a source checkpoint, then imported again: the same keys and the same logits (the
    biases and norms trained away from their initial values first)."""
    config = load(None, ["model.preset=tiny", f"run.dir={tmp_path / 'run'}", "train.steps=2", "optimizer.lr=0.05",
                         "cluster.devices_per_host=1", *keys])
    run(config)  # two steps: its checkpoint 2 in run.dir
    assert export(config, tmp_path / "out").step == 2
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["architectures"] == [architecture] and hf["dtype"] == "float32"
    again = load(None, [f"model.init_from={tmp_path / 'out'}", f"run.dir={tmp_path / 'again'}",
                        "cluster.devices_per_host=1", *(k for k in keys if k.startswith("moe.capacity"))])
    assert lm_config(again) == lm_config(config)
    ids = np.random.default_rng(0).integers(0, config.model.vocab_size, (2, 16))
    np.testing.assert_array_equal(logits_of(again, ids)[0], logits_of(config, ids)[0])
    with pytest.raises(ConfigError, match="--out"):
        export(config, tmp_path / "out")


def copy_of(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    target.chmod(0o755)  # the fixtures are read-only
    for path in target.iterdir():
        path.chmod(0o644)
    return target


def test_wrong_inputs_are_one_clear_error_each(tmp_path):
    def error_of(directory, *overrides) -> str:
        with pytest.raises(ConfigError) as raised:
            config = fixture_config(directory, tmp_path / "run", "cluster.devices_per_host=1", *overrides)
            logits_of(config, reference("qwen3")["input_ids"])
        return str(raised.value)

    (tmp_path / "empty").mkdir()
    assert "has no config.json" in error_of(tmp_path / "empty")
    source = copy_of("qwen3", tmp_path)
    assert "model.num_layers" in error_of(source, "model.num_layers=3") and "makes it 2" in error_of(source, "model.num_layers=3")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    assert "architecture 'GPT2LMHeadModel' is not supported" in error_of(source)
    (source / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    assert "hidden_act" in error_of(source)
    (source / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 16}))
    assert "use_sliding_window" in error_of(source) and "sliding_window" in error_of(source)
    (source / "config.json").write_text(json.dumps(config))
    data = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(data[:-1000])
    assert "truncated" in error_of(source)
    (source / "model.safetensors").unlink()
    assert "no *.safetensors" in error_of(source)
    (source / safetensors.INDEX).write_text(json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}}))
    assert "model-00001-of-00002.safetensors is missing" in error_of(source)


def test_a_misshapen_or_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    source = copy_of("llama3", tmp_path)
    tensors = load_file(source / "model.safetensors")
    save_file({**tensors, "model.layers.1.mlp.up_proj.weight": tensors["model.layers.1.mlp.up_proj.weight"][:64]},
              source / "model.safetensors")
    config = fixture_config(source, tmp_path / "run", "cluster.devices_per_host=1")
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp.up_proj.weight is \[64, 64\], its config.json makes it \[128, 64\]"):
        logits_of(config, reference("llama3")["input_ids"])
    del tensors["model.norm.weight"]
    save_file(tensors, source / "model.safetensors")
    with pytest.raises(ConfigError, match="lacks tensor model.norm.weight"):
        logits_of(config, reference("llama3")["input_ids"])


def test_the_tokenizer_comes_with_the_checkpoint_and_must_fit_its_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models

    source = copy_of("qwen3", tmp_path)
    for size, fits in ((300, True), (600, False)):
        Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0")).save(
            str(source / "tokenizer.json"))
        if fits:
            config = fixture_config(source, tmp_path / "run")
            assert config.data.tokenizer == str(source / "tokenizer.json")
        else:
            with pytest.raises(ConfigError, match="600 tokens, more than config.json's vocab_size 512"):
                fixture_config(source, tmp_path / "run")


BYTES_READ = """
    import json
    from nestor.orchestrator.loader.config import load
    from nestor.orchestrator.commands.hf_export import export
    from nestor.orchestrator.hf.load import keep_source_files, load_params
    from nestor.orchestrator.job.build import build_job
    from nestor.orchestrator.checkpoint.owner import Checkpointer
    from nestor.orchestrator.job.state import init_state

    source = SOURCE
    config = load(None, [f"model.init_from={source}", "cluster.hosts=2", "cluster.devices_per_host=2",
                         "mesh.fsdp=4", f"run.dir={run_dir}"])
    layout = build_job(config, with_data=False).layout
    _, read = load_params(config, layout.abstract["params"])
    saver = Checkpointer(config, layout, log=lambda *_: None)
    saver.save(0, init_state(config, layout), {"next_step": 0}, force=True)
    saver.close()
    keep_source_files(config)
    export(config, Path(run_dir).parent / "exported")
    print(read)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_each_of_two_processes_reads_only_its_slices_and_writes_its_own(tmp_path):
    source = FIXTURES / "llama3"
    body = BYTES_READ.replace("SOURCE", repr(str(source)))
    read = [int(line) for line in last_lines_of_two_processes(body, [tmp_path / "run"] * 2)]
    tensors = safetensors.Reader(source)
    total = sum(t.dtype.itemsize * int(np.prod(t.shape)) for t in tensors.tensors.values())
    # fsdp4 over 2 processes x 2 devices: each process holds half of every matrix (the norms whole)
    assert all(0.45 * total < each < 0.55 * total for each in read), (read, total)
    assert_same_checkpoint(tmp_path / "exported", source)


FINE_TUNE = ("train.steps=4", "train.global_batch=8", "train.seq_len=32", "optimizer.warmup_steps=2",
             COMPARABLE_ADAM, "optimizer.lr=1e-3")


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh", [("qwen3", dict(data=2, fsdp=2, tensor=2)),
                                       ("mixtral", dict(pipeline=2, expert=2, tensor=2))])
def test_fine_tuning_a_checkpoint_on_a_mesh_matches_one_device(name, mesh, tmp_path):
    config = load(None, [f"model.init_from={FIXTURES / name}", f"run.dir={tmp_path}", *FINE_TUNE,
                         "pipeline.microbatches=2"])
    one_device = run_fresh(config.replace(**ONE_DEVICE))
    assert one_device.losses[0] == pytest.approx(6.2, abs=0.5)  # the fixture's loss on random tokens, not 6.24 = ln 512's
    assert_same_training(run_fresh(config.replace(**mesh_overrides(**mesh))), one_device)


@pytest.mark.slow
def test_the_features_imports_need_train_alike_on_a_sharded_mesh(tiny_config):
    """Query/key/value and output biases, per-head q/k norms, llama3 RoPE scaling and MoE gates kept as the
    router's probabilities, trained on tensor x fsdp x data and pipeline x expert x tensor as on one device."""
    scaling = "{type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 16}"
    config = tiny_config("model.qkv_bias=true", "model.out_bias=true", "model.qk_norm=true",
                         f"model.rope_scaling={scaling}", "moe.num_experts=4", "moe.every=2", "model.num_layers=4",
                         "moe.normalize_gates=false", "moe.capacity_factor=0", "pipeline.microbatches=2")
    one_device = run_fresh(config.replace(**ONE_DEVICE))
    for mesh in (dict(data=2, fsdp=2, tensor=2), dict(pipeline=2, expert=2, tensor=2)):
        assert_same_training(run_fresh(config.replace(**mesh_overrides(**mesh))), one_device)


def test_hub_configs_of_qwen2_keep_their_switched_off_sliding_window(tmp_path):
    """Qwen2.5 configs carry sliding_window with use_sliding_window false, and fields of later transformers."""
    from nestor.orchestrator.hf.architectures import sections

    qwen3 = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    qwen2 = {**qwen3, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 32768,
             "use_sliding_window": False, "use_mrope": False, "_attn_implementation_autoset": True}
    (tmp_path / "config.json").write_text(json.dumps(qwen2))
    model = sections(tmp_path)["model"]
    assert model["qkv_bias"] and not model["out_bias"] and not model["qk_norm"]
    (tmp_path / "config.json").write_text(json.dumps({**qwen2, "use_sliding_window": True}))
    with pytest.raises(ConfigError, match="use_sliding_window"):
        sections(tmp_path)


def test_a_run_resumes_and_exports_after_its_source_has_moved(tmp_path):
    source = copy_of("qwen3", tmp_path)
    config = fixture_config(source, tmp_path / "run", "cluster.devices_per_host=1")
    saved_at_step_0(config)
    from nestor.orchestrator.hf.load import keep_source_files

    keep_source_files(config)
    shutil.rmtree(source)
    again = load(tmp_path / "run" / "config.yaml") if (tmp_path / "run" / "config.yaml").exists() else \
        fixture_config(source, tmp_path / "run", "cluster.devices_per_host=1")
    assert lm_config(again) == lm_config(config)
    export(again, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == \
        json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
