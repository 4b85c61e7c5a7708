"""Every command the docs show, run as written, in a fresh copy of the repository
(how a block is run: tests/doc_blocks.py)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.doc_blocks import VENV_BIN, blocks, fewer_steps, run_block, runnable


@pytest.fixture(scope="module")
def unrelated_ray_head(tmp_path_factory):
    """A Ray head of someone else's on this machine, up while every doc block runs (the cluster doc's starts
    and stops a head of its own): yields its GCS address and its processes' ids."""
    from nestor.cluster.head import head_processes
    from tests.test_cluster import PYTHON, start_ray_head, stop_ray_head, user_shell

    env = dict(user_shell(), PATH=f"{Path(PYTHON).parent}:{os.environ['PATH']}", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    head, _, gcs_address = start_ray_head(env, tmp_path_factory.mktemp("unrelated-head") / "head.log")

    def daemons() -> set[tuple[int, float]]:  # its GCS server and raylet
        return {(process.pid, process.create_time()) for process in head_processes(gcs_address)
                if process.name() in ("gcs_server", "raylet")}

    deadline = time.monotonic() + 60  # the raylet may come up after the dashboard answers
    while len(daemons()) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    try:
        yield gcs_address, daemons()
    finally:
        stop_ray_head(head)


@pytest.mark.ray
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", blocks(), ids=lambda block: block.id)
def test_doc_block_runs_as_written_and_leaves_no_ray_daemon(block, tmp_path_factory, unrelated_ray_head):
    if block.skip_reason:
        pytest.skip(block.skip_reason)
    done = run_block(block.id, tmp_path_factory)
    process = done.process
    assert process.returncode == 0, (f"{block.id} failed (exit {process.returncode}):\n{done.text}\n--- stdout\n"
                                     f"{process.stdout[-3000:]}\n--- stderr\n{process.stderr[-3000:]}")
    assert done.leftover_daemons == set(), f"{block.id} left Ray daemons running"


def test_doc_commands_are_found_and_rewritten_as_documented():
    found = {block.id: block for block in blocks()}
    assert "README.md#0" in found and found["README.md#0"].language == "bash"
    first = runnable(found["README.md#0"]).splitlines()[0]
    assert first == f"{VENV_BIN}/nestor train configs/quickstart.yaml train.steps=5"
    assert fewer_steps("nestor train c.yaml run.dir=a train.steps=50") == "nestor train c.yaml run.dir=a train.steps=5"
    assert any(block.language == "python" for block in found.values())


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_submitted_job_from_the_cluster_doc_trains_and_its_driver_prints_each_step_once(tmp_path_factory,
                                                                                        unrelated_ray_head):
    done = run_block("docs/cluster.md#0", tmp_path_factory)  # ray start --head; nestor submit ... --follow; nestor stop-head
    out, err = done.process.stdout, done.process.stderr
    assert done.process.returncode == 0, out[-3000:] + err[-3000:]
    assert re.search(r"^raysubmit_\w+$", out, re.M), out[-3000:]
    run_dir = done.clone / "runs" / "submitted"
    assert f"run.dir on the cluster: {run_dir}" in err
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == [2]  # train.steps=20 as 2; the last step is always logged
    # no worker line reaches the job's log: the driver prints each step once
    assert len(re.findall(r"^step +2 +loss", out, re.M)) == 1, out[-3000:]
    assert "Traceback" not in out + err and "Gloo" not in out


@pytest.mark.ray
def test_an_unrelated_ray_head_outlives_every_doc_block(unrelated_ray_head):
    """Last in this file: no doc block, and no clean-up after one, stopped a head it did not start."""
    from nestor.cluster.head import head_processes

    address, daemons = unrelated_ray_head
    assert len(daemons) == 2  # its GCS server and raylet, as they were when it started
    assert daemons <= {(process.pid, process.create_time()) for process in head_processes(address)}
