"""What a stopped run leaves: a second Ctrl-C during a save leaves no step saved but unlogged, a hang during a
save leaves no temporary directory, and `nestor export --out` to a place it cannot write is one line."""

from __future__ import annotations

import json
import signal
import textwrap
from pathlib import Path

import pytest

from nestor.orchestrator.checkpoint.files import checkpoint_dir
from nestor.orchestrator.commands.cli import main
from tests.helpers import ended
from tests.test_checkpoint import BASE, cli

STEPS = ("train.steps=6", "checkpoint.every=2", "optimizer.decay_steps=6")

# `nestor train` whose save of step 4 is followed by two Ctrl-Cs, as a user pressing it twice while it saves,
# and then takes ten minutes more: the second Ctrl-C must stop it at once.
CTRL_C_TWICE = textwrap.dedent("""
    import os, signal, sys, time
    from nestor.orchestrator.checkpoint import owner
    from nestor.orchestrator.commands.cli import main

    save = owner.Checkpointer.save

    def pressed_twice(self, step, *args, **kwargs):
        saved = save(self, step, *args, **kwargs)
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(600)
        return saved

    owner.Checkpointer.save = pressed_twice
    sys.exit(main())
""")

# `nestor train` whose save of step 4 never finishes its background writes: the save of step 6 waits on it.
STUCK_SAVE = textwrap.dedent("""
    import sys, threading
    from nestor.orchestrator.checkpoint import owner
    from nestor.orchestrator.commands.cli import main

    result = owner._DoneOnceHashed.result

    def stuck(self, timeout=None):
        if self.hash_written.args[0] == 4:
            threading.Event().wait()
        return result(self, timeout)

    owner._DoneOnceHashed.result = stuck
    sys.exit(main())
""")


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_second_ctrl_c_during_a_save_stops_at_once_logs_the_saved_step_and_the_resume_leaves_no_gap(tmp_path):
    driver, run_dir = tmp_path / "twice.py", tmp_path / "run"
    driver.write_text(CTRL_C_TWICE)
    process = cli(run_dir, *STEPS, entry=(str(driver),))
    _, err = ended(process, 300)  # not the save's 600 s
    assert process.returncode == 128 + signal.SIGINT and "Traceback" not in err, err[-3000:]
    newest = max(int(p.name) for p in checkpoint_dir(run_dir).iterdir() if p.name.isdigit())
    assert newest == 4 and logged_steps(run_dir)[-1] == 4  # saved and logged together
    resumed = cli(run_dir, *STEPS)
    _, err = ended(resumed, 300)
    assert resumed.returncode == 0, err[-3000:]
    assert logged_steps(run_dir) == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_hang_during_a_save_leaves_no_temporary_checkpoint_directory(tmp_path):
    driver, run_dir = tmp_path / "stuck.py", tmp_path / "run"
    driver.write_text(STUCK_SAVE)
    process = cli(run_dir, *STEPS, "run.hang_timeout_s=5", entry=(str(driver),))
    _, err = ended(process, 300)
    assert process.returncode == 1 and "hung: waited" in err and "the save of checkpoint 6" in err, err[-3000:]
    left = sorted(p.name for p in checkpoint_dir(run_dir).iterdir())
    assert left == ["2"], left  # 4's unfinished save removed as the hung process ended


@pytest.mark.parametrize("out, says", [
    ("file", "is a file; export writes a directory"),
    ("file/below", "cannot write into"),
    ("/proc/nestor-export", "cannot write into /proc/nestor-export"),
    ("full", "holds files; export writes into a new or empty directory"),
])
def test_export_to_a_place_it_cannot_write_is_one_line(tmp_path, capsys, out, says):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model:\n  preset: tiny\n")
    (tmp_path / "file").write_text("mine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("mine")
    target = out if out.startswith("/") else str(tmp_path / out)
    assert main(["export", str(run_dir), "--to", "hf", "--out", target, *BASE]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[1] == f"  --out: {err.splitlines()[1].split('--out: ')[1]}" and says in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 2, err
