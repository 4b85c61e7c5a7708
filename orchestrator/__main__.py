"""`python -m nestor.orchestrator ...` is `nestor ...` (the entrypoint of submitted jobs)."""

import sys

from nestor.orchestrator.commands.cli import console_script

sys.exit(console_script())
