"""The first line of `nestor train` under the Ray launcher, said before anything heavy is imported: the config's
checks import jax, which takes seconds on a busy machine."""

from __future__ import annotations

import os
from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def starting_line(hosts: int, devices_per_host: int, accelerator: str, address: str | None) -> str:
    """Returns the line that says where a run's workers start."""
    where = f"the Ray cluster at {address}" if address else (
        "the Ray job's cluster" if os.environ.get("RAY_ADDRESS") else "a local Ray cluster on 127.0.0.1")
    return f"starting {hosts} worker process(es) x {devices_per_host} {accelerator} device(s) on {where}"


def early_starting_line(config_path: str, overrides: list[str]) -> str | None:
    """Returns `starting_line` for a run from the `cluster` keys of base.yaml, CONFIG, its YAML layers and its
    overrides, read as plain YAML; None for a run not under the Ray launcher, or keys that need the config's
    checks to read (which then say what is wrong, and the line comes after them)."""
    from nestor.orchestrator.config.schema import ClusterConfig
    from nestor.orchestrator.config.yaml_files import override_value, read_yaml
    from nestor.orchestrator.errors import ConfigError

    try:
        layers = [CONFIGS_DIR / "base.yaml", Path(config_path)]
        layers += [Path(item) for item in overrides if "=" not in item and item.endswith((".yaml", ".yml"))]
        cluster: dict = {}
        for layer in layers:
            section = read_yaml(layer, str(layer)).get("cluster") or {}
            if not isinstance(section, dict):
                return None
            cluster.update(section)
        for item in overrides:
            key, equals, text = item.partition("=")
            key = key.strip()
            if not equals or not key.startswith("cluster"):
                continue
            if not key.startswith("cluster."):
                return None  # the whole section at once
            cluster[key.removeprefix("cluster.")] = override_value(text, key)
    except (ConfigError, OSError):
        return None
    defaults = ClusterConfig()
    launcher, hosts, devices, accelerator, address = (cluster.get(name, getattr(defaults, name)) for name in (
        "launcher", "hosts", "devices_per_host", "accelerator", "address"))
    if launcher != "ray" or not all(isinstance(n, int) and not isinstance(n, bool) for n in (hosts, devices)) \
            or accelerator not in ("cpu", "gpu", "tpu") or not (address is None or isinstance(address, str)):
        return None
    return starting_line(hosts, devices, accelerator, address)
