"""Checkpoint faults: flipped bits and truncated files caught by the manifest, blown-up states not saved,
kill -9 at every moment of an async save, a full disk and a read-only run.dir stopping the run in one line."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from nestor.orchestrator.checkpoint import manifest
from nestor.orchestrator.checkpoint.files import checkpoint_dir
from nestor.orchestrator.checkpoint.owner import Checkpointer
from nestor.orchestrator.checkpoint.reader import CheckpointUnreadable, restore_state
from nestor.orchestrator.commands.cli import main, where_results_are
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.loop.console import Console
from nestor.orchestrator.loop.train import TrainingDiverged, train
from tests.settings import ROOT
from tests.helpers import child_env, ended, run
from tests.test_checkpoint import BASE, cli, load

SAVED = ("train.steps=6", "checkpoint.every=2", "optimizer.decay_steps=8")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 6-step run with checkpoints at 2, 4 and 6 (async saves, the default); its result."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    return run_dir, run(load(run_dir, *SAVED))


def copy_of(saved, tmp_path: Path, name: str) -> Path:
    shutil.copytree(saved[0], tmp_path / name)
    return tmp_path / name


def array_files(step_dir: Path) -> list[Path]:
    """Returns the files that hold a checkpoint's array data, largest first."""
    return sorted((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
                  key=lambda p: -p.stat().st_size)


def restore_latest(run_dir: Path, layout) -> tuple[int, list[str]]:
    """Returns the step restore_latest picks in run_dir and the warnings it gave."""
    warnings = []
    checkpointer = Checkpointer(load(run_dir, *SAVED), layout, log=warnings.append)
    step = checkpointer.restore_latest()[0]
    checkpointer.close()
    return step, warnings


@pytest.mark.slow
def test_a_flipped_bit_in_the_newest_checkpoint_is_named_and_the_previous_one_restored(saved, tmp_path):
    layout = build_job(load(saved[0], *SAVED)).layout
    largest, second = array_files(checkpoint_dir(saved[0]) / "6")[:2]
    flips = [(largest, 0, 0), (largest, largest.stat().st_size // 2, 3), (largest, largest.stat().st_size - 1, 7),
             (second, second.stat().st_size // 3, 5), (second, second.stat().st_size - 9, 1)]
    for index, (file, offset, bit) in enumerate(flips):
        run_dir = copy_of(saved, tmp_path, f"flip{index}")
        target = run_dir / file.relative_to(saved[0])
        data = bytearray(target.read_bytes())
        data[offset] ^= 1 << bit
        target.write_bytes(bytes(data))
        step, warnings = restore_latest(run_dir, layout)
        assert step == 4, (file.name, offset)
        named = str(target.relative_to(checkpoint_dir(run_dir) / "6"))
        assert len(warnings) == 1 and named in warnings[0] and "SHA-256" in warnings[0], warnings
        assert not (checkpoint_dir(run_dir) / "6").exists()  # moved aside to torn_checkpoints/



def as_an_older_nestor_wrote_it(step_dir: Path) -> None:
    """Removes nestor's record (health, the promise of a manifest) from a step's Orbax metadata."""
    metadata = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    metadata["custom_metadata"] = {}
    (step_dir / "_CHECKPOINT_METADATA").write_text(json.dumps(metadata))


def test_a_step_without_manifest_restores_unverified_when_finalized_and_is_torn_when_not(saved, tmp_path):
    layout = build_job(load(saved[0], *SAVED)).layout
    legacy = copy_of(saved, tmp_path, "legacy")  # as an older nestor wrote it: finalized, no manifest, no record
    (checkpoint_dir(legacy) / "6" / manifest.MANIFEST).unlink()
    as_an_older_nestor_wrote_it(checkpoint_dir(legacy) / "6")
    for _ in range(2):  # said at every restore
        step, warnings = restore_latest(legacy, layout)
        assert step == 6 and len(warnings) == 1, warnings
        assert str(checkpoint_dir(legacy) / "6") in warnings[0] and "without checking its files" in warnings[0]

    torn = copy_of(saved, tmp_path, "torn")  # neither manifest nor Orbax's metadata
    for name in (manifest.MANIFEST, "_CHECKPOINT_METADATA"):
        (checkpoint_dir(torn) / "6" / name).unlink()
    step, warnings = restore_latest(torn, layout)
    assert step == 4 and len(warnings) == 1 and "checkpoints/6 is incomplete" in warnings[0], warnings
    assert [p.name.split("-")[0] for p in (torn / "torn_checkpoints").iterdir()] == ["6"]


def test_a_deleted_empty_or_partial_manifest_of_a_checkpoint_nestor_wrote_is_refused(saved, tmp_path):
    layout = build_job(load(saved[0], *SAVED)).layout
    listed = json.loads((checkpoint_dir(saved[0]) / "6" / manifest.MANIFEST).read_text())["files"]
    partial = dict(sorted(listed.items())[1:])
    cases = {"deleted": (None, "nestor_manifest.json is missing (nestor wrote one with this checkpoint)"),
             "empty": ({}, f"does not list {len(listed)} of its {len(listed)} files"),
             "partial": (partial, f"does not list 1 of its {len(listed)} files ({sorted(listed)[0]})")}
    for name, (files, said) in cases.items():
        run_dir = copy_of(saved, tmp_path, name)
        step_dir = checkpoint_dir(run_dir) / "6"
        largest = array_files(step_dir)[0]
        data = bytearray(largest.read_bytes())
        data[len(data) // 2] ^= 1  # and a flipped bit the manifest no longer vouches for
        largest.write_bytes(bytes(data))
        if files is None:
            (step_dir / manifest.MANIFEST).unlink()
        else:
            (step_dir / manifest.MANIFEST).write_text(json.dumps({"files": files, manifest.SEALED: True}))
        step, warnings = restore_latest(run_dir, layout)
        assert step == 4 and len(warnings) == 1 and said in warnings[0], (name, warnings)


def flip_byte(path: Path, offset: int, mask: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_of_a_step_and_damage_to_orbax_metadata_moves_it_aside(saved, tmp_path):
    layout = build_job(load(saved[0], *SAVED)).layout
    for step in (2, 4, 6):  # sealed once each save was final: Orbax's own files are listed too
        step_dir = checkpoint_dir(saved[0]) / str(step)
        listed = json.loads((step_dir / manifest.MANIFEST).read_text())
        on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()} - {manifest.MANIFEST}
        assert listed[manifest.SEALED] is True and set(listed["files"]) == on_disk
        assert {"_CHECKPOINT_METADATA", "commit_success.txt"} <= on_disk
    metadata = "_CHECKPOINT_METADATA"
    damages = {  # damage -> what the warning names
        "a byte that is no UTF-8": (lambda d: flip_byte(d / metadata, 40, 0x80), "UnicodeDecodeError"),
        "a digit changed": (lambda d: flip_byte(d / metadata, (d / metadata).read_text().index('"loss": 5') + 8, 1),
                            f"{metadata} has another SHA-256"),
        "a stray file": (lambda d: (d / "stray.bin").write_bytes(b"x"), "does not list 1 of its"),
        "Orbax's commit marker": (lambda d: (d / "commit_success.txt").write_text("no"), "commit_success.txt has 2"),
    }
    for index, (damage, (do, said)) in enumerate(damages.items()):
        run_dir = copy_of(saved, tmp_path, f"damage{index}")
        do(checkpoint_dir(run_dir) / "6")
        step, warnings = restore_latest(run_dir, layout)
        assert step == 4 and len(warnings) == 1 and said in warnings[0] and "checkpoints/6 is unusable" in warnings[0], \
            (damage, warnings)
        assert [p.name.split("-")[0] for p in (run_dir / "torn_checkpoints").iterdir()] == ["6"]
    unsealed = copy_of(saved, tmp_path, "unsealed")  # killed between Orbax's rename and the seal
    step_dir = checkpoint_dir(unsealed) / "6"
    listed = json.loads((step_dir / manifest.MANIFEST).read_text())
    (step_dir / manifest.MANIFEST).write_text(json.dumps({"files": {name: record for name, record in listed["files"].items()
                                                                    if "/" in name}}))
    assert restore_latest(unsealed, layout) == (6, [])
    flip_byte(step_dir / metadata, 40, 0x80)  # still read before anything restores
    step, warnings = restore_latest(unsealed, layout)
    assert step == 4 and "UnicodeDecodeError" in warnings[0], warnings


@pytest.mark.slow
def test_a_run_with_torn_jsonl_lines_and_a_damaged_metadata_file_resumes_through_the_console(saved, tmp_path):
    run_dir = copy_of(saved, tmp_path, "torn")
    metrics, goodput = run_dir / "metrics.jsonl", run_dir / "goodput.jsonl"
    os.truncate(metrics, metrics.stat().st_size - 150)  # a disk that filled mid-line
    os.truncate(goodput, goodput.stat().st_size - 30)
    flip_byte(checkpoint_dir(run_dir) / "6" / "_CHECKPOINT_METADATA", 40, 0x80)
    out, err = ended(cli(run_dir, *SAVED, "train.steps=8"), 300)
    assert "Traceback" not in out + err, err[-3000:]
    said = [line for line in (out + err).splitlines() if line.startswith("warning: ")]
    assert len(said) == 3, said  # one line for each file
    for what in ("metrics.jsonl: cut off its last line", "goodput.jsonl: cut off its last line",
                 "checkpoints/6 is unusable (CorruptCheckpoint: _CHECKPOINT_METADATA is unreadable"):
        assert any(what in line for line in said), (what, said)
    assert "resumed from checkpoint 4" in out + err
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # 5 and 6 again from checkpoint 4: the cut record came back
    events = [json.loads(line)["event"] for line in goodput.read_text().splitlines()]  # every line whole
    assert events[-1] == "end" and events.count("start") == 2


def test_each_process_hashes_the_files_it_wrote_and_process_0_only_the_rest(tmp_path, monkeypatch):
    step_dir = tmp_path / "4.orbax-checkpoint-tmp"
    written = {"state/ocdbt.process_0/d/a": 3000, "state/ocdbt.process_1/d/b": 5000,
               "state/ocdbt.process_1/manifest.ocdbt": 50, "state/array_metadatas/process_1": 70,
               "state/d/merged": 20, "state/_METADATA": 40, "data/metadata": 10}
    for name, size in written.items():
        (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    own = [str(path.relative_to(step_dir)) for path in manifest.written_by(step_dir / "state", 1)]
    assert own == ["state/array_metadatas/process_1", "state/ocdbt.process_1/d/b",
                   "state/ocdbt.process_1/manifest.ocdbt"]
    shares = [manifest.records(step_dir, manifest.written_by(step_dir / "state", process)) for process in (0, 1)]

    hashed, sha256 = [], manifest._sha256
    monkeypatch.setattr(manifest, "_sha256", lambda path: hashed.append(path.name) or sha256(path))
    manifest.write_manifest(step_dir, ("state", "data"), shares[0] | shares[1])
    assert sorted(hashed) == ["_METADATA", "merged", "metadata"]  # what Orbax writes when it finalizes
    monkeypatch.undo()  # the manifest records every file, as if process 0 had hashed them all
    recorded = json.loads((step_dir / manifest.MANIFEST).read_text())["files"]
    assert recorded == manifest.records(step_dir, [step_dir / name for name in written])


@pytest.mark.slow
def test_a_truncated_array_file_resumes_from_the_previous_checkpoint_with_its_losses(saved, tmp_path, monkeypatch):
    truncated = copy_of(saved, tmp_path, "truncated")
    file = array_files(checkpoint_dir(truncated) / "6")[0]
    file.write_bytes(file.read_bytes()[:100])
    direct = copy_of(saved, tmp_path, "direct")
    shutil.rmtree(checkpoint_dir(direct) / "6")

    lines = []
    monkeypatch.chdir(tmp_path)  # paths in the lines read as the user typed them: relative to where nestor runs
    result = train(load(truncated, "train.steps=8", *SAVED[1:]), console=Console(log=lines.append))
    assert result.first_step == 4
    warning = next(line for line in lines if line.startswith("warning: checkpoint truncated/checkpoints/6 is unusable"))
    assert f"{file.relative_to(checkpoint_dir(truncated) / '6')} has 100 bytes" in warning
    assert re.search(r"; skipped and moved to truncated/torn_checkpoints/6-\d{8}T\d{6}$", warning), warning
    assert "resumed from checkpoint 4 in truncated/checkpoints" in lines
    assert result.losses == run(load(direct, "train.steps=8", *SAVED[1:])).losses


@pytest.mark.slow
def test_a_blown_up_finite_state_stops_the_run_unsaved_and_a_lower_lr_resumes(saved, tmp_path):
    run_dir = copy_of(saved, tmp_path, "blown")
    with pytest.raises(TrainingDiverged) as stopped:
        train(load(run_dir, "train.steps=8", "checkpoint.every=1", "optimizer.lr=10", "optimizer.clip_norm=0",
                   *SAVED[2:]), console=Console(log=lambda line: None))
    healthy = next(r for r in saved[1].history if r["step"] == 6)
    assert str(stopped.value).startswith("the state of step 7 blew up: its parameter norm ")
    assert (f"is more than checkpoint.health_factor=2 x {healthy['param_norm']:.4g}, the norm of the best state "
            "(step ") in str(stopped.value)
    assert str(stopped.value).endswith("stopped without saving this state. checkpoint 6 holds the last good state, "
                                       "and running again resumes from it: lower optimizer.lr, raise "
                                       "optimizer.warmup_steps or set optimizer.clip_norm first")
    assert sorted(int(p.name) for p in checkpoint_dir(run_dir).iterdir()) == [2, 4, 6]

    lowered = run(load(run_dir, "train.steps=8", *SAVED[1:]))
    assert lowered.first_step == 6 and np.isfinite(lowered.losses).all()
    assert max(record["param_norm"] for record in lowered.history) < 1.1 * healthy["param_norm"]
    assert sorted(int(p.name) for p in checkpoint_dir(run_dir).iterdir())[-1] == 8


@pytest.mark.slow
@pytest.mark.parametrize("lr, kept", [("0.3", 6), ("0.05", 12)])
def test_a_blow_up_on_resume_stops_and_keeps_a_checkpoint_that_passes_the_gate(saved, tmp_path, lr, kept):
    # The run: resumed with a learning rate far too high, keeping one checkpoint, saving every step. At
    # lr=0.05 the norm grows 7-15% a step: states within the factor are saved (and rotate checkpoint 6 out).
    run_dir = copy_of(saved, tmp_path, "resumed")
    with pytest.raises(TrainingDiverged) as stopped:
        train(load(run_dir, "train.steps=40", "checkpoint.every=1", "checkpoint.keep=1", f"optimizer.lr={lr}",
                   "optimizer.decay_steps=40", "train.log_every=1"), console=Console(log=lambda line: None))
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    best = records[6]  # the healthy run's lowest loss and its norm
    said = re.match(r"the state of step (\d+) blew up: its parameter norm ([\d.]+) is more than "
                    r"checkpoint.health_factor=2 x ([\d.]+), the norm of the best state \(step 6\)", str(stopped.value))
    assert said and int(said[1]) == kept + 1 and float(said[3]) == pytest.approx(best["param_norm"], rel=1e-3)
    assert float(said[2]) > 2 * best["param_norm"] and max(records) == kept  # the blown-up state: never logged or saved
    assert f"checkpoint {kept} holds the last good state" in str(stopped.value)
    assert sorted(int(p.name) for p in checkpoint_dir(run_dir).iterdir()) == ([2, 4, 6] if kept == 6 else [kept])
    assert records[kept]["loss"] < 2 * best["loss"] and records[kept]["param_norm"] < 2 * best["param_norm"]


def test_a_checkpoint_whose_first_loss_is_nan_is_moved_aside_and_the_one_before_named(saved, tmp_path):
    # A checkpoint of an older nestor (no manifest, no record) that restores to broken parameters: the NaN is
    # its own (the first loss after a restore is computed before any update), not the learning rate's.
    run_dir = copy_of(saved, tmp_path, "broken")
    config = load(run_dir, "train.steps=8", *SAVED[1:])
    job = build_job(config)
    checkpointer = Checkpointer(config, job.layout, log=lambda line: None)
    step, state, data_state = checkpointer.restore_latest()
    state = {**state, "step": state["step"] + 1,
             "params": jax.tree.map(lambda p: p * float("nan"), state["params"])}
    checkpointer.save(7, state, data_state, force=True)
    checkpointer.close()
    (checkpoint_dir(run_dir) / "7" / manifest.MANIFEST).unlink()
    as_an_older_nestor_wrote_it(checkpoint_dir(run_dir) / "7")
    lines = []
    with pytest.raises(TrainingDiverged) as stopped:
        train(config, console=Console(log=lines.append))
    assert "loss is nan at step 8" in str(stopped.value)
    assert "checkpoint 6 holds the last good state" in str(stopped.value)
    assert sorted(int(p.name) for p in checkpoint_dir(run_dir).iterdir()) == [4, 6]  # keep=3 rotated 2 out for 7
    assert any("checkpoints/7 is broken (the first loss after restoring it was not finite" in line for line in lines)


@pytest.fixture
def user_directory(tmp_path, monkeypatch):
    """Runs the test in tmp_path, as a user's directory holding `tiny.yaml` (the tiny preset)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text("model:\n  preset: tiny\n")


@pytest.mark.usefixtures("user_directory")
def test_a_run_that_blew_up_before_its_first_save_says_a_rerun_starts_from_step_0(tmp_path, capsys):
    blowing_up = ["train.steps=4", "checkpoint.every=2", "optimizer.lr=10", "optimizer.clip_norm=0"]
    assert main(["train", "tiny.yaml", *BASE, "run.dir=runs/blow", *blowing_up]) == 1
    err = capsys.readouterr().err
    assert "the state of step 2 blew up" in err or "the state of step 1 blew up" in err, err
    assert err.rstrip().endswith("no checkpoint is kept, so running again starts from step 0: lower optimizer.lr, "
                                 "raise optimizer.warmup_steps or set optimizer.clip_norm first")
    assert list((tmp_path / "runs" / "blow" / "checkpoints").iterdir()) == []


@pytest.mark.usefixtures("user_directory")
def test_a_run_past_train_steps_says_so_and_how_to_extend_it(tmp_path, capsys):
    # It said "at step 2 = train.steps" and offered to run the same command again, which does nothing.
    assert main(["train", "tiny.yaml", *BASE, "run.dir=runs/a", "train.steps=2"]) == 0
    capsys.readouterr()
    assert main(["train", "tiny.yaml", *BASE, "run.dir=runs/a", "train.steps=1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert ("nothing to train: the checkpoint in runs/a is at step 2, past train.steps=1; set train.steps above 2 "
            "to train on") in lines
    assert lines[-1] == "extend: run the same command with train.steps above 2, the newest checkpoint"
    kept = yaml.safe_load((tmp_path / "runs" / "a" / "config.yaml").read_text())
    assert kept["train"]["steps"] == 2  # the config of the run that trained, not of the one that did not


@pytest.mark.usefixtures("user_directory")
def test_an_interrupted_run_says_what_a_rerun_resumes_from(monkeypatch, capsys):
    # A second Ctrl-C (or one before training started) stops without a save; it said "interrupted" only.
    assert main(["train", "tiny.yaml", *BASE, "run.dir=runs/a", "train.steps=2"]) == 0
    capsys.readouterr()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("nestor.orchestrator.loop.train.train", interrupted)
    (Path("runs") / "begun" / "checkpoints").mkdir(parents=True)  # a run that got that far, and saved nothing
    for run_dir, closing in (("runs/a", "resume or extend: run the same command again (from checkpoint 2; "
                                        "train.steps=4 now)"), ("runs/new", None),
                             ("runs/begun", "run dir: runs/begun  (no checkpoint saved: running the same command "
                                            "again starts from step 0)")):
        assert main(["train", "tiny.yaml", *BASE, f"run.dir={run_dir}", "train.steps=4"]) == 130
        out, err = capsys.readouterr()
        assert err == "nestor: interrupted: stopped without saving the steps since the newest checkpoint\n"
        assert (out.splitlines()[-1] if closing else out) == (closing or "")  # nothing to show for a run never begun


def test_a_driver_that_cannot_see_run_dir_offers_the_resume_it_offered_before(tmp_path):
    # With cluster.address, run.dir may be the cluster's storage, which the driver's machine does not
    # mount: no checkpoint on its disk is no sign that every save was refused.
    lines = where_results_are(load(tmp_path / "on_the_cluster", "train.steps=7"))
    assert lines[0].endswith("  (config.yaml, metrics.jsonl, goodput.jsonl, checkpoints/)")
    assert lines[-1] == "resume or extend: run the same command again (train.steps=7 now)"
    under_ray = where_results_are(load(tmp_path / "on_the_cluster", "cluster.launcher=ray", "metrics.tensorboard=true"))
    assert under_ray[0].endswith("  (config.yaml, metrics.jsonl, goodput.jsonl, checkpoints/, tb/)")


# A driver that runs `nestor train` with Orbax's and nestor's save functions wrapped to kill -9 the
# process at one moment of the save of step 4 (step 2's save is finished by then).
KILLER = textwrap.dedent("""
    import os, signal, sys
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.path import atomicity
    from orbax.checkpoint._src.serialization import serialization
    from nestor.orchestrator.checkpoint import owner as checkpoint
    from nestor.orchestrator.commands.cli import main

    MOMENT, STEP = {moment!r}, 4
    saving = {{"step": None, "arrays": 0}}

    def die(moment):
        if saving["step"] == STEP and moment == MOMENT:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap_save(save):
        def wrapped(self, step, *args, **kwargs):
            saving["step"] = step
            if step == STEP:
                self.wait_until_finished()
                die("before the save")
            return save(self, step, *args, **kwargs)
        return wrapped

    def wrap_serialize(serialize):
        async def wrapped(*args, **kwargs):
            saving["arrays"] += saving["step"] == STEP
            if saving["arrays"] == 2:
                die("during array writes")
            return await serialize(*args, **kwargs)
        return wrapped

    def wrap_manifest(write_manifest):
        def wrapped(*args):
            die("before the manifest")
            write_manifest(*args)
        return wrapped

    def wrap_commit(on_commit):
        async def wrapped(*args, **kwargs):
            die("before the rename")
            await on_commit(*args, **kwargs)
            die("after the rename")
        return wrapped

    ocp.CheckpointManager.save = wrap_save(ocp.CheckpointManager.save)
    serialization.async_serialize_from_host = wrap_serialize(serialization.async_serialize_from_host)
    checkpoint.write_manifest = wrap_manifest(checkpoint.write_manifest)
    atomicity.on_commit_callback = wrap_commit(atomicity.on_commit_callback)
    sys.exit(main())
""")
KILL_MOMENTS = {"before the save": 2, "during array writes": 2, "before the manifest": 2, "before the rename": 2,
                "after the rename": 4}  # moment -> the newest complete checkpoint it leaves


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("moment", KILL_MOMENTS)
def test_kill_at_any_moment_of_an_async_save_resumes_from_the_newest_complete_checkpoint(saved, tmp_path, moment):
    driver = tmp_path / "killer.py"
    driver.write_text(KILLER.format(moment=moment))
    run_dir = tmp_path / "run"
    killed = cli(run_dir, *SAVED, entry=(str(driver),))
    _, err = ended(killed, 300)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]

    resumed = run(load(run_dir, *SAVED))
    assert resumed.first_step == KILL_MOMENTS[moment]
    assert not list(checkpoint_dir(run_dir).glob("*tmp*"))  # the killed save's leftovers are gone
    reference = saved[1]
    assert resumed.losses == reference.losses[resumed.first_step:]
    for got, want in zip(jax.tree.leaves(resumed.state["params"]), jax.tree.leaves(reference.state["params"])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def assert_stopped_in_one_line(process: subprocess.Popen, run_dir: Path, cause: str, code: int) -> None:
    _, err = ended(process, 300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert process.returncode == code and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("nestor: ") and str(run_dir) in err and cause in err, err
    assert len(lines) <= 2, err  # a config error is a heading and its one problem line


def assert_checkpoints_intact(run_dir: Path, layout) -> None:
    assert sorted(p.name for p in checkpoint_dir(run_dir).iterdir()) == ["2", "4", "6"]  # no temporary folder
    step, warnings = restore_latest(run_dir, layout)
    assert step == 6 and warnings == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_stops_the_run_at_its_failed_save_in_one_line(saved, tmp_path):
    run_dir = copy_of(saved, tmp_path, "full")
    # Array files of 200 kB or more cannot be written: the save of step 8 fails in the background
    # (EFBIG: Python ignores SIGXFSZ, so write() fails instead of the process being killed).
    if shutil.which("prlimit") is None:
        pytest.skip("no prlimit (util-linux) to limit the file size")
    process = cli(run_dir, "train.steps=10", *SAVED[1:], prefix=("prlimit", "--fsize=200000"))
    assert_stopped_in_one_line(process, run_dir, "checkpoint 8 could not be written (File too large", 1)
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(logged) <= 9  # stopped at the step after the failure, not at the next save
    assert_checkpoints_intact(run_dir, build_job(load(run_dir, *SAVED)).layout)


def read_only(path: Path) -> tuple[str, ...]:
    """Returns a command prefix that runs its command with `path` mounted read-only (chmod does not
    stop root); skips the test where no user namespace can be made."""
    prefix = ("unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(path))
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("no user namespace with mounts here (unshare -rm) to make a read-only directory")
    return prefix


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_read_only_run_dir_stops_the_run_in_one_line(saved, tmp_path):
    run_dir = copy_of(saved, tmp_path, "read_only")
    process = cli(run_dir, "train.steps=8", *SAVED[1:], prefix=read_only(run_dir))
    assert_stopped_in_one_line(process, run_dir, "Read-only file system", 2)  # no lock can be taken

    process = cli(run_dir, "train.steps=8", *SAVED[1:], prefix=read_only(checkpoint_dir(run_dir)))
    assert_stopped_in_one_line(process, run_dir, "checkpoint 8 could not be written (Read-only file system", 1)
    assert_checkpoints_intact(run_dir, build_job(load(run_dir, *SAVED)).layout)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readers_beside_a_run_that_rotates_every_step_never_fail_it_and_never_move_a_file(tmp_path, monkeypatch):
    # `nestor eval` beside a run with checkpoint.keep=1 moved the checkpoint being rotated out into
    # torn_checkpoints/ (the run then died: "checkpoint 73 could not be written (ENOENT)") and crashed itself.
    run_dir = tmp_path / "run"
    trainer = cli(run_dir, "train.steps=80", "checkpoint.every=1", "checkpoint.keep=1", "train.log_every=20")
    config = load(run_dir, "train.steps=80")
    layout = build_job(config).layout
    read, gone = [], 0
    while trainer.poll() is None:
        try:
            step, state = restore_state(config, layout)
        except FileNotFoundError:  # no checkpoint yet
            time.sleep(0.2)
            continue
        except CheckpointUnreadable as error:  # rotated out READ_ATTEMPTS times in a row: one line, no crash
            assert "was removed while it was read" in str(error), error
            gone += 1
            continue
        assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(state["params"]))
        assert int(state["step"]) == step
        read.append(step)
    out, err = trainer.communicate()
    assert trainer.returncode == 0 and "could not be written" not in err, err[-3000:]
    # a step outlives a read or not, as the machine's load has it: some reads are whole, none is torn
    assert len(read) >= 5 and read == sorted(read), (read, gone)
    assert "torn_checkpoints" not in {p.name for p in run_dir.iterdir()}
    assert [p.name for p in checkpoint_dir(run_dir).iterdir()] == ["80"]
    monkeypatch.chdir(tmp_path)  # and `nestor eval` itself on the finished run: nothing in run.dir changes
    before = {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    assert main(["eval", str(run_dir.parent / "run.yaml"), *BASE, f"run.dir={run_dir}", "eval.steps=1",
                 "eval.source=synthetic"]) == 0
    assert {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


@pytest.mark.slow  # a process of its own
def test_a_reader_of_a_damaged_checkpoint_says_one_line_and_orbax_logs_nothing(saved, tmp_path):
    """`nestor eval` (as `sample`, `logits` and `export`) reads through restore_state, in a process that never
    saved: a checkpoint whose array file was cut short is one line naming the checkpoint, no traceback, no Orbax log."""
    run_dir = copy_of(saved, tmp_path, "damaged")
    for step in (2, 4, 6):
        step_dir = checkpoint_dir(run_dir) / str(step)
        (step_dir / manifest.MANIFEST).unlink()  # unverified (as an older nestor wrote it): Orbax meets the damage
        as_an_older_nestor_wrote_it(step_dir)
    largest = array_files(checkpoint_dir(run_dir) / "6")[0]
    largest.write_bytes(largest.read_bytes()[:len(largest.read_bytes()) // 2])
    run_yaml = tmp_path / "damaged.yaml"
    run_yaml.write_text("model:\n  preset: tiny\n")
    done = subprocess.run([sys.executable, "-m", "nestor.orchestrator.commands.cli", "eval", str(run_yaml), *BASE,
                           f"run.dir={run_dir}", "eval.steps=1", "eval.source=synthetic"], cwd=ROOT,
                          env=child_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "cannot read the checkpoint" in done.stderr, done.stderr[-3000:]
    assert "ERROR" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
