"""Checkpoints: exact resume after SIGKILL, reshard onto other meshes, torn saves skipped, NaN stops."""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax._src.dispatch import BACKEND_COMPILE_EVENT  # the name jax.monitoring reports a compile under

from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.checkpoint.files import checkpoint_dir
from nestor.orchestrator.checkpoint.owner import Checkpointer, MIN_REPLICA_SLICE_BYTES
from nestor.orchestrator.checkpoint.reader import restore_state
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.commands.launch_checks import checkpoint_misfit
from nestor.orchestrator.loop.console import Console
from nestor.orchestrator.loop.signals import StopSignals
from nestor.orchestrator.job.state import init_state
from nestor.orchestrator.loop.train import TrainingDiverged, train
from tests.settings import ROOT
from tests.helpers import child_env, ended, last_lines_of_two_processes, mesh_overrides, prepared_stdlib, run

BASE = ["model.preset=tiny", "train.global_batch=16", "train.seq_len=32", "optimizer.warmup_steps=2",
        "cluster.devices_per_host=8", "metrics.tensorboard=false", "cluster.launcher=inprocess"]


def load(run_dir: Path, *overrides: str):
    return config_lib.load(None, BASE + [f"run.dir={run_dir}", *overrides])


def cli(run_dir: Path, *overrides: str, entry: tuple[str, ...] = ("-m", "nestor.orchestrator.commands.cli"),
        prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """Starts `nestor train` from this checkout in a fresh process (run YAML: the tiny model): python
    `entry` (default: the CLI module), run by the command `prefix` if one is given."""
    env = child_env(JAX_PLATFORMS="cpu")
    run_yaml = run_dir.parent / f"{run_dir.name}.yaml"
    run_yaml.write_text("model:\n  preset: tiny\n")
    args = [*prefix, sys.executable, *entry, "train", str(run_yaml), *BASE, f"run.dir={run_dir}", *overrides]
    # SIGINT at its default, as from a terminal: a shell that starts the suite in the background hands it on
    # ignored, and a signal sent before the CLI installs its handler (a loaded machine) would then be lost
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def logged_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def params_of(config, step=None) -> dict:
    step, state = restore_state(config, build_job(config).layout, step)
    return step, jax.tree.map(np.asarray, state["params"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["synthetic", "text", "tokens"])
def test_resume_after_sigkill_is_bit_exact(tmp_path, source):
    overrides = ("train.steps=12", "checkpoint.every=6", f"data.source={source}")
    if source == "tokens":
        overrides += (f"data.paths=[{prepared_stdlib(tmp_path / 'shards')}]",)
    reference = run(load(tmp_path / "reference", *overrides))

    run_dir = tmp_path / "run"
    first = cli(run_dir, *overrides)
    finalized = checkpoint_dir(run_dir) / "6" / "_CHECKPOINT_METADATA"
    while not finalized.exists():
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.005)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert first.returncode == -signal.SIGKILL
    done = [int(p.name) for p in checkpoint_dir(run_dir).iterdir() if p.name.isdigit()]
    assert max(done) == 6, f"the run finished before the kill ({done}); the test needs a slower step"

    second = cli(run_dir, *overrides)
    out, err = ended(second, 240)
    assert second.returncode == 0, err[-3000:]
    assert "resumed from checkpoint 6" in out

    losses = logged_losses(run_dir)
    assert [losses[s] for s in range(7, 13)] == reference.losses[6:12]
    step, params = params_of(load(run_dir, *overrides))
    assert step == 12
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(jax.tree.map(np.asarray, reference.state["params"]))):
        np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def saved_on_d2f2t2(tmp_path_factory):
    """A 6-step run on data2 x fsdp2 x tensor2 with checkpoints at 3 and 6."""
    run_dir = tmp_path_factory.mktemp("d2f2t2")
    config = load(run_dir, "train.steps=6", "checkpoint.every=3").replace(**mesh_overrides(data=2, fsdp=2, tensor=2))
    return run_dir, run(config)


RESHARD_TARGETS = {
    "fsdp8": (mesh_overrides(fsdp=8), 8),
    "tensor2_data4": (mesh_overrides(tensor=2, data=4), 8),
    "data2_tensor2_on_4_devices": (mesh_overrides(data=2, tensor=2), 4),
    "pipeline2_data2_tensor2": (mesh_overrides(pipeline=2, data=2, tensor=2) | {"pipeline.microbatches": 2}, 8),
    # the same mesh, the Adam moments split over the batch's replicas (a checkpoint saved without it)
    "data2_fsdp2_tensor2_shard_update": (mesh_overrides(data=2, fsdp=2, tensor=2) | {"optimizer.shard_update": True}, 8),
}


@pytest.mark.slow
@pytest.mark.parametrize("target", RESHARD_TARGETS, ids=list(RESHARD_TARGETS))
def test_checkpoint_reshards_onto_another_mesh(saved_on_d2f2t2, tmp_path, target):
    saved_dir, reference = saved_on_d2f2t2
    run_dir = tmp_path / "run"
    shutil.copytree(saved_dir, run_dir)
    shutil.rmtree(checkpoint_dir(run_dir) / "6")  # newest is now the step-3 checkpoint
    mesh, devices = RESHARD_TARGETS[target]
    config = load(run_dir, "train.steps=6", "checkpoint.every=3",
                  f"cluster.devices_per_host={devices}").replace(**mesh)
    result = run(config)
    assert result.first_step == 3
    assert jax.tree.leaves(result.state["params"])[0].sharding.mesh.devices.size == devices
    np.testing.assert_allclose(result.losses, reference.losses[3:], rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_saved_with_a_sharded_update_resumes_with_a_replicated_one(tmp_path):
    mesh = mesh_overrides(data=4, fsdp=2)
    saved_dir = tmp_path / "saved"
    reference = run(load(saved_dir, "train.steps=4", "checkpoint.every=2", "optimizer.shard_update=true").replace(**mesh))
    run_dir = tmp_path / "run"
    shutil.copytree(saved_dir, run_dir)
    shutil.rmtree(checkpoint_dir(run_dir) / "4")  # newest is now the step-2 checkpoint
    result = run(load(run_dir, "train.steps=4", "checkpoint.every=2").replace(**mesh))
    assert result.first_step == 2
    np.testing.assert_allclose(result.losses, reference.losses[2:], rtol=1e-6)


def test_saving_small_replicated_arrays_compiles_nothing_and_restores_them_exactly(tmp_path):
    """On data8 every array is replicated 8 ways. Orbax would slice each shard over its replicas, one
    compiled program per array shape; below MIN_REPLICA_SLICE_BYTES one replica writes it whole."""
    config = load(tmp_path / "run").replace(**mesh_overrides(data=8))
    layout = build_job(config, with_data=False).layout
    state = init_state(config, layout)
    jax.block_until_ready(state)
    assert max(leaf.nbytes for leaf in jax.tree.leaves(state)) < MIN_REPLICA_SLICE_BYTES
    compiles = []

    def count(event: str, seconds: float, **_) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        checkpointer = Checkpointer(config, layout, log=lambda *_: None)
        checkpointer.save(0, state, {}, force=True)
        checkpointer.close()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == []
    step, restored = restore_state(config, layout)
    assert step == 0
    for saved, back in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(back))


@pytest.mark.slow
def test_torn_checkpoints_are_skipped_and_kept_aside(tmp_path):
    config = load(tmp_path / "run", "train.steps=4", "checkpoint.every=2", "checkpoint.keep=2")
    run(config)
    directory = checkpoint_dir(config.run.dir)
    shutil.copytree(directory / "4", directory / "8")
    (directory / "8" / "_CHECKPOINT_METADATA").unlink()  # killed before Orbax finalized it
    shutil.copytree(directory / "4", directory / "6")
    for file in (directory / "6" / "state").rglob("*"):  # metadata present, array data lost
        if file.is_file() and "d" in file.parent.name:
            file.unlink()
    (directory / "10.orbax-checkpoint-tmp-1234").mkdir()  # a save cut off mid-write

    warnings = []
    checkpointer = Checkpointer(config, build_job(config).layout, log=warnings.append)
    step, state, data_state = checkpointer.restore_latest()
    checkpointer.close()
    assert step == 4 and int(state["step"]) == 4 and data_state["next_step"] == 4
    assert any(str(directory / "8") in w for w in warnings)
    assert any(str(directory / "6") in w for w in warnings)
    assert sorted(p.name.split("-")[0] for p in (Path(config.run.dir) / "torn_checkpoints").iterdir()) == ["6", "8"]

    # Continuing with keep=2 rotates out only good checkpoints, oldest first.
    run(config.replace(**{"train.steps": 6}))
    assert sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) == [4, 6]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_nan_loss_stops_with_error_and_keeps_last_good_checkpoint(tmp_path):
    # Finite is the only test here: step 1 is saved although its parameters blew up (see test_checkpoint_faults).
    overrides = ("train.steps=8", "checkpoint.every=1", "optimizer.lr=1.0e+15", "optimizer.clip_norm=0",
                 "checkpoint.health_factor=0")
    with pytest.raises(TrainingDiverged, match="checkpoint 1 holds the last good state, and running again"):
        run(load(tmp_path / "inprocess", *overrides))
    with pytest.raises(TrainingDiverged, match="no checkpoint is kept, so running again starts from step 0"):
        run(load(tmp_path / "unsaved", *overrides, "checkpoint.every=0"))
    process = cli(tmp_path / "cli", *overrides)
    _, err = ended(process, 150)
    assert process.returncode == 1
    assert "training diverged" in err and ("is nan" in err or "is inf" in err)

    step, params = params_of(load(tmp_path / "cli", *overrides))
    assert step == 1  # step 2 has the NaN loss
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_saves_the_current_step_before_exit(tmp_path):
    run_dir = tmp_path / "run"
    process = cli(run_dir, "train.steps=100000", "checkpoint.every=0")
    while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 3:
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    out, err = ended(process, 120)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM: stopping and saving at the next step\n" in out  # said as it came, not only at the end
    saved = [int(p.name) for p in checkpoint_dir(run_dir).iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and saved[0] >= 3
    assert saved[0] == max(logged_losses(run_dir))  # the saved state is the last one logged


def test_stop_signals_keep_the_first_signal_for_the_loop_and_a_second_ctrl_c_interrupts():
    with StopSignals() as signals:
        assert not signals.stop_before(1)
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.stop_before(2) and signals.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    # A Ray launcher's driver that got the signal: one process stops as if it had got it.
    requested: list[int] = []
    passed_on = StopSignals(lambda now=False: requested[0] if requested else None)
    assert not passed_on.stop_before(1)
    requested.append(signal.SIGTERM)
    assert passed_on.stop_before(2) and passed_on.received == signal.SIGTERM


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in run_dir.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_checkpoint_of_another_model_is_a_config_error_that_leaves_run_dir_untouched(tmp_path):
    run(load(tmp_path / "run", "train.steps=2"))
    before, config_yaml = _files(tmp_path / "run"), (tmp_path / "run" / "config.yaml").read_text()
    wider = load(tmp_path / "run", "train.steps=4", "model.mlp_dim=256")
    with pytest.raises(ConfigError, match="model.mlp_dim"):
        run(wider)
    assert (checkpoint_dir(wider.run.dir) / "2").is_dir()  # left where it was
    assert _files(tmp_path / "run") == before and (tmp_path / "run" / "config.yaml").read_text() == config_yaml


# Two processes save checkpoints 1, 2 and 3, each hashing for the manifest the files it wrote (and process 0
# those Orbax writes when it finalizes); then process 0 alone finds 3 broken before reading it, and process 1
# alone fails to read 2's arrays, inside Orbax's restore.
DIFFERING_RESTORES = """
    import re
    import orbax.checkpoint as ocp
    from nestor.orchestrator.checkpoint import manifest, owner as checkpoint, reader as checkpoint_restore
    from nestor.orchestrator.loader.config import load
    from nestor.orchestrator.job.build import build_job
    from nestor.orchestrator.job.state import init_state

    config = load(None, ["model.preset=tiny", "cluster.hosts=2", "cluster.devices_per_host=2", f"run.dir={run_dir}"])
    layout = build_job(config, with_data=False).layout
    saver, state = checkpoint.Checkpointer(config, layout, log=print), init_state(config, layout)
    hashed, sha256 = set(), manifest._sha256
    def whose(path):  # whose files this process hashes: a process's own, or none's ("-")
        hashed.add(next(iter(re.findall(r"process_(\\d)", str(path))), "-"))
        return sha256(path)
    manifest._sha256 = whose
    for step in (1, 2, 3):
        saver.save(step, state, {"next_step": step}, force=True)
    saver.close()
    manifest._sha256 = sha256
    if rank == 0:
        check_fits = checkpoint_restore._check_fits
        def broken_3(saved_state, saved_config, config, layout, step_dir):
            if step_dir.name == "3":
                raise ValueError("checksum mismatch")
            check_fits(saved_state, saved_config, config, layout, step_dir)
        checkpoint_restore._check_fits = broken_3
    else:
        read = ocp.StandardCheckpointHandler.restore
        def unreadable_2(self, directory, args=None):
            if Path(directory).parent.name == "2":
                raise OSError("injected read error")
            return read(self, directory, args=args)
        ocp.StandardCheckpointHandler.restore = unreadable_2
    restoring = checkpoint.Checkpointer(config, layout, log=print)
    step, state, data_state = restoring.restore_latest()
    restoring.close()
    print(step, data_state["next_step"], sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir()),
          sorted(hashed))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_restores_that_fail_on_one_process_only_move_the_checkpoint_aside_on_all(tmp_path):
    last = last_lines_of_two_processes(DIFFERING_RESTORES, [tmp_path / "run"] * 2)
    # Both go on from the oldest checkpoint, none waits for the other.
    assert last == ["1 1 ['1'] ['-', '0']", "1 1 ['1'] ['1']"]
    moved = sorted(p.name.split("-")[0] for p in (tmp_path / "run" / "torn_checkpoints").iterdir())
    assert moved == ["2", "3"]

@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_second_run_on_a_busy_run_dir_is_refused_naming_the_first(tmp_path):
    run_dir = tmp_path / "run"
    first = cli(run_dir, "train.steps=100000", "checkpoint.every=2", "checkpoint.keep=2")
    while not (run_dir / "metrics.jsonl").exists() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 3:
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.05)
    second = cli(run_dir, "train.steps=100000", "cluster.launcher=ray")  # the default launcher: its driver
    _, err = ended(second, 120)
    assert second.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "nestor.lock" in err and f"pid {first.pid} on host {socket.gethostname()}" in err, err
    assert first.poll() is None  # still training
    first.send_signal(signal.SIGTERM)
    _, err = ended(first, 120)
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # one run's steps, each once
    saved = sorted(int(p.name) for p in checkpoint_dir(run_dir).iterdir() if p.name.isdigit())
    assert len(saved) <= 2 and saved[-1] == steps[-1]
    assert not (run_dir / "nestor.lock").exists()


@pytest.mark.slow
def test_checkpoint_with_other_experts_is_a_config_error_naming_them(tmp_path):
    moe = ("moe.num_experts=4", "moe.every=2")
    run(load(tmp_path / "run", "train.steps=2", *moe))
    more_experts = load(tmp_path / "run", "train.steps=4", "moe.num_experts=8", "moe.every=2")
    with pytest.raises(ConfigError, match="moe.num_experts") as error:
        run(more_experts)
    assert "run.dir" in str(error.value) and "(2, 4," in str(error.value)  # names a saved expert array's shape
    assert (checkpoint_dir(more_experts.run.dir) / "2").is_dir()  # left where it was
    assert not (tmp_path / "torn_checkpoints").exists()
    # the Ray launcher's check in the user's process, before any worker starts, names the same key
    with pytest.raises(ConfigError, match="moe.num_experts: is 8 but .* was written with 4; use the "
                                                    "checkpoint's value or a new run.dir"):
        checkpoint_misfit(more_experts)


@pytest.mark.slow
def test_resume_may_change_settings_that_shape_no_array(tmp_path):
    run(load(tmp_path / "run", "train.steps=2"))
    changed = load(tmp_path / "run", "train.steps=4", "optimizer.clip_norm=0", "model.dtype=bfloat16",
                   "moe.capacity_factor=2.0", "optimizer.lr=1e-3")
    result = run(changed)
    assert result.first_step == 2 and len(result.losses) == 2 and np.isfinite(result.losses).all()


@pytest.mark.slow
def test_resume_to_more_steps_within_decay_steps_is_bit_exact(tmp_path):
    reference = run(load(tmp_path / "reference", "train.steps=8", "optimizer.decay_steps=8"))
    first = run(load(tmp_path / "run", "train.steps=4", "optimizer.decay_steps=8"))
    lines = []
    second = train(load(tmp_path / "run", "train.steps=8", "optimizer.decay_steps=8"), console=Console(log=lines.append))
    assert second.first_step == 4
    assert first.losses + second.losses == reference.losses
    assert not any("schedule" in line for line in lines)  # the schedule is the checkpoint's


@pytest.mark.slow
def test_resume_that_moves_the_end_of_the_lr_schedule_says_so_in_one_line(tmp_path):
    run(load(tmp_path / "run", "train.steps=2"))
    lines = []
    train(load(tmp_path / "run", "train.steps=3"), console=Console(log=lines.append))
    changes = [line for line in lines if "schedule" in line]
    assert len(changes) == 1
    assert "optimizer.decay_steps 2 -> 3" in changes[0] and "train.steps" in changes[0]
    assert "step 3 gets lr" in changes[0]


# A run that a signal stops; each compiles its step (no cache), so the start-up is as long as the reference's.
SIGNALLED = ("train.steps=1000", "checkpoint.every=0", "run.compile_cache=null")


def _stopped_at(run_dir: Path, delay: float, signum: int) -> tuple[int, str, float]:
    """Runs `nestor train` (the tiny model), sends `signum` `delay` seconds after its start; returns its exit
    code, everything it printed, and how many seconds after the signal it printed the compile's end
    (negative: before it; inf: never)."""
    process = cli(run_dir, *SIGNALLED)
    compiled_at, printed = [], {"stdout": [], "stderr": []}

    def read(stream, lines):
        for line in stream:
            if line.startswith("compiled in"):
                compiled_at.append(time.monotonic())
            lines.append(line)

    readers = [threading.Thread(target=read, args=(getattr(process, name), lines), daemon=True)
               for name, lines in printed.items()]
    for reader in readers:
        reader.start()
    time.sleep(delay)
    signalled = time.monotonic()
    process.send_signal(signum)
    try:
        process.wait(120)
    finally:
        process.kill()  # a no-op once it has ended
    for reader in readers:
        reader.join(30)
    return (process.returncode, "".join(printed["stdout"] + printed["stderr"]),
            compiled_at[0] - signalled if compiled_at else math.inf)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_signal_at_any_moment_of_start_up_and_compile_stops_the_run_with_one_line(tmp_path):
    # Once the interpreter has started the CLI (0.5 s leaves it time), up to the first step: loading the config,
    # importing jax, building the mesh, the compile. It was swallowed near "compiling" (the run went on).
    reference = cli(tmp_path / "reference", *SIGNALLED)
    started, compiled = time.monotonic(), None
    for line in reference.stdout:
        if line.startswith("compiled in"):
            compiled = time.monotonic() - started
            reference.send_signal(signal.SIGINT)
            break
    _, err = ended(reference, 120)
    assert reference.returncode == 128 + signal.SIGINT and compiled, err[-3000:]
    stop_lines = re.compile(r"^(nestor: interrupted|stopped by SIGINT)", re.M)
    before_the_first_step, last_before = 0, 0.5
    # 10 moments spread from the interpreter's start to late in the compile, each a process of its own
    moments = list(np.linspace(0.5, 0.85 * compiled, 10))
    for index in range(10):
        delay = moments.pop(0)
        code, printed, compiled_after = _stopped_at(tmp_path / f"run{index}", float(delay), signal.SIGINT)
        assert code == 128 + signal.SIGINT and "Traceback" not in printed, (delay, printed[-3000:])
        assert len(stop_lines.findall(printed)) == 1, (delay, printed[-3000:])
        trained = "step     1" in printed
        # a signal during the compile stops the run before step 1 (0.25 s: the line's way through the pipe)
        assert compiled_after < 0.25 or not trained, (delay, compiled_after, printed[-3000:])
        saved = list((tmp_path / f"run{index}").glob("checkpoints/*"))
        assert bool(saved) == trained, (delay, printed[-3000:])  # nothing trained is saved; nothing trained lost
        before_the_first_step += not trained
        if trained:  # a start-up faster than the reference's (a load that eased): the rest move below this moment
            moments = list(np.linspace(last_before, delay, len(moments) + 2)[1:-1])
        else:
            last_before = delay
    assert before_the_first_step >= 5
    code, printed, _ = _stopped_at(tmp_path / "terminated", min(0.8 * compiled, last_before), signal.SIGTERM)
    assert code == 128 + signal.SIGTERM and "Traceback" not in printed, printed[-3000:]
    assert len(re.findall(r"^(nestor: terminated \(SIGTERM\)|stopped by SIGTERM)", printed, re.M)) == 1, printed
