"""The errors nestor reports to the user as themselves, in a module of its own: light enough for processes
that never touch JAX (the workers of `nestor data prepare`). Every module imports ConfigError from here
(tests/test_imports.py)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config a user wrote is wrong; `problems` holds (key path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        lines = [f"  {key}: {message}" for key, message in self.problems]
        super().__init__("invalid config:\n" + "\n".join(lines))

    def __reduce__(self):
        # Ray ships a worker's exception to the driver by pickling it.
        return ConfigError, (self.problems,)


class RunFailed(RuntimeError):
    """A run stopped for a reason its message tells in full; the CLI prints `headline` + message as one
    line and exits 1."""

    headline = ""
