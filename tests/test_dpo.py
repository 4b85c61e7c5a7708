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


@pytest.mark.parametrize("overrides, key", [
    (("data.source=tokens",), "data.source"),
    (("mesh.pipeline=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"), "pipeline.schedule"),
])
def test_dpo_config_errors_name_their_key(overrides, key, tmp_path):
    with pytest.raises(ConfigError) as error:
        fixture_config(tmp_path, *overrides)
    assert key in str(error.value)


def fixture_records() -> list[dict]:
    """Returns the fixture's pairs as preference records: the prompt's messages, each answer a message
    whose text is its completion tokens decoded (the end of turn, the template's, left out)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(FIXTURES / "llama3-chat" / "tokenizer.json"))
    records = []
    for pair in PAIRS:
        record = {"prompt": pair["prompt"]}
        for side in ("chosen", "rejected"):
            answer = [i for i, m in zip(pair[side]["input_ids"], pair[side]["completion_mask"]) if m][:-1]
            record[side] = {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=False)}
        records.append(record)
    return records


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Returns the directory of the fixture's pairs prepared as named arrays: 8 pairs (0, 1, 2, 0, 1, ...)."""
    from nestor.orchestrator.data.preferences import prepare_preferences

    directory = tmp_path_factory.mktemp("pairs")
    records = fixture_records()
    (directory / "pairs.jsonl").write_text("".join(json.dumps(records[i % 3]) + "\n" for i in range(8)))
    written = prepare_preferences([directory / "pairs.jsonl"], str(FIXTURES / "llama3-chat" / "tokenizer.json"),
                                  directory / "out", log=lambda *_: None)
    return directory / "out", written


def test_preference_records_prepare_as_transformers_tokenizes_them(prepared):
    out, written = prepared
    arrays = dict(np.load(out / "train.npz"))
    longest = max(len(pair[side]["input_ids"]) for pair in PAIRS for side in ("chosen", "rejected"))
    assert written["seq_len"] == longest - 1 and written["splits"] == {"train": 8, "eval": 0}
    for row in range(8):
        pair = PAIRS[row % 3]
        for side in ("chosen", "rejected"):
            ids, mask = pair[side]["input_ids"], pair[side]["completion_mask"]
            np.testing.assert_array_equal(arrays[side][row, :len(ids)], ids)
            np.testing.assert_array_equal(arrays[f"{side}_weights"][row, :len(ids) - 1], mask[1:])
            assert not arrays[f"{side}_weights"][row, len(ids) - 1:].any()  # padding never weighs


@pytest.mark.parametrize("mesh", [("cluster.devices_per_host=1",), ("mesh.fsdp=2", "mesh.tensor=2", "mesh.data=2")],
                         ids=["one device", "fsdp2 x tensor2 x data2"])
def test_dpo_training_starts_at_transformers_loss_and_logs_its_rewards(prepared, mesh, tmp_path):
    from tests.helpers import run_fresh

    out, written = prepared
    config = fixture_config(tmp_path, f"data.paths=[{out / 'train.npz'}]", f"train.seq_len={written['seq_len']}",
                            "train.global_batch=8", "train.steps=3", "optimizer.lr=1e-3", "optimizer.warmup_steps=0",
                            "optimizer.eps=1e-6", *mesh)
    result = run_fresh(config)
    rows = [PAIRS[i % 3]["loss"] for i in range(8)]  # one epoch: every pair once in the first batch
    assert result.losses[0] == pytest.approx(float(np.mean(rows)), rel=1e-5)
    assert result.losses[-1] < result.losses[0]  # the policy learns to prefer the chosen answers
    logged = result.history[-1]
    assert {"reward_margin", "reward_accuracy", "reward_chosen", "reward_rejected"} <= set(logged)
    assert 0.0 <= logged["reward_accuracy"] <= 1.0


def full_dpo_config(run_dir, prepared, *overrides):
    """DPO without LoRA on the fixture's pairs: the whole model trains, its start frozen as the reference."""
    out, written = prepared
    return config_lib.load(None, [f"model.init_from={FIXTURES / 'llama3-chat'}", f"run.dir={run_dir}",
                                  "train.objective=dpo", "data.source=arrays", f"data.paths=[{out / 'train.npz'}]",
                                  f"train.seq_len={written['seq_len']}", "train.global_batch=8", "optimizer.lr=1e-4",
                                  "optimizer.warmup_steps=0", "optimizer.eps=1e-6", "optimizer.decay_steps=3",
                                  "cluster.devices_per_host=1", *overrides])


@pytest.mark.slow
def test_dpo_without_lora_trains_against_a_frozen_copy_of_its_start_and_resumes_exactly(prepared, tmp_path):
    from tests.helpers import run

    config = full_dpo_config(tmp_path / "whole", prepared, "train.steps=3")
    whole = run(config)
    assert whole.losses[0] == pytest.approx(np.log(2), rel=1e-6)  # the policy is its reference at the start
    assert whole.losses[-1] < whole.losses[0]
    start = initial_params(config, state_layout(config, make_mesh(config), resolve_rules(config.mesh.rules)))
    for reference, began in zip(jax.tree.leaves(whole.state["reference"]), jax.tree.leaves(start)):
        np.testing.assert_array_equal(np.asarray(reference), np.asarray(began))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(whole.state["params"])))
    first = run(full_dpo_config(tmp_path / "run", prepared, "train.steps=2", "checkpoint.every=2"))
    second = run(full_dpo_config(tmp_path / "run", prepared, "train.steps=3"))
    assert second.first_step == 2
    np.testing.assert_allclose(first.losses + second.losses, whole.losses, rtol=1e-6)
