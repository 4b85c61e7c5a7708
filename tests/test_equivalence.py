"""The same model, data and seed trained on any mesh matches one device."""

import pytest

from tests.settings import TINY
from tests.helpers import TESTED_MESHES, ONE_DEVICE, assert_same_training, mesh_overrides, run_fresh


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from nestor.orchestrator.loader import config as config_lib

    def make(*overrides):
        base = [*TINY, "model.num_kv_heads=4", f"run.dir={tmp_path_factory.mktemp('ref')}"]
        return config_lib.load(None, base + list(overrides))

    return make, run_fresh(make().replace(**ONE_DEVICE))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", TESTED_MESHES, ids=list(TESTED_MESHES))
def test_losses_and_params_match_one_device(reference, mesh, tmp_path):
    make, one_device = reference
    config = make(f"run.dir={tmp_path}").replace(**mesh_overrides(**TESTED_MESHES[mesh]))
    assert_same_training(run_fresh(config), one_device)


def test_grad_accumulation_matches_one_big_batch(reference, tmp_path):
    make, one_device = reference
    config = make(f"run.dir={tmp_path}", "train.grad_accum=2").replace(**mesh_overrides(data=2, fsdp=2, tensor=2))
    assert_same_training(run_fresh(config), one_device)
