"""Paths as nestor prints them: relative to the directory the user ran `nestor` in when they lie under it.

The config resolves every path to an absolute one at load (workers never see
a relative path), but the user typed `run.dir=runs/a` and reads
`runs/a/checkpoints` best. Under Ray the lines are written in worker
processes, whose working directory is Ray's, not the user's: the driver
hands the user's directory to them (`orchestrator.commands.ray_driver`), and they set it
here with `show_relative_to`.
"""

from __future__ import annotations

from pathlib import Path

_user_directory: Path | None = None  # None: this process runs where the user ran nestor


def show_relative_to(directory: str | Path) -> None:
    """Makes `shown` print paths relative to `directory`, the one the user ran nestor in (a Ray worker's call)."""
    global _user_directory
    _user_directory = Path(directory)


def user_directory() -> Path:
    """Returns the directory the user ran nestor in, as this process knows it."""
    return _user_directory or Path.cwd()


def shown(path: str | Path) -> str:
    """Returns `path` relative to the user's directory when it lies inside it, else as it is."""
    try:
        return str(Path(path).relative_to(user_directory()))
    except ValueError:
        return str(path)
