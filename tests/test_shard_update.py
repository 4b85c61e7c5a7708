"""optimizer.shard_update (ZeRO stage 1): the same training, a share of the optimizer state per device."""

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nestor.orchestrator.commands.explain import compile_step
from nestor.orchestrator.job.build import build_job, make_mesh
from nestor.orchestrator.job.state import per_device_bytes, state_layout, update_sharding
from nestor.parallel.rules import resolve_rules
from tests.helpers import assert_same_training, mesh_overrides, run_fresh

DATA4_FSDP2 = mesh_overrides(data=4, fsdp=2)


def optimizer_bytes_by_parameter(config) -> dict[str, int]:
    """Returns parameter name -> bytes per device of its Adam moments (both), from the abstract layout."""
    layout = state_layout(config, make_mesh(config), resolve_rules(config.mesh.rules))
    adam = layout.abstract["opt_state"][1][0]  # chain(clip, adamw): adamw's scale_by_adam state
    totals = {}
    for moments in (adam.mu, adam.nu):
        for path, leaf in jax.tree_util.tree_leaves_with_path(moments):
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            totals[name] = totals.get(name, 0) + per_device_bytes(leaf)
    return totals


def test_shard_update_divides_the_moments_per_device_by_the_replicas_of_each_parameter(tiny_config):
    held = optimizer_bytes_by_parameter(tiny_config().replace(**DATA4_FSDP2))
    shared = optimizer_bytes_by_parameter(tiny_config("optimizer.shard_update=true").replace(**DATA4_FSDP2))
    # a norm scale is replicated on all 8 devices; a weight split over fsdp is replicated over data (4)
    assert held["final_norm/scale"] == 8 * shared["final_norm/scale"]
    assert held["blocks/mlp/up"] == 4 * shared["blocks/mlp/up"]
    assert held["embedding"] == 4 * shared["embedding"]


def test_a_parameter_no_dimension_of_which_the_replicas_divide_keeps_its_layout():
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    held = NamedSharding(mesh, PartitionSpec(None, "fsdp"))
    assert update_sharding(held, (3, 6), ("data", "fsdp")) == held  # 3 and 6 / 2 are not multiples of 4
    # data x fsdp does not divide the first dimension, data alone does
    assert update_sharding(NamedSharding(mesh, PartitionSpec()), (4, 3), ("data", "fsdp")).spec == PartitionSpec("data", None)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2, tensor=2), dict(data=2, fsdp=2, expert=2)],
                         ids=["data2_fsdp2_tensor2", "data2_fsdp2_expert2"])
def test_shard_update_compiles_without_involuntary_rematerialization(tiny_config, mesh, capfd):
    moe = ("moe.num_experts=4", "moe.every=2") if "expert" in mesh else ()
    config = tiny_config("model.num_kv_heads=4", "optimizer.shard_update=true", *moe).replace(**mesh_overrides(**mesh))
    compile_step(build_job(config, with_data=False))
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.slow
def test_shard_update_trains_as_every_replica_updating_all(tiny_config):
    config = tiny_config().replace(**DATA4_FSDP2)
    reference = run_fresh(config)
    sharded = run_fresh(config.replace(**{"optimizer.shard_update": True}))
    # Reduce-scattered gradients sum in another order than all-reduced ones: float32 rounding, which Adam can
    # amplify in an element whose gradient is near 0 (tests/settings.py, COMPARABLE_ADAM). How far depends on
    # the CPU's vector width: the largest difference seen is 2.3e-6, on one embedding element of 16,384.
    assert_same_training(sharded, reference, loss_rtol=1e-6, param_tol=1e-5)
    params = jax.tree.leaves(sharded.state["params"])
    assert [leaf.sharding for leaf in params] == [leaf.sharding for leaf in jax.tree.leaves(reference.state["params"])]
