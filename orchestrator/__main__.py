"""`python -m orchestrator ...` is `nestor ...` (the entrypoint of submitted jobs)."""

import sys

from orchestrator.cli import console_script

sys.exit(console_script())
