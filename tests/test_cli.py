"""The `nestor` command as users run it: a subprocess from the repository root."""

import json
import subprocess
import sys

import pytest

from tests.settings import ROOT
from tests.helpers import child_env


def nestor(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nestor.orchestrator.commands.cli", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_explain_json_on_quickstart_mesh():
    result = nestor("explain", "configs/quickstart.yaml", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["mesh"]["devices"] == 8
    specs = {row["name"]: row["spec"] for row in report["params"]}
    assert {"embedding", "blocks/expert_layer/mlp/router", "blocks/dense/0/mlp/up"} <= set(specs), specs
    assert specs["blocks/expert_layer/mlp/up"] == ["pipeline", "expert", "fsdp", "tensor"]  # one entry per dimension
    assert report["pipeline"]["stages"] == 2
    assert report["flops_per_step"] > 0 and report["memory_per_device_bytes"]["temporaries"] > 0


@pytest.mark.timeout(120)
def test_config_error_is_one_message_with_the_key_and_no_traceback():
    result = nestor("train", "configs/quickstart.yaml", "mesh.tensor=3", "model.num_heads=5")
    assert result.returncode == 2
    assert "mesh" in result.stderr or "model.num_heads" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_missing_config_file_is_a_config_error():
    result = nestor("train", "configs/no-such-file.yaml")
    assert result.returncode == 2 and "file not found" in result.stderr and "Traceback" not in result.stderr


def test_a_command_without_its_config_says_so_and_not_that_overrides_are_required(capsys):
    from nestor.orchestrator.commands.cli import main

    for command in ("train", "eval", "logits"):
        with pytest.raises(SystemExit) as exited:
            main([command] + (["--tokens", "t.npy", "--out", "o.npy"] if command == "logits" else []))
        assert exited.value.code == 2
        error = capsys.readouterr().err
        given = ("", "") if command == "train" else (" or a run directory", "|RUN_DIR")  # eval, logits: a run's too
        assert f"nestor {command} needs a run YAML{given[0]}: nestor {command} CONFIG{given[1]} [KEY=VALUE ...]" in error
        assert "KEY=VALUE|FILE.yaml" not in error.splitlines()[-1]
