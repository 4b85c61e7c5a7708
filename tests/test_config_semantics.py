"""What a config means, judged as the user wrote it: a null override unsets, a key read by nothing is warned
of, YAML 1.1's base-60 numbers are refused, a Hugging Face checkpoint is checked against the merged config,
and a mesh that would only replicate a model's work says so."""

from __future__ import annotations

import json

import pytest

from nestor.cluster.connect import USER_CODE_ENV
from nestor.orchestrator.commands.cli import main
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import build_job, traced_use, unsplit_rows_warning
from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.loader.idle_keys import idle_warning
from tests.settings import ROOT
from tests.test_hf import FIXTURES, copy_of
from tests.test_user_model import write_user_directory

LLAMA = FIXTURES / "llama3"
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


@pytest.fixture
def user_project(tmp_path, monkeypatch):
    """The user's model of tests/test_user_model.py (a classifier of named arrays) in a fresh directory."""
    monkeypatch.chdir(write_user_directory(tmp_path / "project"))
    monkeypatch.setenv(USER_CODE_ENV, str(tmp_path / "project"))


def problems_of(*overrides: str, path=None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as raised:
        config_lib.load(path, list(overrides))
    return raised.value.problems


def test_a_null_override_unsets_the_preset_and_init_from(tmp_path):
    (tmp_path / "run.yaml").write_text(f"model:\n  preset: tiny\n  init_from: {tmp_path / 'nowhere'}\n")
    base = config_lib.load(None, [])
    unset = config_lib.load(tmp_path / "run.yaml", ["model.preset=null", "model.init_from=null"])
    assert unset.model.preset is None and unset.model.init_from is None
    assert (unset.model.num_layers, unset.model.embed_dim) == (base.model.num_layers, base.model.embed_dim)
    tiny = config_lib.load(tmp_path / "run.yaml", ["model.init_from=null"])
    assert tiny.model.preset == "tiny" and tiny.model.num_layers != base.model.num_layers


def test_model_args_with_the_built_in_lm_is_warned_of():
    warning = idle_warning(config_lib.load(None, ["model.preset=tiny", "model.args={depth: 2}"]))
    assert warning and "model.args (model.class=lm is built from the model.* keys" in warning


def test_a_base_60_number_is_refused_in_a_file_and_an_override(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("run:\n  hang_timeout_s: 1:30\n")
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    said = capsys.readouterr().err
    assert "run.hang_timeout_s: 1:30 reads as 90 in YAML 1.1" in said and "write 90" in said, said
    [(key, message)] = problems_of("run.hang_timeout_s=1:30")
    assert key == "run.hang_timeout_s" and "1:30 reads as 90" in message
    assert config_lib.load(None, ["run.dir='1:30'"]).run.dir.endswith("1:30")  # quoted: text


def test_a_non_finite_norm_eps_is_refused_where_it_is_written(tmp_path):
    assert problems_of("model.norm_eps=.nan") == [("model.norm_eps", "expected a finite number, got nan")]
    source = copy_of("llama3", tmp_path)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rms_norm_eps": float("nan")}))
    [(key, message)] = problems_of(f"model.init_from={source}", "model.norm_eps=.nan")
    assert key == "model.init_from" and message == f"{source / 'config.json'}: rms_norm_eps: nan is not a positive number"


def test_the_class_lm_in_capitals_is_suggested_as_lm():
    [(key, message)] = problems_of("model.class=LM")
    assert key == "model.class" and message.endswith("did you mean 'lm'?")


def test_the_quickstart_from_a_dense_checkpoint_is_judged_on_the_merged_config():
    dense = config_lib.load(QUICKSTART, ["model.preset=null", f"model.init_from={LLAMA}", "moe.every=0",
                                         "moe.num_experts=0", "cluster.launcher=inprocess"])
    assert dense.moe.num_experts == 0 and dense.model.num_layers == 2  # llama3's
    conflicts = problems_of("model.preset=null", f"model.init_from={LLAMA}", path=QUICKSTART)
    assert [key for key, _ in conflicts] == ["moe.num_experts", "moe.every"]


def test_a_users_model_with_init_from_is_refused_in_explain_as_in_train(user_project, capsys):
    for command in ("explain", "train"):
        assert main([command, "my.yaml", f"model.init_from={LLAMA}", "cluster.launcher=inprocess"]) == 2
        said = capsys.readouterr().err
        assert "model.init_from: a Hugging Face checkpoint holds the weights of nestor's language model" in said, said


def test_a_context_mesh_on_a_model_that_splits_no_rows_is_warned_of(user_project, capsys):
    assert main(["explain", "my.yaml", "mesh.context=2", "mesh.data=4", "cluster.devices_per_host=8"]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: mesh.context=2")]
    assert len(warned) == 1 and "model.class mlp:MLP names no activation `length`" in warned[0], warned
    assert main(["train", "my.yaml", "mesh.context=2", "mesh.data=4", "cluster.devices_per_host=8", "train.steps=1",
                 "cluster.launcher=inprocess", "run.dir=runs/context"]) == 0
    trained = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: mesh.context=2")]
    assert trained == warned  # train says it too, once
    lm = build_job(config_lib.load(None, ["model.preset=tiny", "mesh.context=2", "mesh.data=4", "train.seq_len=32",
                                          "cluster.devices_per_host=8"]), with_data=False)
    assert unsplit_rows_warning(lm, traced_use(lm)[1]) is None  # nestor's LM reads its positions
