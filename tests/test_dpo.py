"""DPO (models.dpo): the policy's and the reference's completion log-probabilities and the loss per pair
equal transformers' on the fixture's pairs, and preference data trains with its metrics logged."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import make_mesh
from nestor.orchestrator.job.state import initial_params, state_layout
from nestor.orchestrator.job.step import backend_for, make_loss_fn, objective_of
from nestor.parallel.rules import resolve_rules
from nestor.orchestrator.loader import config as config_lib

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf"
PAIRS = json.loads((FIXTURES / "llama3-chat" / "reference_chat.json").read_text())["dpo"]


def fixture_config(run_dir, *overrides):
    return config_lib.load(None, [f"model.init_from={FIXTURES / 'llama3-chat'}",
                                  f"lora.init_from={FIXTURES / 'llama3-lora'}", f"run.dir={run_dir}",
                                  "train.objective=dpo", "data.source=arrays", *overrides])


def pair_batch(pair: dict) -> dict:
    """Returns a batch of the fixture's pair: each side's tokens [1, n] and completion weights [1, n - 1]
    (the weight of target t + 1 is its completion mask)."""
    batch = {}
    for side in ("chosen", "rejected"):
        ids, mask = np.asarray(pair[side]["input_ids"], np.int32), np.asarray(pair[side]["completion_mask"], np.float32)
        batch[side], batch[f"{side}_weights"] = ids[None], mask[None, 1:]
    return batch


def test_dpo_loss_and_log_probabilities_equal_transformers_per_pair(tmp_path):
    config = fixture_config(tmp_path, "cluster.devices_per_host=1")
    mesh = make_mesh(config)
    rules = resolve_rules(config.mesh.rules)
    layout = state_layout(config, mesh, rules)
    params = initial_params(config, layout)
    loss_fn = jax.jit(make_loss_fn(layout, mesh, rules, backend_for(config, mesh), train=False,
                                   objective=objective_of(config)))
    for pair in PAIRS:
        loss, metrics = loss_fn(params, pair_batch(pair))
        assert float(loss) == pytest.approx(pair["loss"], rel=1e-5)
        for side in ("chosen", "rejected"):
            assert float(metrics[f"logp_{side}"]) == pytest.approx(pair[side]["logp_policy"], rel=1e-5)
            reference = float(metrics[f"logp_{side}"]) - float(metrics[f"reward_{side}"]) / pair["beta"]
            assert reference == pytest.approx(pair[side]["logp_reference"], rel=1e-5)
        assert float(metrics["reward_margin"]) == pytest.approx(pair["beta"] * pair["margin"], rel=1e-4)
        assert float(metrics["reward_accuracy"]) == float(pair["margin"] > 0)


def test_dpo_needs_lora_and_preference_arrays(tmp_path):
    with pytest.raises(ConfigError) as error:
        config_lib.load(None, [f"model.init_from={FIXTURES / 'llama3-chat'}", f"run.dir={tmp_path}",
                               "train.objective=dpo", "data.source=arrays"])
    assert "lora.rank" in str(error.value)
    with pytest.raises(ConfigError) as error:
        fixture_config(tmp_path, "data.source=tokens")
    assert "data.source" in str(error.value)
