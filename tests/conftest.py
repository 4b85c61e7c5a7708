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
