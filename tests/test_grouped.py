"""Grouped matmuls of dropless MoE layers (nestor.backend.mosaic_gpu): the Mosaic GPU path's gradient and masking
against jax.lax.ragged_dot, through stand-ins of the kernels (CPU runs no Mosaic GPU; the kernels
themselves are checked against a per-group reference by bench.grouped on an H100, docs/benchmarks.md),
the choice of implementation, and what the `dots` remat policy keeps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nestor.backend import BackendError, resolve_backend
from nestor.backend import mosaic_gpu as grouped
from nestor.backend.mosaic_gpu import TILE, grouped_matmul_op, kernel_grouped_matmul
from nestor.backend.remat import policy as remat_policy
from nestor.models import ops
from nestor.models.moe import dropless_expert_outputs, grouped_swiglu
from nestor.orchestrator.job import moe_wiring as orchestrator_moe
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.job.step import backend_request
from tests.helpers import equations

GROUP_SIZES = jnp.array([5, 0, 7, 3], jnp.int32)  # 15 of 20 rows in groups; group 1 empty
ROWS = 20


def fake_ragged_dot(lhs, rhs, *, group_sizes, transpose_rhs, block_m, block_n, block_k, max_concurrent_steps,
                    grid_block_n):
    """jax's Mosaic GPU ragged_dot as the CPU can run it, leaving NaN in the rows past the groups
    (the kernel leaves them unwritten)."""
    columns = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    assert columns % (grid_block_n * block_n) == 0, (columns, grid_block_n, block_n)  # what jax's tuner tries
    assert lhs.shape[1] % block_k == 0 and block_m and max_concurrent_steps
    output = jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, group_sizes)
    row = jnp.arange(lhs.shape[0])[:, None]
    return jnp.where(row < jnp.sum(group_sizes), output, jnp.nan).astype(lhs.dtype)


def fake_transposed_ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps,
                               grid_block_n):
    """jax's Mosaic GPU transposed_ragged_dot: [G, K, N], group g's rows of lhs [M, K] transposed times
    its rows of rhs [M, N]. Like the kernel, it masks the rows outside the groups by multiplying with
    0 or 1, so a NaN there spreads."""
    assert lhs.shape[1] % block_m == 0 and rhs.shape[1] % block_n == 0, (lhs.shape, rhs.shape)  # its own checks
    assert block_k and max_concurrent_steps and grid_block_n
    inside = (jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes))[:, None].astype(lhs.dtype)
    lhs, rhs = lhs * inside, rhs * inside
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, numbers).astype(lhs.dtype)


FAKES = (fake_ragged_dot, fake_transposed_ragged_dot)


@pytest.fixture
def fake_kernels(monkeypatch):
    """Makes nestor.backend.mosaic_gpu run the stand-ins where it would run jax's Mosaic GPU kernels."""
    monkeypatch.setattr(grouped, "mosaic_kernels", lambda: FAKES)


def random(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def test_kernel_path_equals_ragged_dot_in_value_and_gradient_with_rows_past_the_groups_zero():
    rows, weights = random((ROWS, 2 * TILE), 0), random((4, 2 * TILE, 3 * TILE), 1)
    cotangent = random((ROWS, 3 * TILE), 2)

    def loss(matmul, rows, weights):
        return jnp.sum(matmul(rows, weights, GROUP_SIZES) * cotangent)

    kernel_path = lambda r, w, g: kernel_grouped_matmul(FAKES, r, w, g)  # noqa: E731
    output = kernel_path(rows, weights, GROUP_SIZES)
    np.testing.assert_array_equal(output[15:], 0.0)  # the NaN the kernel leaves is masked
    np.testing.assert_allclose(output, jax.lax.ragged_dot(rows, weights, GROUP_SIZES), rtol=1e-6)
    got = jax.grad(loss, argnums=(1, 2))(kernel_path, rows, weights)
    want = jax.grad(loss, argnums=(1, 2))(jax.lax.ragged_dot, rows, weights)
    for name, a, b in zip(("d_rows", "d_weights"), got, want):
        assert bool(jnp.all(jnp.isfinite(a))), name
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(got[0][15:], 0.0)  # rows past the groups get no gradient
    np.testing.assert_array_equal(got[1][1], 0.0)  # nor does the empty group's weight


@pytest.mark.slow
def test_dropless_experts_on_the_kernel_path_equal_ragged_dot_in_bfloat16(fake_kernels):
    tokens, experts = random((12, TILE), 3, jnp.bfloat16), jax.random.randint(jax.random.key(4), (12, 2), 0, 8)
    gates = jax.nn.softmax(random((12, 2), 5)).astype(jnp.bfloat16)
    weights = (random((4, TILE, 2 * TILE), 6, jnp.bfloat16), random((4, TILE, 2 * TILE), 7, jnp.bfloat16),
               random((4, 2 * TILE, TILE), 8, jnp.bfloat16))

    def loss(matmuls, tokens, weights):  # experts 4..7 on this device: some assignments go elsewhere
        with ops.installed(ops.Ops(grouped_matmul=grouped_matmul_op(matmuls))):
            out = dropless_expert_outputs(tokens, experts, gates, weights, 4)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    results = {name: jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)(name, tokens, weights)
               for name in ("mosaic_gpu", "xla")}
    (_, kernel_out), kernel_grads = results["mosaic_gpu"]
    (_, xla_out), xla_grads = results["xla"]
    np.testing.assert_array_equal(kernel_out, xla_out)  # both sum in float32 and round the same
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(kernel_grads), jax.tree.leaves(xla_grads)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2,
                                   err_msg=jax.tree_util.keystr(path))


def test_an_unknown_implementation_or_what_the_kernels_do_not_take_is_a_clear_error(fake_kernels):
    rows, weights = random((ROWS, TILE), 0), random((4, TILE, TILE), 1)
    with pytest.raises(ValueError, match="one of xla, mosaic_gpu, mosaic_gpu_or_xla"):
        grouped_matmul_op("triton")
    with pytest.raises(ValueError, match="bfloat16 or float16.*float32.*moe.grouped_matmul=xla"):
        grouped_matmul_op("mosaic_gpu")(rows, weights, GROUP_SIZES)
    with pytest.raises(ValueError, match=r"multiples of 128 on each device, got \(4, 128, 96\)"):
        grouped_matmul_op("mosaic_gpu")(rows.astype(jnp.bfloat16), weights[..., :96].astype(jnp.bfloat16), GROUP_SIZES)


def test_mosaic_gpu_or_xla_runs_the_kernels_only_where_they_take_the_shapes(monkeypatch):
    calls = []
    monkeypatch.setattr(grouped, "mosaic_kernels", lambda: calls.append(1) or FAKES)
    rows, weights = random((ROWS, TILE), 0, jnp.bfloat16), random((4, TILE, TILE), 1, jnp.bfloat16)
    either = grouped_matmul_op("mosaic_gpu_or_xla")
    either(rows, weights[..., :96], GROUP_SIZES)  # a device's slice of 96 columns
    either(rows.astype(jnp.float32), weights.astype(jnp.float32), GROUP_SIZES)
    assert not calls
    either(rows, weights, GROUP_SIZES)
    assert calls == [1]


DROPLESS = ("moe.num_experts=4", "moe.every=1", "moe.capacity_factor=0")
WIDE = ("model.embed_dim=256", "model.mlp_dim=512")  # the tiny model's 64 and 128 do not tile


def test_auto_picks_the_kernels_on_hopper_gpus_in_bfloat16_only(tiny_config):
    bf16 = (*DROPLESS, *WIDE, "model.dtype=bfloat16")
    grouped_of = lambda config, *device: resolve_backend(backend_request(config), *device).grouped_matmul  # noqa: E731
    assert grouped_of(tiny_config(*bf16), "cpu") == "xla"
    assert grouped_of(tiny_config(*bf16), "gpu", "NVIDIA A100-SXM4-80GB", "8.0") == "xla"
    assert grouped_of(tiny_config(*bf16), "gpu", "NVIDIA H100 80GB HBM3", "9.0") == "mosaic_gpu_or_xla"
    assert grouped_of(tiny_config(*bf16, "cluster.device_kind=h100"), "cpu") == "mosaic_gpu_or_xla"  # explain
    with pytest.raises(BackendError, match="moe.grouped_matmul: mosaic_gpu needs a Hopper GPU"):
        resolve_backend(backend_request(tiny_config(*bf16, "moe.grouped_matmul=mosaic_gpu")), "cpu")
    # a model without dropless layers runs no grouped matmul, whatever the key says
    assert grouped_of(tiny_config("moe.grouped_matmul=mosaic_gpu"), "cpu") == "none"
    hopper = ("gpu", "NVIDIA H100 80GB HBM3", "9.0")
    assert grouped_of(tiny_config(*DROPLESS, *WIDE, "model.dtype=float32"), *hopper) == "xla"
    assert grouped_of(tiny_config(*bf16, "moe.grouped_matmul=xla"), *hopper) == "xla"
    assert grouped_of(tiny_config(*bf16, "moe.grouped_matmul=mosaic_gpu"), *hopper) == "mosaic_gpu"


def test_a_grouped_matmul_the_target_cannot_run_is_a_config_error_naming_its_key(tiny_config):
    with pytest.raises(ConfigError) as error:
        build_job(tiny_config(*DROPLESS, *WIDE, "model.dtype=bfloat16", "moe.grouped_matmul=mosaic_gpu",
                              "mesh.data=8"), with_data=False)
    assert [key for key, _ in error.value.problems] == ["moe.grouped_matmul"]


def test_mosaic_gpu_on_widths_that_do_not_tile_on_each_device_is_a_config_error(tiny_config):
    forced = (*DROPLESS, "moe.grouped_matmul=mosaic_gpu", "mesh.data=4", "mesh.tensor=2")
    tiny_config(*forced, *WIDE)  # 512 / 2 = 256 columns a device: tiles
    with pytest.raises(ConfigError, match=r"moe.grouped_matmul: .*each device's expert width \(192, over 2"):
        tiny_config(*forced, *WIDE, "model.mlp_dim=384")
    with pytest.raises(ConfigError, match=r"model.embed_dim \(64\)"):
        tiny_config(*forced)
    tiny_config(*DROPLESS, "mesh.data=4", "mesh.tensor=2")  # auto falls back


def test_explain_names_the_grouped_matmuls_each_device_of_the_target_runs(tiny_config):
    for mlp_dim, runs in ((512, "mosaic_gpu"), (384, "xla")):  # 256 or 192 columns a device
        config = tiny_config(*DROPLESS, *WIDE, f"model.mlp_dim={mlp_dim}", "model.dtype=bfloat16", "mesh.data=4",
                             "mesh.tensor=2", "cluster.device_kind=h100")
        job = build_job(config, with_data=False)
        assert orchestrator_moe.dropless_report(config, job.backend, job.mesh, job.rules)["grouped_matmul"] == runs


@pytest.mark.parametrize("implementation", ["mosaic_gpu", "xla"])
def test_dots_remat_keeps_the_grouped_matmul_outputs(tiny_config, fake_kernels, monkeypatch, implementation):
    # jax's dots_saveable sees neither ragged_dot nor a Pallas kernel; the MATMUL_SUMS name is what keeps gate
    # and up for the backward pass (without it `dots` traces the forward matmuls again, as `full` does).
    monkeypatch.setattr(grouped, "kernel_problem", lambda rows, weights: None)  # the stand-ins take float32
    rows = random((ROWS, TILE), 0)
    weights = tuple(random((4, TILE, TILE), seed) for seed in (1, 2, 3))

    def matmuls(remat: str) -> int:
        unit = jax.checkpoint(lambda r, w: jnp.sum(grouped_swiglu(r, GROUP_SIZES, w) ** 2),
                              policy=remat_policy(remat))
        with ops.installed(ops.Ops(grouped_matmul=grouped_matmul_op(implementation))):
            return len(equations(jax.make_jaxpr(jax.grad(unit, argnums=(0, 1)))(rows, weights).jaxpr,
                                 "ragged_dot_general"))

    assert matmuls("dots") == 9  # 3 forward, 3 x 2 backward
    assert matmuls("full") == 12  # 3 forward again (the down projection's unused: XLA drops it)


def test_the_bench_checks_each_implementation_this_device_runs_against_the_reference():
    from bench.grouped import group_sizes, main

    sizes = group_sizes(1000, 8)
    assert sizes[1] == 0 and 890 <= sizes.sum() <= 900 and sizes.min() >= 0
    results = main(["--rows", "512", "--embed", "128", "--width", "256", "--experts", "4", "--repeats", "1"])
    assert [row["implementation"] for row in results] == ["xla", "reference"]  # a CPU runs no mosaic_gpu
    assert results[0]["forward_error"] < 1e-5 and results[0]["d_rows_error"] < 1e-5
    assert results[0]["d_weights_error"] < 1e-5 and results[0]["past_groups_zero"] and results[0]["finite"]
