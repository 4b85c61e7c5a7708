"""Can this Python run nestor? Asked before anything heavy is imported, with the standard library only.

A job submitted to a Ray cluster runs `python` from the PATH of the cluster's
head; when that is not the Python nestor is installed in, the user should
read one line saying so, not an import traceback.
"""

from __future__ import annotations

import importlib.util
import socket
import sys

# Import names of the distributions pyproject.toml asks for.
REQUIRED = ("jax", "flax", "optax", "orbax.checkpoint", "ray", "yaml", "numpy", "tensorboardX", "rich")


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:  # the parent of a dotted name is missing
        return True


def check_dependencies(required: tuple[str, ...] = REQUIRED) -> str | None:
    """Returns one line naming the modules this Python cannot import (None when all are there)."""
    missing = [name for name in required if _missing(name)]
    if not missing:
        return None
    return (f"this Python ({sys.executable} on {socket.gethostname()}) cannot import {', '.join(missing)}: "
            "install nestor into it (pip install -e . in the project), or run nestor with the Python that has "
            "it; for a Ray cluster, start `ray start` from that environment (docs/cluster.md, 'A Ray head on "
            "this machine')")
