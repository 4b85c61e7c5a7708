"""The training job: config -> state -> step -> loop, data, checkpoints, metrics and the `nestor` CLI. The
only room that imports the others (backend, models, parallel, cluster).

Its rooms, bottom up, each a folder whose `__init__` says what it holds and which of the others it may
import (tests/test_imports.py holds every import to it, TYPE_CHECKING ones included):
- the modules here ("root"): `errors` (ConfigError and the failures a run reports in one line), `paths`
  (how a path is shown), `user_code` (importing the user's `module:Name`); `__main__` runs commands.cli;
- `config`: the pure schema of a run's keys; `specs`: what the job asks of a model;
- `data`: the input; `hf`: Hugging Face checkpoints in;
- `loader`: a config from files and overrides, validated;
- `job`: the state, the step and the processes that run them;
- `checkpoint`: saving and restoring; `loop`: training, watched;
- `evaluation`: held-out loss commands and sampling; `planning`: `nestor plan`, the layout searched for;
- `commands`: the CLI and what it runs.

Orchestrator rooms it may import: none (`__main__`, the entry point, runs commands.cli).
"""
