"""Shared pieces of the tests: train on a mesh, compare runs."""

from __future__ import annotations

import tempfile

import jax
import numpy as np

from orchestrator.config import Config
from orchestrator.progress import Console
from orchestrator.train import TrainResult, train

# The meshes the foundation is tested on (tensor4 needs 4 kv heads).
TESTED_MESHES = {
    "data8": dict(data=8),
    "fsdp8": dict(fsdp=8),
    "fsdp4_tensor2": dict(fsdp=4, tensor=2),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "tensor4_data2": dict(tensor=4, data=2),
}

ONE_DEVICE = {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "mesh.expert": 1, "mesh.pipeline": 1,
              "cluster.devices_per_host": 1}


def mesh_overrides(**degrees: int) -> dict:
    """Returns dotted overrides for a mesh given as e.g. data=2, fsdp=2, tensor=2 (others 1)."""
    dotted = {f"mesh.{axis}": 1 for axis in ("data", "fsdp", "tensor", "expert", "pipeline")}
    dotted.update({f"mesh.{axis}": size for axis, size in degrees.items()})
    return dotted


def run(config: Config) -> TrainResult:
    """Trains quietly in config.run.dir (resuming from a checkpoint there); returns the result."""
    return train(config, console=Console.silent())


def run_fresh(config: Config) -> TrainResult:
    """Trains quietly from scratch in a new run dir, so no other run's checkpoint is resumed."""
    return run(config.replace(**{"run.dir": tempfile.mkdtemp(prefix="nestor-run-")}))


def assert_same_training(result: TrainResult, reference: TrainResult, loss_rtol=1e-5, param_tol=1e-4) -> None:
    """Asserts equal losses (rtol) and final parameters (abs + rel tolerance) of two runs."""
    np.testing.assert_allclose(result.losses, reference.losses, rtol=loss_rtol)
    got = jax.tree.map(np.asarray, result.state["params"])
    want = jax.tree.map(np.asarray, reference.state["params"])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=param_tol, atol=param_tol, err_msg=jax.tree_util.keystr(path))
