"""The path a user walks: the console script, from a fresh copy of the repo, relative paths, the default launcher."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nestor.cluster.connect import USER_CODE_ENV
from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.commands.cli import parse
from tests.settings import ROOT
from tests.doc_blocks import run_block, user_env
from tests.helpers import child_env, kill_session, last_lines_of_two_processes
from tests.test_user_model import write_user_directory

NESTOR = str(Path(sys.executable).parent / "nestor")  # the console script the README's first line installs
# The README's quickstart from step 5 to 15 at most this times its loss at step 5. Its schedule does not
# depend on train.steps (optimizer.decay_steps: 100), so 5 steps then 10 more equal 15 at once.
LEARNED = 0.9


def console_script(*args: str, cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    """Runs the installed `nestor` in `cwd` with stdout a pipe (not a terminal); returns it finished."""
    return subprocess.run([NESTOR, *args], cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=timeout)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def quickstart_runs(tmp_path_factory):
    """The README's main command and its resume, run by the docs' harness exactly as written (5 steps,
    then `train.steps=150` as 15: a resume); and the reference, 15 steps at once in one process (the
    same mesh over the same 8 devices, one process instead of two Ray workers: the same numbers)."""
    first = run_block("README.md#0", tmp_path_factory)
    second = run_block("README.md#1", tmp_path_factory)
    assert "nestor train configs/quickstart.yaml train.steps=15 " in second.text.splitlines()[0]
    # Compiled afresh (no cache), so the partitioner's warnings would show on its stderr.
    reference = console_script("train", "configs/quickstart.yaml", "train.steps=15", "run.dir=runs/reference",
                               "cluster.launcher=inprocess", "run.compile_cache=null", cwd=first.clone)
    return first, second, reference


@pytest.mark.ray
@pytest.mark.timeout(1200)
def test_quickstart_twice_resumes_in_the_users_run_dir_bit_for_bit(quickstart_runs):
    first, second, reference = quickstart_runs
    for process in (first.process, second.process, reference):
        assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-3000:]
    run_dir = first.clone / "runs" / "quickstart"  # run.dir as the config writes it, relative to where nestor ran
    # Written by a Ray worker, whose working directory is Ray's: the path reads as the user's `run dir:`.
    assert "resumed from checkpoint 5 in runs/quickstart/checkpoints" in second.process.stdout.splitlines()
    # the second command found the head the first kept up (cluster.keep_head_s): no Ray start-up
    assert re.search(r"^using the local Ray head an earlier command kept up \(127\.0\.0\.1:\d+\)$",
                     second.process.stdout, re.M), second.process.stdout[:2000]
    logged = records(run_dir)
    assert [r["step"] for r in logged] == [5, 10, 15]  # configs/quickstart.yaml: train.log_every 5
    uninterrupted = records(first.clone / "runs" / "reference")
    assert [r["loss"] for r in logged] == [r["loss"] for r in uninterrupted]
    assert logged[-1]["loss"] < LEARNED * logged[0]["loss"]  # the quickstart visibly learns
    assert "Involuntary full rematerialization" not in reference.stderr  # no sharding mistake in its mesh
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    loss_tag = next(tag for tag in events.Tags()["scalars"] if tag.split("/")[-1] == "loss")
    assert [e.step for e in events.Scalars(loss_tag)] == [5, 10, 15]


@pytest.mark.ray
@pytest.mark.timeout(1200)
def test_main_job_prints_one_clean_stream_off_a_terminal(quickstart_runs):
    first = quickstart_runs[0].process
    lines = first.stdout.splitlines()
    assert "Gloo" not in first.stdout + first.stderr
    assert "\x1b" not in first.stdout + first.stderr  # no ANSI escapes when stdout is not a terminal
    assert len(lines) == len(set(lines)), "a line printed twice"
    assert "compiling the train step ..." in lines and any(re.fullmatch(r"compiled in \d+\.\d s", l) for l in lines)
    assert "run dir: runs/quickstart  (config.yaml, metrics.jsonl, goodput.jsonl, checkpoints/, tb/)" in lines
    written = {path.name for path in (quickstart_runs[0].clone / "runs" / "quickstart").iterdir()}
    assert {"config.yaml", "metrics.jsonl", "goodput.jsonl", "checkpoints", "tb"} <= written  # each one named
    assert "ray" not in written  # Ray keeps nothing of its own there
    assert any(l.startswith("TensorBoard: ") and l.endswith("--logdir runs/quickstart/tb") for l in lines)
    assert sum(l.startswith("step ") for l in lines) == 1 and len(lines) <= 15, first.stdout
    # a line for each start-up phase, and the whole run's time beside the steps'
    assert lines[0] == "starting 2 worker process(es) x 4 cpu device(s) on a local Ray cluster on 127.0.0.1"
    assert lines[1] == "starting a local Ray head on 127.0.0.1" or re.fullmatch(
        r"using the local Ray head an earlier command kept up \(127\.0\.0\.1:\d+\)", lines[1]), lines[1]
    assert re.fullmatch(r"Ray is up \(\d+ s\); starting 2 worker process\(es\)", lines[2]), lines[2]
    assert re.fullmatch(r"2 worker process\(es\) joined jax.distributed, 8 devices \(\d+ s\)", lines[3]), lines[3]
    assert "Ray: the local head stays up 600 s for the next command (nestor stop-head ends it now)" in lines
    assert any(re.fullmatch(r"the whole run took \d+ s, from the command to its last save", l) for l in lines)
    assert first.stderr.strip() == "", first.stderr[-2000:]
    assert "CheckpointManager" not in first.stdout  # no Orbax INFO chatter


@pytest.mark.ray
@pytest.mark.timeout(1200)
def test_main_job_keeps_the_auth_token_out_of_output_and_run_dir(quickstart_runs):
    first = quickstart_runs[0]
    token_file = Path.home() / ".ray" / "auth_token"
    assert token_file.exists(), "Ray's token auth is on by default and writes this file"
    token = token_file.read_text().strip()
    assert len(token) >= 32 and token not in first.process.stdout + first.process.stderr
    written = [p.read_bytes() for p in (first.clone / "runs" / "quickstart").rglob("*") if p.is_file()]
    assert written and not any(token.encode() in content for content in written)


def test_relative_paths_resolve_against_the_directory_nestor_runs_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = config_lib.load(None, ["run.dir=runs/a", "data.paths=[corpus/*.txt]", "data.tokenizer=tok.json",
                                    "run.compile_cache=~/cache"])
    assert config.run.dir == str(tmp_path / "runs" / "a")
    assert config.data.paths == (str(tmp_path / "corpus" / "*.txt"),)
    assert config.data.tokenizer == str(tmp_path / "tok.json")
    assert config.run.compile_cache == str(Path.home() / "cache")
    assert config_lib.load(None, ["run.dir=/abs/run"]).run.dir == "/abs/run"


@pytest.mark.parametrize("argv", [
    ["submit", "configs/quickstart.yaml", "--address", "http://127.0.0.1:8265", "train.steps=20", "--follow"],
    ["submit", "configs/quickstart.yaml", "train.steps=20", "--address", "http://127.0.0.1:8265", "--follow"],
    ["submit", "--follow", "configs/quickstart.yaml", "--address", "http://127.0.0.1:8265", "train.steps=20"],
])
def test_overrides_may_follow_options(argv):
    args = parse(argv)
    assert (args.config, args.overrides, args.follow) == ("configs/quickstart.yaml", ["train.steps=20"], True)


def test_an_unknown_option_is_still_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(["train", "configs/quickstart.yaml", "--steps", "20"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --steps" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_python_without_the_dependencies_says_so_in_one_line():
    # -S: no site-packages, as a cluster's system Python without nestor installed.
    process = subprocess.run([sys.executable, "-S", "-m", "nestor.orchestrator", "train", "configs/quickstart.yaml"],
                             cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=60)
    assert process.returncode == 1
    assert process.stderr.count("\n") == 1 and "cannot import jax" in process.stderr, process.stderr
    assert process.stderr.startswith("nestor: this Python (") and "Traceback" not in process.stderr


SHARED_RUN_DIR_CHECK = """
    from nestor.cluster.rendezvous import ClusterError
    from nestor.orchestrator.job.processes import check_shared_run_dir
    try:
        check_shared_run_dir(Path(run_dir))
        print("shared")
    except ClusterError as error:
        print(error)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_wheel_install_reads_base_yaml_and_the_presets(tmp_path):
    # `pip install .` without -e, as docs/cluster.md's image and the cluster manifests install nestor:
    # base.yaml and the presets must be in the wheel, beside the packages, where orchestrator.loader.config
    # looks. They were not, and every command failed on "base.yaml: file not found".
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "runs", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "wheel"),
                    str(source)], check=True, timeout=240, capture_output=True)
    [wheel] = (tmp_path / "wheel").glob("nestor-*.whl")
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    # one top-level package: installing nestor claims no generic name (models, parallel, configs)
    assert sorted(path.name for path in (tmp_path / "site").iterdir()) == ["nestor", wheel.name.split("-py")[0]
                                                                          + ".dist-info"]
    # every room and every package inside one (orchestrator/specs, /hf, ...): pyproject.toml lists them by hand
    site = tmp_path / "site" / "nestor"
    packaged = {path.parent.relative_to(site).as_posix() for path in site.rglob("*/__init__.py")}
    rooms = [path.parent for path in ROOT.glob("*/__init__.py") if path.parent.name not in ("tests", "bench", "nestor")]
    assert packaged == {path.parent.relative_to(ROOT).as_posix() for room in rooms for path in room.rglob("__init__.py")}
    user = tmp_path / "user"
    user.mkdir()
    (user / "mine.yaml").write_text("model:\n  preset: llama3-8b\nmesh:\n  fsdp: 8\n")
    code = ("from nestor.orchestrator.loader import config; mine = config.load('mine.yaml'); "
            "print(config.__file__, mine.model.embed_dim, mine.mesh.fsdp, *config.presets())")
    env = user_env() | {"PYTHONPATH": str(tmp_path / "site")}
    shown = subprocess.run([sys.executable, "-c", code], cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    where, embed, fsdp, *names = shown.stdout.split()
    assert Path(where).is_relative_to(tmp_path / "site")  # the wheel's modules, not this checkout's
    assert (embed, fsdp) == ("4096", "8")
    assert names == sorted(path.stem for path in (ROOT / "configs/models").glob("*.yaml"))
    generic = subprocess.run([sys.executable, "-c", "import models"], cwd=user, env=env, capture_output=True,
                             text=True, timeout=60)
    assert generic.returncode == 1 and "No module named 'models'" in generic.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hosts_that_do_not_share_run_dir_fail_naming_the_process(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    assert last_lines_of_two_processes(SHARED_RUN_DIR_CHECK, [shared, shared]) == ["shared", "shared"]
    assert list(shared.iterdir()) == []  # the marker is removed
    # Two processes on one machine see one file system; different directories play two hosts' disks.
    own = [tmp_path / "host0", tmp_path / "host1"]
    for path in own:
        path.mkdir()
    for message in last_lines_of_two_processes(SHARED_RUN_DIR_CHECK, own):  # every process stops, with the same diagnosis
        assert re.search(r"not the same directory on every host: process 1 on \S+ cannot see", message), message
        assert "process 0 on" not in message


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_bad_data_path_and_a_misfit_checkpoint_are_refused_before_ray_starts_and_write_nothing(tmp_path):
    import hashlib

    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    started = time.monotonic()
    bad = console_script("train", "configs/quickstart.yaml", "data.source=tokens", "data.paths=[runs/nothere]",
                         "run.dir=runs/bad", cwd=tmp_path)
    assert bad.returncode == 2 and "data.paths" in bad.stderr and "runs/nothere" in bad.stderr, bad.stderr[-2000:]
    assert time.monotonic() - started < 10 and not (tmp_path / "runs" / "bad").exists()

    tiny = ["model.preset=tiny", "train.steps=1", "run.dir=runs/tiny"]
    trained = console_script("train", "configs/quickstart.yaml", *tiny, "cluster.launcher=inprocess", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]

    def files() -> dict[str, str]:
        return {str(path): hashlib.sha256(path.read_bytes()).hexdigest()
                for path in sorted((tmp_path / "runs" / "tiny").rglob("*")) if path.is_file()}

    before, started = files(), time.monotonic()
    misfit = console_script("train", "configs/quickstart.yaml", *tiny, "train.steps=2", "model.embed_dim=128",
                            cwd=tmp_path)
    assert misfit.returncode == 2 and "model.embed_dim: is 128 but" in misfit.stderr, misfit.stderr[-2000:]
    assert time.monotonic() - started < 10 and files() == before


# What the first line must not wait for: starting Ray (about 10 s here) and what needs it. Importing jax for
# jax's import takes a second or two, more on a busy machine, so the test reads what was imported before the
# line (Python's -X importtime, in order on the merged output) rather than timing it.
# (`orbax` alone is a namespace package that checking for orbax.checkpoint imports: nothing in it.)
BEFORE_THE_FIRST_LINE_NEVER = ("ray", "tensorboard", "tensorboardX", "jax", "jaxlib", "flax", "optax",
                               "orbax.checkpoint", "numpy")


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_first_line_comes_before_jax_or_ray_is_imported_under_the_ray_launcher(tmp_path):
    """Reads up to the first line, then kills the run with what it started (the quickstart's tests above run
    it to its end)."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    started = time.monotonic()
    process = subprocess.Popen([NESTOR, "train", "configs/quickstart.yaml", "train.steps=1", "run.dir=runs/first"],
                               cwd=tmp_path, env=user_env() | {"PYTHONPROFILEIMPORTTIME": "1", "PYTHONUNBUFFERED": "1"},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        imported = []  # "import time: self [us] | cumulative | module", one line as each import ends
        while (line := process.stdout.readline()).startswith("import time:"):
            imported.append(line.rsplit("|", 1)[1].strip())
        waited = time.monotonic() - started
    finally:
        kill_session(process)
    assert line.startswith("starting 2 worker process(es)"), line
    assert "nestor.orchestrator.commands.cli" in imported and "nestor.orchestrator.loader.config" not in imported
    assert not [name for name in imported if any(name == heavy or name.startswith(f"{heavy}.")
                                                 for heavy in BEFORE_THE_FIRST_LINE_NEVER)]
    assert waited < 30, waited  # a bound for a stuck start, far above a busy machine's imports


@pytest.mark.ray
def test_an_unrelated_ray_head_outlives_every_ray_test_and_doc_block(unrelated_ray_head):
    """After test_cluster.py, test_docs.py and this file's tests above it (tests/xdist_groups.py runs the Ray files
    in order, in one process): no test, doc block or clean-up after one stopped a head it did not start (`ray
    stop` would have)."""
    from nestor.cluster.head import head_processes

    address, daemons = unrelated_ray_head
    assert len(daemons) == 2  # its GCS server and raylet, as they were when it started
    assert daemons <= {(process.pid, process.create_time()) for process in head_processes(address)}


# Bring your own model under the default launcher: `nestor train` in the user's directory starts an embedded
# Ray cluster whose workers import the user's module from there.
@pytest.mark.ray
@pytest.mark.timeout(1200)
def test_nestor_train_runs_a_users_model_under_ray_and_resumes(tmp_path):
    """`nestor train my.yaml` in the user's directory under the default launcher (an embedded Ray cluster,
    2 processes of 4 devices), then again for more steps on another mesh in one process (a resume of what
    Ray workers saved, resharded; a resume under Ray is
    test_quickstart_twice_resumes_in_the_users_run_dir_bit_for_bit's): equal to one run in one process;
    `nestor explain my.yaml` prints the parameters' layout."""
    directory = write_user_directory(tmp_path / "project")
    env = child_env()
    env.pop(USER_CODE_ENV, None)

    def nestor(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(Path(sys.executable).parent / "nestor"), "train", "my.yaml", *args],
                              cwd=directory, env=env, capture_output=True, text=True, timeout=900)

    hosts = ("cluster.hosts=2", "cluster.devices_per_host=4")
    first = nestor(*hosts, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    resharded = nestor("cluster.launcher=inprocess", "cluster.devices_per_host=8", "mesh.fsdp=4",
                       "mesh.tensor=2")  # steps 4..6 on another mesh
    assert resharded.returncode == 0 and "resumed from checkpoint 3" in resharded.stdout + resharded.stderr, (
        resharded.stderr[-3000:])
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


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_plan_measures_its_candidates_under_the_ray_launcher_the_config_names(tmp_path):
    from nestor.cluster.warm_head import stop_warm_heads, warm_heads

    out, heads = tmp_path / "plan.yaml", tmp_path / "heads"
    command = [NESTOR, "plan", "configs/quickstart.yaml", "cluster.hosts=1", "cluster.devices_per_host=8",
               "data.source=synthetic", "moe.num_experts=0", "moe.every=0", "mesh.pipeline=1", "mesh.context=1",
               "mesh.tensor=1", "model.remat=full", "train.grad_accum=1", "optimizer.shard_update=false",
               "--measure", "2", "--steps", "3", "--out", str(out)]
    try:  # the command's kept heads in a directory of this test's own
        done = subprocess.run(command, cwd=ROOT, env=dict(user_env(), NESTOR_HEADS_DIR=str(heads)),
                              capture_output=True, text=True, timeout=500)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("NESTOR_HEADS_DIR", str(heads))
            assert len(warm_heads()) == 1  # both candidates trained as Ray workers of one kept head
    finally:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("NESTOR_HEADS_DIR", str(heads))
            stop_warm_heads(wait_s=30)
    assert "measuring [1/2] 3 steps of " in done.stderr and "measuring [2/2] 3 steps of " in done.stderr
    table = done.stdout.split("measured: 2 candidates x 3 steps on the devices present, under the Ray launcher, "
                              "process 0's steps; the median step past step 1", 1)[1].splitlines()
    measured_ms = float(table[2].split()[-5])
    assert measured_ms > 0 and f"measured {table[2].split()[-5]} ms" in out.read_text().splitlines()[1]
    assert config_lib.load(str(ROOT / "configs" / "quickstart.yaml"), [str(out)]).cluster.launcher == "ray"
