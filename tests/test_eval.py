"""Held-out evaluation: the same eval losses on every mesh and across a resume, training untouched by it,
`nestor eval` on another mesh, one compile, and config errors naming the key."""

import json

import numpy as np
import pytest

from nestor.orchestrator.data.prepare import Options, prepare
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.evaluation.commands import restore_newest
from nestor.orchestrator.job.eval_loss import Evaluator, eval_source
from nestor.orchestrator.loop.metrics import tensorboard_tag
from nestor.orchestrator.loop.console import Console
from tests.settings import ROOT
from tests.helpers import ONE_DEVICE, mesh_overrides, prepared_stdlib, run

EVAL_ON = ("eval.every=2", "eval.steps=2")
ONE_DEVICE_OVERRIDES = tuple(f"{key}={value}" for key, value in ONE_DEVICE.items())


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Standard library sources [a-c]*.py as byte-level token shards, 10% held out."""
    return prepared_stdlib(tmp_path_factory.mktemp("shards") / "abc")


def eval_losses(result) -> dict[int, float]:
    return {record["step"]: record["eval_loss"] for record in result.history if "eval_loss" in record}


@pytest.mark.slow
def test_eval_losses_match_across_a_resume_and_meshes_and_training_ignores_them(tiny_config, shards, tmp_path):
    data = ("data.source=tokens", f"data.paths=[{shards}]", "train.steps=4", "optimizer.decay_steps=4",
            *ONE_DEVICE_OVERRIDES)
    # interrupted: steps 1-2 without eval, then resumed with eval after step 4
    run(tiny_config(*data, "eval.every=0", "train.steps=2"))
    resumed = run(tiny_config(*data, *EVAL_ON))
    # uninterrupted: eval after steps 2 and 4
    whole = run(tiny_config(*data, *EVAL_ON, f"run.dir={tmp_path / 'whole'}"))
    assert resumed.first_step == 2 and sorted(eval_losses(whole)) == [2, 4]
    # steps 3-4 of the whole run follow an evaluation, those of the resumed run do not: the same losses
    np.testing.assert_array_equal(whole.losses[2:], resumed.losses)
    assert eval_losses(resumed) == {4: eval_losses(whole)[4]}
    assert eval_losses(whole)[4] < eval_losses(whole)[2]

    # the newest checkpoint (step 4) on other meshes, rows split by context too: the same eval loss, from one
    # compiled eval step
    for mesh in (dict(data=2, fsdp=2, tensor=2), dict(context=2, data=2, tensor=2)):
        config = tiny_config(*data, *EVAL_ON, f"run.dir={tmp_path / 'whole'}").replace(
            **mesh_overrides(**mesh), **{"cluster.devices_per_host": 8})
        restored = restore_newest(config)
        evaluator = Evaluator(config, restored.layout, restored.mesh, restored.rules)
        first, second = (evaluator(restored.state) for _ in range(2))
        assert restored.step == 4 and float(first["eval_loss"]) == float(second["eval_loss"])
        np.testing.assert_allclose(float(first["eval_loss"]), eval_losses(whole)[4], rtol=1e-5)
        assert evaluator.step_fn._cache_size() == 1
    logged = json.loads((tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["eval_perplexity"] == pytest.approx(np.exp(logged["eval_loss"]), rel=1e-6)


def test_eval_metrics_are_documented_and_shown_on_the_console():
    docs = (ROOT / "docs/monitoring.md").read_text()
    for name in ("eval_loss", "eval_perplexity", "eval_s"):
        assert f"`{name}`" in docs and f"`{tensorboard_tag(name)}`" in docs, name
    lines = []
    record = {"step": 4, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}
    Console(log=lines.append).step(record)
    Console(log=lines.append).step({**record, "eval_loss": 2.5, "eval_perplexity": 12.18})
    assert lines[1] == lines[0] + "  eval_loss 2.5000  eval_perplexity 12.18"


def test_eval_data_smaller_than_one_batch_or_missing_is_a_config_error_naming_the_key(tiny_config, tmp_path):
    (tmp_path / "train.txt").write_text("a training document\n" * 200)
    (tmp_path / "held.txt").write_text("held out\n")
    directory = tmp_path / "shards"
    prepare([str(tmp_path / "train.txt")], Options(tokenizer="bytes", out=directory), [str(tmp_path / "held.txt")],
            log=lambda line: None)

    def problem(*overrides):
        with pytest.raises(ConfigError) as caught:
            eval_source(tiny_config(*overrides))
        return caught.value.problems[0]

    tokens = ("data.source=tokens", f"data.paths=[{directory}]")
    key, message = problem(*tokens, "train.seq_len=4")  # 10 held-out tokens, a batch is 16 x 5
    assert key == "eval.source" and "fewer than one batch" in message
    assert problem(*tokens)[0] == "eval.source"  # not even one sequence of 33 tokens
    assert problem("eval.source=text", f"eval.paths=[{tmp_path / 'held.txt'}]")[0] == "eval.paths"
    assert problem("eval.source=text", f"eval.paths=[{tmp_path / 'absent*.txt'}]")[0] == "eval.paths"
    assert problem("eval.source=tokens")[0] == "eval.paths"
    assert problem("eval.source=text")[0] == "eval.paths"  # not the training text, silently
    assert problem("data.source=text")[0] == "eval.source"  # heldout needs prepared shards
    with pytest.raises(ConfigError, match="eval.source: heldout is the eval split"):
        tiny_config("eval.every=5")
    with pytest.raises(ConfigError, match="run.dir: no checkpoint in"):
        restore_newest(tiny_config(*ONE_DEVICE_OVERRIDES))


@pytest.mark.slow
def test_eval_after_the_quickstart_names_keys_to_paste_and_readers_leave_a_missing_run_dir_missing(
        tmp_path, monkeypatch, capsys):
    import re
    import shlex

    from nestor.orchestrator.commands.cli import main
    from tests.settings import ROOT

    monkeypatch.chdir(tmp_path)
    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    assert main(["train", quickstart, "cluster.launcher=inprocess", "train.steps=1", "run.dir=run"]) == 0
    capsys.readouterr()
    assert main(["eval", quickstart, "run.dir=run"]) == 2
    [paste] = re.findall(r"eval\.source=text 'eval\.paths=\[\S+\]'", capsys.readouterr().err)
    assert main(["eval", quickstart, "run.dir=run", "eval.steps=1", *shlex.split(paste)]) == 0  # as a shell reads it
    assert "eval_loss" in capsys.readouterr().out
    assert main(["sample", quickstart, "run.dir=nothere", "--prompt", "def "]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "nothere").exists()


@pytest.mark.parametrize("objective,perplexity", [("lm", True), ("dpo", False)])
def test_the_lms_next_token_loss_has_a_perplexity_and_dpos_loss_none(tiny_config, objective, perplexity):
    from nestor.orchestrator.job.build import make_mesh
    from nestor.orchestrator.job.state import state_layout
    from nestor.parallel.rules import resolve_rules

    data = ("data.source=arrays", "data.paths=[pairs.npz]") if objective == "dpo" else ()
    config = tiny_config(f"train.objective={objective}", *data, *ONE_DEVICE_OVERRIDES)
    assert state_layout(config, make_mesh(config), resolve_rules(config.mesh.rules)).perplexity is perplexity


def test_the_console_shows_no_perplexity_for_a_loss_without_one():
    lines = []
    Console(log=lines.append).step({"step": 4, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "rows_per_s": 10.0,
                                    "eval_loss": 0.25, "eval_accuracy": 0.5})
    assert lines[0].endswith("rows/s  eval_loss 0.2500") and "perplexity" not in lines[0]
