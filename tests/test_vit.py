"""The Vision Transformer family (models/vit.py, configs/vit-digits.yaml): scikit-learn's digits through the
python data factory, equal to one device on the meshes that exercise it."""

import numpy as np
import pytest

from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.data.examples import digits
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.commands.explain import explain
from tests.settings import COMPARABLE_ADAM, ROOT
from tests.helpers import ONE_DEVICE, assert_same_training, mesh_overrides, run_fresh

SMALL = ("model.args.embed_dim=32", "model.args.num_heads=4", "model.args.mlp_dim=64", "train.steps=5",
         "train.global_batch=16", "optimizer.warmup_steps=2", "eval.every=5", "eval.steps=2", "train.log_every=1",
         "cluster.devices_per_host=8", "run.compile_cache=null", COMPARABLE_ADAM)


def vit_config(*overrides: str, **dotted):
    config = config_lib.load(ROOT / "configs" / "vit-digits.yaml", [*SMALL, *overrides])
    return config.replace(**dotted)


@pytest.fixture(scope="module")
def one_device():
    return run_fresh(vit_config(**ONE_DEVICE))


@pytest.mark.slow
@pytest.mark.parametrize("mesh, overrides", [
    (dict(pipeline=2, data=4), ("pipeline.schedule=1f1b",)),
    (dict(fsdp=2, tensor=2, data=2), ()),
    (dict(pipeline=2, fsdp=2, tensor=2), ("pipeline.schedule=zero_bubble",)),
], ids=["pipeline2_data4_1f1b", "fsdp2_tensor2_data2", "pipeline2_fsdp2_tensor2_zero_bubble"])
def test_vit_trains_as_on_one_device(one_device, mesh, overrides):
    result = run_fresh(vit_config(*overrides, **mesh_overrides(**mesh)))
    assert_same_training(result, one_device)
    evaluated, reference = (next(record for record in run.history if "eval_loss" in record)
                            for run in (result, one_device))
    np.testing.assert_allclose([evaluated["eval_loss"], evaluated["eval_accuracy"]],
                               [reference["eval_loss"], reference["eval_accuracy"]], rtol=1e-5)


def test_digits_splits_are_disjoint_and_cover_the_set():
    train, held_out = digits("train"), digits("eval")
    assert train["image"].shape == (1438, 8, 8, 1) and held_out["image"].shape == (359, 8, 8, 1)
    assert train["image"].dtype == np.float32 and 0 <= train["image"].min() and train["image"].max() <= 1
    rows = {image.tobytes() for image in train["image"]}
    assert not any(image.tobytes() in rows for image in held_out["image"][:50])  # no held-out image trained on
    assert sorted(set(held_out["label"].tolist())) == list(range(10))
    with pytest.raises(ConfigError, match="digits has the splits train, eval"):
        digits("test")


def test_vit_lays_out_its_patches_blocks_and_head():
    report = explain(vit_config(**mesh_overrides(pipeline=2, fsdp=2, tensor=2)))
    specs = {row["name"]: row["spec"] for row in report["params"]}
    assert specs["blocks/blocks/query"] == ["pipeline", "fsdp", "tensor", None]
    assert specs["blocks/blocks/up"] == ["pipeline", "fsdp", "tensor"]
    assert specs["head"] == ["fsdp", None] and specs["patch_embedding"] == [None, "fsdp"]
