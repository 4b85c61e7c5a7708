"""GShard's encoder-decoder MoE family (models/seq2seq.py, configs/gshard-m4.yaml): equal to one device on
the meshes that exercise it, and its data from JSONL pairs or the synthetic task."""

import json

import numpy as np
import pytest

from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.data.examples import reversal, translation
from tests.settings import COMPARABLE_ADAM, ROOT
from tests.helpers import ONE_DEVICE, assert_same_training, mesh_overrides, run_fresh

SMALL = ("model.args.embed_dim=32", "model.args.mlp_dim=64", "model.args.num_experts=4", "train.steps=5",
         "train.global_batch=16", "optimizer.warmup_steps=2", "eval.every=5", "eval.steps=1", "train.log_every=1",
         "data.args.rows=256", "data.args.source_length=12", "data.args.target_length=12",
         "cluster.devices_per_host=8", "run.compile_cache=null", COMPARABLE_ADAM)
DETERMINISTIC = ("model.args.second_expert_policy=all",)  # a pipeline's micro-batches draw noise for their rows


def m4_config(*overrides: str, **dotted):
    return config_lib.load(ROOT / "configs" / "gshard-m4.yaml", [*SMALL, *overrides]).replace(**dotted)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, overrides", [
    (dict(expert=2, data=2, tensor=2), ()),
    (dict(expert=2, data=2, tensor=2), ("model.args.group_size=6",)),
    (dict(pipeline=2, expert=2, data=2), (*DETERMINISTIC, "pipeline.stack=encoder", "pipeline.microbatches=2",
                                          "pipeline.schedule=1f1b")),
    (dict(pipeline=2, data=2, tensor=2), (*DETERMINISTIC, "pipeline.stack=decoder", "pipeline.microbatches=2")),
], ids=["expert2_data2_tensor2_random_second", "local_groups", "pipeline2_expert2_data2_encoder_1f1b",
        "pipeline2_data2_tensor2_decoder_gpipe"])
def test_gshard_encoder_decoder_trains_as_on_one_device(mesh, overrides):
    reference = run_fresh(m4_config(*overrides, **ONE_DEVICE))
    result = run_fresh(m4_config(*overrides, **mesh_overrides(**mesh)))
    assert_same_training(result, reference)
    last = result.history[-1]
    assert last["encoder_moe_aux_loss"] > 0 and last["decoder_moe_aux_loss"] > 0
    assert np.sum(last["decoder_moe_expert_load"], axis=1) == pytest.approx([1.0, 1.0])
    evaluated, expected = (next(r for r in run.history if "eval_loss" in r) for run in (result, reference))
    np.testing.assert_allclose(evaluated["eval_cross_entropy"], expected["eval_cross_entropy"], rtol=1e-5)


def test_translation_pairs_come_from_jsonl_as_byte_tokens(tmp_path):
    pairs = [{"source": f"hello {i}", "target": f"bonjour {i}"} for i in range(40)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(pair) for pair in pairs) + "\n")
    train, held_out = (translation(split, paths=(str(path),), source_length=8, target_length=10, eval_fraction=0.1)
                       for split in ("train", "eval"))
    assert train["source"].shape == (36, 8) and held_out["target"].shape == (4, 11)
    first = train["target"][0]
    assert first[0] == 1 and bytes(int(t) - 2 for t in first[1:] if t).decode().startswith("bonjour")
    assert bytes(int(t) - 2 for t in train["source"][0] if t).decode().startswith("hello")


def test_the_synthetic_task_reverses_each_sentence():
    task = reversal("train", rows=4, source_length=24, target_length=24)
    for source, target in zip(task["source"], task["target"]):
        text = bytes(int(t) - 2 for t in source if t).decode()
        assert bytes(int(t) - 2 for t in target[1:] if t).decode() == text[::-1]


def test_a_1f1b_schedule_pipelines_the_stack_the_models_split_wraps():
    from nestor.orchestrator.errors import ConfigError
    from nestor.orchestrator.commands.explain import explain

    with pytest.raises(ConfigError, match="runs Seq2Seq's split around its stack 'encoder'"):
        explain(m4_config("pipeline.stack=decoder", "pipeline.schedule=1f1b", "pipeline.microbatches=2",
                          **mesh_overrides(pipeline=2, data=4)))
