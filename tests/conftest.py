"""Tests run on 8 simulated CPU devices; the flag must be set before jax starts."""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # test this checkout, whatever is installed

import jax  # noqa: E402
import pytest  # noqa: E402

from orchestrator import config as config_lib  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


TINY = ("model.preset=tiny", "train.steps=5", "train.global_batch=16", "train.seq_len=32", "optimizer.warmup_steps=2")


@pytest.fixture
def tiny_config(tmp_path):
    """Returns a loader: tiny_config(*overrides) -> Config for the tiny model in a temp run dir."""

    def make(*overrides: str, **dotted):
        config = config_lib.load(None, [*TINY, f"run.dir={tmp_path / 'run'}", *overrides])
        return config.replace(**dotted) if dotted else config

    return make


def pytest_collection_modifyitems(items):
    """Groups the tests for pytest-xdist's `--dist loadgroup` (the README runs 2 workers): every test
    that starts processes of its own (a Ray cluster, jax.distributed peers) in one group, so no two
    clusters run at once and a test that checks for leftover Ray daemons sees only its own; every
    other test with the rest of its file, so a module's shared fixture (a reference run, a compiled
    step) is built once."""
    for item in items:
        starts_processes = item.get_closest_marker("ray") or item.get_closest_marker("multiprocess")
        item.add_marker(pytest.mark.xdist_group("processes" if starts_processes else item.module.__name__))
