"""Every command the docs show, run as written, in a fresh copy of the repository
(how a block is run: tests/doc_blocks.py)."""

from __future__ import annotations

import json
import re

import pytest

from tests.doc_blocks import VENV_BIN, blocks, fewer_steps, run_block, runnable


@pytest.mark.ray
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", blocks(), ids=lambda block: block.id)
def test_doc_block_runs_as_written_and_leaves_no_ray_daemon(block, tmp_path_factory):
    if block.skip_reason:
        pytest.skip(block.skip_reason)
    done = run_block(block.id, tmp_path_factory)
    process = done.process
    assert process.returncode == 0, (f"{block.id} failed (exit {process.returncode}):\n{done.text}\n--- stdout\n"
                                     f"{process.stdout[-3000:]}\n--- stderr\n{process.stderr[-3000:]}")
    assert done.leftover_daemons == set(), f"{block.id} left Ray daemons running (other than a head kept warm)"


def test_doc_commands_are_found_and_rewritten_as_documented():
    found = {block.id: block for block in blocks()}
    assert "README.md#0" in found and found["README.md#0"].language == "bash"
    first = runnable(found["README.md#0"]).splitlines()[0]
    assert first == f"{VENV_BIN}/nestor train configs/quickstart.yaml train.steps=5"
    assert fewer_steps("nestor train c.yaml run.dir=a train.steps=50") == "nestor train c.yaml run.dir=a train.steps=5"
    assert any(block.language == "python" for block in found.values())


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_submitted_job_from_the_cluster_doc_trains_and_its_driver_prints_each_step_once(tmp_path_factory):
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


def test_the_models_doc_example_names_each_parameter_once_and_logs_every_20_steps(tmp_path, monkeypatch):
    import importlib

    import yaml
    from flax import nnx

    body = next(block for block in blocks() if block.id == "docs/models.md#0").body
    files = dict(re.findall(r"cat > (\S+) <<'EOF'\n(.*?)\nEOF", body, re.S))
    (tmp_path / "classifier.py").write_text(files["classifier.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    classifier = importlib.import_module("classifier")
    with nnx.use_eager_sharding(False):  # as the job builds it (orchestrator.specs.user)
        model = nnx.eval_shape(lambda: classifier.Classifier(classifier.Config(), nnx.Rngs(0)))
    paths = ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert "trunk/blocks/down" in paths and all(len(set(path.split("/"))) == len(path.split("/")) for path in paths)
    train = yaml.safe_load(files["my.yaml"])["train"]
    assert train["steps"] // train["log_every"] == 10  # 200 steps, a line each 20th
