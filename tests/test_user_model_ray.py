"""Bring your own model under the default launcher: `nestor train` in the user's directory starts an embedded
Ray cluster whose workers import the user's module from there."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nestor.cluster.launcher import USER_CODE_ENV
from tests.helpers import child_env
from tests.test_user_model import write_user_directory


@pytest.mark.ray
@pytest.mark.timeout(1200)
def test_nestor_train_runs_a_users_model_under_ray_and_resumes(tmp_path):
    """`nestor train my.yaml` in the user's directory under the default launcher (an embedded Ray cluster,
    2 processes of 4 devices), then again for more steps on the same mesh (a resume), then on another mesh
    (a reshard): equal to one run in one process; `nestor explain my.yaml` prints the parameters' layout."""
    directory = write_user_directory(tmp_path / "project")
    env = child_env()
    env.pop(USER_CODE_ENV, None)

    def nestor(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(Path(sys.executable).parent / "nestor"), "train", "my.yaml", *args],
                              cwd=directory, env=env, capture_output=True, text=True, timeout=900)

    hosts = ("cluster.hosts=2", "cluster.devices_per_host=4")
    first = nestor(*hosts, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = nestor(*hosts, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=4")  # the same mesh
    assert resumed.returncode == 0 and "resumed from checkpoint 2" in resumed.stdout + resumed.stderr, (
        resumed.stderr[-3000:])
    resharded = nestor(*hosts, "mesh.fsdp=4", "mesh.tensor=2")  # steps 5..6 on another mesh
    assert resharded.returncode == 0, resharded.stderr[-3000:]
    reference = nestor("cluster.launcher=inprocess", "cluster.devices_per_host=8", "run.dir=runs/reference")
    assert reference.returncode == 0, reference.stderr[-3000:]

    def losses(run_dir: str) -> list[float]:
        return [json.loads(line)["loss"] for line in (directory / run_dir / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("runs/mlp")) == 6
    np.testing.assert_allclose(losses("runs/mlp"), losses("runs/reference"), rtol=1e-5)
    explained = subprocess.run([str(Path(sys.executable).parent / "nestor"), "explain", "my.yaml", "mesh.fsdp=4",
                                "mesh.tensor=2", "cluster.devices_per_host=8"], cwd=directory, env=env,
                               capture_output=True, text=True, timeout=300)
    assert explained.returncode == 0, explained.stderr[-3000:]
    assert re.search(r"blocks/blocks/up\s+\(2, 32, 64\)\s+\('layers', 'embed', 'mlp'\)\s+\('pipeline', 'fsdp', "
                     r"'tensor'\)", explained.stdout), explained.stdout
