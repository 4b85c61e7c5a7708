"""Goodput: every second of a run's wall clock in one category, in goodput.jsonl, metrics.jsonl, TensorBoard and
`nestor goodput`, across a SIGKILL and its resume."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nestor.orchestrator.checkpoint.files import checkpoint_dir, finalized_steps
from nestor.orchestrator.commands.cli import main
from nestor.cluster.interrupts import Interrupted
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.loop.goodput import (ATTEMPT_CATEGORIES, CONFIG_ERROR, FILE_NAME, RUN_CATEGORIES, USER_STOP,
                                              Goodput, ending, read_records, report, run_goodput, summary_line, total)
from nestor.orchestrator.loop.metrics import tensorboard_tag
from nestor.orchestrator.loop.console import Console
from nestor.orchestrator.loop.train import train
from tests.settings import ROOT
from tests.helpers import child_env
from tests.test_checkpoint import cli
from tests.test_metrics import read_events


def record(event: str, attempt: int, at_step: int, elapsed: float, **seconds) -> dict:
    """A goodput.jsonl record at `at_step` whose unnamed categories are idle: its seconds add up to `elapsed`."""
    seconds = {name: seconds.get(name, 0.0) for name in ATTEMPT_CATEGORIES}
    seconds["idle"] = elapsed - sum(seconds.values())
    return {"event": event, "attempt": attempt, "step": at_step, "elapsed_s": elapsed, "seconds": seconds}


def start(attempt: int, time_: float, resumed_from: int, elapsed: float = 1.0) -> dict:
    return {**record("start", attempt, resumed_from, elapsed, restore=elapsed), "time": time_,
            "resumed_from": resumed_from}


# Attempt 1 starts at t=1000, saves at step 10 and is killed after logging step 12 (t=1017); attempt 2 starts
# at t=1020 from checkpoint 10 and completes step 20 at t=1032.
KILLED_THEN_RESUMED = [
    start(1, 1000.0, 0),
    record("log", 1, 5, 10.0, restore=1.0, compile=4.0, step=3.0),
    record("log", 1, 10, 15.0, restore=1.0, compile=4.0, step=7.0, checkpoint_save=0.5),
    record("log", 1, 12, 17.0, restore=1.0, compile=4.0, step=8.5, checkpoint_save=0.5),
    start(2, 1020.0, 10, elapsed=2.0),
    record("log", 2, 20, 11.0, restore=2.0, compile=3.0, step=5.0),
    {**record("end", 2, 20, 12.0, restore=2.0, compile=3.0, step=5.0, checkpoint_save=1.0), "ended": "completed"},
]


def test_killed_attempt_loses_its_steps_past_the_resume_and_the_gap_is_recovery():
    first, second = run_goodput(KILLED_THEN_RESUMED)
    assert (first.resumed_from, first.last_step, first.ended) == (0, 12, "killed")
    assert first.seconds["lost"] == pytest.approx(1.5)  # steps 11..12: 8.5 - 7.0 s
    assert first.seconds["step"] == pytest.approx(7.0)
    assert first.seconds["recovery"] == pytest.approx(3.0)  # t=1017 to t=1020
    assert (second.seconds["lost"], second.seconds["recovery"], second.ended) == (0.0, 0.0, "completed")
    run = total([first, second])
    assert run.wall == pytest.approx(1032.0 - 1000.0)  # first start to last record, every second in one category
    assert run.seconds["step"] == pytest.approx(12.0) and run.goodput == pytest.approx(12.0 / 32.0)
    assert (run.resumed_from, run.last_step) == (0, 20)


def test_a_gap_after_an_attempt_the_user_ended_is_a_pause_and_after_sigterm_or_a_failure_recovery():
    def two_attempts(ended: str):
        return run_goodput([start(1, 0.0, 0), {**record("end", 1, 10, 5.0, step=4.0), "ended": ended},
                            start(2, 100.0, 10), record("log", 2, 20, 3.0, step=2.0)])

    # completed, Ctrl-C, `nestor stop` (its driver's SIGTERM), a config error or the user's code's: the user's time
    for ended in ("completed", "SIGINT", f"{USER_STOP}SIGTERM", f"{CONFIG_ERROR}ConfigError",
                  f"{CONFIG_ERROR}KeyError"):
        first, second = two_attempts(ended)
        assert (first.seconds["recovery"], first.paused_after) == (0.0, 95.0), ended
        assert total([first, second]).wall == pytest.approx(5.0 + 3.0)
    # preemption, or a failure: the time until the restart is the run's
    for ended in ("SIGTERM", "error: TrainingDiverged", "error: RuntimeError"):
        first, second = two_attempts(ended)
        assert (first.seconds["recovery"], first.paused_after, first.seconds["lost"]) == (95.0, 0.0, 0.0), ended
        assert total([first, second]).wall == pytest.approx(100.0 + 3.0)


def raised(error: BaseException, in_file: Path | None = None) -> BaseException:
    """Returns `error` raised and caught, from code in `in_file` when given (a user's module), else from here."""
    try:
        if in_file is None:
            raise error
        in_file.write_text("def fail(error):\n    raise error\n")
        namespace: dict = {}
        exec(compile(in_file.read_text(), str(in_file), "exec"), namespace)
        namespace["fail"](error)
    except BaseException as caught:  # noqa: BLE001 - the test's own
        return caught
    raise AssertionError("not raised")


def test_an_attempt_ends_in_a_config_error_as_the_cli_says_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the user's code is what runs from the directory nestor runs in
    assert ending(raised(ConfigError([("data.paths", "no such directory")]))) == "config error: ConfigError"
    assert ending(raised(KeyError("tokens"), tmp_path / "model.py")) == "config error: KeyError"
    assert ending(raised(KeyError("tokens"))) == "error: KeyError"  # nestor's own (a test file is no user's here)
    assert ending(raised(KeyboardInterrupt())) == "SIGINT"
    assert ending(raised(Interrupted(signal.SIGTERM))) == "SIGTERM"


def test_the_gap_after_a_config_error_or_a_launchers_stop_is_a_pause_in_goodput_jsonl(tmp_path):
    # A config error after the start record (a user's model failing at its first trace, a data file at its
    # first batch) charged the user's editing time to recovery: 387 s of it, and 0.1% goodput.
    def attempt(at: float, body) -> Goodput:
        goodput = Goodput()
        goodput.started_wall = at
        goodput.start(tmp_path, 0, enabled=True, log=print)
        body(goodput)
        return goodput

    def config_error(goodput: Goodput) -> None:
        with pytest.raises(ConfigError), goodput.ending_on_error():
            raise ConfigError([("model.class", "your code raised KeyError")])

    attempt(1000.0, config_error)
    attempt(2000.0, lambda goodput: goodput.end(signal.SIGTERM, by_launcher=True))
    attempt(3000.0, lambda goodput: goodput.end(None))
    records = read_records(tmp_path / FILE_NAME)
    assert [r["ended"] for r in records if r["event"] == "end"] == [
        "config error: ConfigError", "stopped by its launcher: SIGTERM", "completed"]
    attempts = run_goodput(records)
    assert [a.seconds["recovery"] for a in attempts] == [0.0, 0.0, 0.0]
    assert [round(a.paused_after) for a in attempts] == [1000, 1000, 0]
    assert total(attempts).wall < 1.0 and "paused between attempts" in report(attempts)


def test_steps_past_the_lowest_later_resume_are_lost_even_across_attempts():
    records = [start(1, 0.0, 0), record("log", 1, 5, 6.0, step=4.0), record("log", 1, 10, 10.0, step=8.0),
               start(2, 11.0, 10), record("log", 2, 15, 5.0, step=4.0),  # diverged: checkpoint 10 set aside
               {**record("end", 2, 15, 5.0, step=4.0), "ended": "error: TrainingDiverged"},
               start(3, 20.0, 5), record("log", 3, 6, 2.0, step=1.0)]
    first, second, third = run_goodput(records)
    assert first.seconds["lost"] == pytest.approx(4.0)  # steps 6..10, run again by attempt 3: 8 - 4 s
    assert second.seconds["lost"] == pytest.approx(4.0)  # all of it: it started past step 5
    assert (first.seconds["recovery"], second.seconds["recovery"]) == pytest.approx((1.0, 4.0))
    assert second.ended == "error: TrainingDiverged" and third.ended == "no end record: killed, or running"
    assert total([first, second, third]).wall == pytest.approx(20.0 + 2.0)


def test_a_line_cut_short_by_a_kill_is_skipped_and_a_missing_file_has_no_attempt(tmp_path):
    path = tmp_path / FILE_NAME
    path.write_text("".join(json.dumps(r) + "\n" for r in KILLED_THEN_RESUMED[:3]) + '{"event": "log", "att')
    said = []
    assert read_records(path, said.append) == KILLED_THEN_RESUMED[:3]
    assert len(said) == 1 and "left out its last line of 21 bytes" in said[0]
    assert read_records(tmp_path / "nowhere" / FILE_NAME) == [] and run_goodput([]) == []


def test_the_writer_cuts_a_torn_last_line_off_so_that_its_next_record_is_whole(tmp_path):
    path = tmp_path / FILE_NAME
    whole = "".join(json.dumps(r) + "\n" for r in KILLED_THEN_RESUMED[:3])
    path.write_bytes(whole.encode() + b"\xff\x00{oops\n" + b'{"event": "log", "att')
    said = []
    assert read_records(path, said.append, cut=True) == KILLED_THEN_RESUMED[:3]
    assert said == [f"warning: {path}: left out line 4 (not a JSON record); cut off its last line of 21 bytes, "
                    "which a write that stopped (a kill, a full disk) cut short"]
    with path.open("a") as f:
        f.write(json.dumps(KILLED_THEN_RESUMED[3]) + "\n")
    assert read_records(path, said.append) == KILLED_THEN_RESUMED[:4] and len(said) == 2  # line 4 said again


def test_nested_charges_add_up_to_the_elapsed_time():
    goodput = Goodput()
    with goodput.charged("step"):
        time.sleep(0.02)
        with goodput.charged("data_wait"):
            time.sleep(0.01)
        time.sleep(0.01)
    seconds = goodput.seconds()
    assert seconds["data_wait"] == pytest.approx(0.01, abs=0.008) and seconds["step"] >= 0.03
    assert sum(seconds.values()) == pytest.approx(time.perf_counter() - goodput.started, abs=1e-3)


def test_goodput_of_a_run_without_goodput_jsonl_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["goodput", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"{tmp_path / FILE_NAME} does not exist" in err


GOODPUT_METRICS = ("goodput_fraction", *(f"goodput_{name}" for name in RUN_CATEGORIES))


def test_a_run_in_process_charges_its_whole_wall_time_and_logs_it(tiny_config):
    config = tiny_config("train.steps=4", "checkpoint.every=2")
    lines = []
    began = time.perf_counter()
    train(config, console=Console(log=lines.append))
    wall = time.perf_counter() - began
    run_dir = Path(config.run.dir)
    records = read_records(run_dir / FILE_NAME)
    end = records[-1]
    assert [r["event"] for r in records] == ["start", "log", "log", "log", "log", "end"]
    assert end["ended"] == "completed" and end["step"] == 4
    assert sum(end["seconds"].values()) == pytest.approx(end["elapsed_s"], abs=1e-3)
    # train() also releases run.dir's lock and its signal handlers after the end record: up to 0.1 s on a
    # loaded 2-core host (0.06 s in a CI run), beyond 2% of this short run
    assert sum(end["seconds"].values()) == pytest.approx(wall, abs=0.02 * wall + 0.1)
    assert all(end["seconds"][name] > 0 for name in ("step", "compile", "data_wait", "checkpoint_save", "restore"))
    [attempt] = run_goodput(records)
    assert lines[-1] == summary_line([attempt]) and attempt.seconds["lost"] == attempt.seconds["recovery"] == 0

    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for metrics, written in zip(logged, records[1:-1]):  # each logged step's record holds goodput.jsonl's numbers
        assert all(metrics[f"goodput_{name}"] == written["seconds"][name] for name in ATTEMPT_CATEGORIES)
        assert metrics["goodput_fraction"] == pytest.approx(written["seconds"]["step"] / written["elapsed_s"],
                                                            rel=1e-3)
    events = read_events(run_dir / "tb")
    for name in GOODPUT_METRICS:
        assert tensorboard_tag(name) == "goodput/" + name.removeprefix("goodput_")
        np.testing.assert_allclose([e.value for e in events.Scalars(tensorboard_tag(name))],
                                   [metrics[name] for metrics in logged], rtol=1e-6)


def test_a_stop_that_its_launcher_asked_for_ends_the_attempt_as_the_users(tiny_config):
    config = tiny_config("train.steps=4")
    result = train(config, console=Console.silent(), stop_requested=lambda now=False: signal.SIGTERM)
    assert result.stopped_by == signal.SIGTERM and not result.losses  # stopped before its first step
    records = read_records(Path(config.run.dir) / FILE_NAME)
    assert [r["event"] for r in records] == ["start", "end"] and records[-1]["ended"] == f"{USER_STOP}SIGTERM"


def printed_rows(text: str) -> dict[str, list[str]]:
    """Returns `nestor goodput`'s table rows by their first cell: steps, the categories' seconds, wall."""
    rows = [line.split() for line in text.splitlines()[1:] if line.split() and line.split()[0] in ("1", "2", "run")]
    return {cells[0]: cells[1:3 + len(RUN_CATEGORIES)] for cells in rows}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_killed_after_a_checkpoint_and_resumed_sums_to_its_wall_time_and_the_cli_says_so(tmp_path):
    overrides = ("train.steps=20", "checkpoint.every=10")
    run_dir = tmp_path / "run"
    began = time.time()
    first = cli(run_dir, *overrides)
    goodput_file = run_dir / FILE_NAME
    saved = checkpoint_dir(run_dir) / "10" / "_CHECKPOINT_METADATA"
    while not (saved.exists() and any(r["event"] == "log" and r["step"] >= 12 for r in read_records(goodput_file))):
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.005)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert finalized_steps(checkpoint_dir(run_dir)) == [10], "the run got past step 19 before the kill"

    second = cli(run_dir, *overrides)
    out, err = second.communicate(timeout=240)
    ended = time.time()
    assert second.returncode == 0, err[-3000:]
    records = read_records(goodput_file)
    attempts = run_goodput(records)
    killed, resumed = attempts
    assert (killed.ended, resumed.resumed_from, resumed.ended) == ("killed", 10, "completed")
    assert killed.last_step >= 12 and killed.seconds["lost"] > 0 and killed.seconds["recovery"] > 0
    run = total(attempts)
    starts = [r for r in records if r["event"] == "start"]
    first_to_end = starts[-1]["time"] + records[-1]["elapsed_s"] - starts[0]["time"]
    assert began <= starts[0]["time"] and starts[-1]["time"] + records[-1]["elapsed_s"] <= ended
    assert run.wall == pytest.approx(first_to_end, rel=0.02)
    assert summary_line(attempts) in out.splitlines()  # the run's end says what `nestor goodput` says

    shown = subprocess.run([sys.executable, "-m", "nestor.orchestrator.commands.cli", "goodput", str(run_dir)], cwd=ROOT,
                           env=child_env(), capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == report(attempts)
    rows = printed_rows(shown.stdout)
    for name, share in (("1", killed), ("2", resumed), ("run", run)):
        assert rows[name][0] == f"{share.resumed_from}..{share.last_step}"
        assert [float(cell) for cell in rows[name][1:]] == pytest.approx(
            [share.seconds[category] for category in RUN_CATEGORIES] + [share.wall], abs=0.005 + 1e-9)
    assert sum(float(cell) for cell in rows["run"][1:-1]) == pytest.approx(float(rows["run"][-1]), abs=0.05)
