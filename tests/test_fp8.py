"""Float8 weight matmuls (`model.matmul_precision=fp8`, nestor.backend.fp8): the ops against bfloat16's, the
train step's float8 dots, training that follows bfloat16's, exact resume and reshard, config errors."""

import collections
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nestor.backend import BackendError, fp8, resolve_backend
from nestor.models import ops
from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.checkpoint.files import checkpoint_dir
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import abstract_batch, build_job
from nestor.orchestrator.job.step import backend_request
from nestor.parallel.hlo import dot_operand_dtypes
from tests.helpers import ONE_DEVICE, mesh_overrides, relative_error, run, run_fresh

BASE = ["model.preset=tiny", "train.global_batch=16", "train.seq_len=32", "optimizer.warmup_steps=2",
        "metrics.tensorboard=false", "cluster.launcher=inprocess", "model.dtype=bfloat16"]
DROPLESS = ["moe.num_experts=4", "moe.every=2", "moe.top_k=2", "moe.capacity_factor=0"]
FP8 = "model.matmul_precision=fp8"


def load(*overrides: str, devices: int = 8):
    return config_lib.load(None, BASE + [f"cluster.devices_per_host={devices}", *overrides])


def _sin_sum(product):
    return lambda *operands: jnp.sum(jnp.sin(product(*operands).astype(jnp.float32)))


def test_float8_einsum_and_its_gradients_are_bfloat16s_within_float8_rounding():
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (4, 32, 64), jnp.bfloat16)
    weight = (jax.random.normal(keys[1], (64, 128)) * 0.05).astype(jnp.bfloat16)
    fp8_einsum = lambda x, w: fp8.einsum(ops.plain_einsum, "btd,dm->btm", x, w)  # noqa: E731
    plain = lambda x, w: ops.plain_einsum("btd,dm->btm", x, w)  # noqa: E731
    got = jax.grad(_sin_sum(fp8_einsum), argnums=(0, 1))(x, weight)
    want = jax.grad(_sin_sum(plain), argnums=(0, 1))(x, weight)
    # e4m3 keeps 3 bits of mantissa (a relative step of 1/8), e5m2 2: errors of a few percent, not more
    assert 0 < relative_error(fp8_einsum(x, weight), plain(x, weight)) < 0.06
    assert 0 < relative_error(got[0], want[0]) < 0.08 and 0 < relative_error(got[1], want[1]) < 0.08
    # another output dtype (the float32 logits) keeps the higher-precision einsum
    logits = fp8.einsum(ops.plain_einsum, "btd,dm->btm", x, weight, jnp.float32)
    np.testing.assert_array_equal(logits, ops.plain_einsum("btd,dm->btm", x, weight, jnp.float32))


def test_float8_grouped_matmul_and_its_gradients_are_ragged_dots_within_float8_rounding():
    keys = jax.random.split(jax.random.key(1), 2)
    rows = jax.random.normal(keys[0], (48, 64), jnp.bfloat16)
    weights = (jax.random.normal(keys[1], (3, 64, 32)) * 0.05).astype(jnp.bfloat16)
    sizes = jnp.array([10, 20, 12], jnp.int32)  # 6 rows past the groups
    grouped = lambda r, w: fp8.grouped_matmul(r, w, sizes)  # noqa: E731
    plain = lambda r, w: ops.ragged_dot(r, w, sizes)  # noqa: E731
    out = grouped(rows, weights)
    got = jax.grad(_sin_sum(grouped), argnums=(0, 1))(rows, weights)
    want = jax.grad(_sin_sum(plain), argnums=(0, 1))(rows, weights)
    assert 0 < relative_error(out[:42], plain(rows, weights)[:42]) < 0.06
    assert 0 < relative_error(got[0][:42], want[0][:42]) < 0.08 and 0 < relative_error(got[1], want[1]) < 0.08
    assert not np.any(np.asarray(out[42:], np.float32)) and not np.any(np.asarray(got[0][42:], np.float32))


def _step_dots(config) -> list[tuple[str, ...]]:
    """Returns the operand dtypes of the dots in the train step as nestor hands it to XLA (XLA:CPU then widens
    float8 dots to float32, as it does bfloat16 ones)."""
    job = build_job(config, with_data=False)
    lowered = job.step_fn.lower(job.layout.abstract, abstract_batch(job))
    return dot_operand_dtypes(lowered.as_text(dialect="hlo"))


def test_the_train_step_multiplies_weights_in_float8_and_the_logits_router_and_attention_higher():
    dense, moe = (collections.Counter(_step_dots(load(FP8, *extra))) for extra in ([], DROPLESS))
    forward, backward = ("f8e4m3fn", "f8e4m3fn"), [("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")]
    # one scanned layer's 7 weight matmuls (q, k, v, out; gate, up, down): each gradient product in float8, the
    # forward's (and remat's recomputation) too
    assert dense[backward[0]] == dense[backward[1]] == 7 and dense[forward] >= 7
    assert dense[("bf16", "bf16")] > 0  # attention's products and the logits
    # the dropless layers' experts add their own float8 products, while the router stays float32
    assert moe[backward[0]] == moe[backward[1]] > 7 and moe[("f32", "f32")] > 0
    bfloat16 = collections.Counter(_step_dots(load(*DROPLESS)))
    assert not [operands for operands in bfloat16 if any(dtype.startswith("f8") for dtype in operands)]


@pytest.mark.default_cpu_build  # 400 steps: at the suite's quicker compile they take twice as long to run
@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["tiny", "tiny_dropless_moe"])
def test_float8_training_follows_bfloat16s_loss_within_2_percent_over_200_steps(moe):
    extra = [*DROPLESS] if moe else []
    common = ["train.steps=200", "optimizer.warmup_steps=20", "checkpoint.every=0", *extra]
    bf16 = run_fresh(load(*common).replace(**ONE_DEVICE))
    fp8_run = run_fresh(load(*common, FP8).replace(**ONE_DEVICE))
    bf16_losses, fp8_losses = np.asarray(bf16.losses), np.asarray(fp8_run.losses)
    assert len(fp8_losses) == 200 and np.isfinite(fp8_losses).all()
    assert bf16_losses[-1] < 0.75 * bf16_losses[0]  # it learned, so following it means something
    # the curves, 10 steps at a time (one step's loss moves by a few percent with its batch, in either run)
    curve = lambda losses: losses.reshape(20, 10).mean(axis=1)  # noqa: E731
    deviation = np.abs(curve(fp8_losses) - curve(bf16_losses)) / curve(bf16_losses)
    assert deviation.max() < 0.02, deviation
    assert np.abs(fp8_losses - bf16_losses).max() > 0  # the matmuls did run in float8


@pytest.fixture(scope="module")
def saved_fp8(tmp_path_factory):
    """An fp8 run of 4 steps on data2 x fsdp2 x tensor2 (dropless MoE) saved at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("fp8")
    config = load(FP8, *DROPLESS, "train.steps=4", "checkpoint.every=2", f"run.dir={run_dir}").replace(
        **mesh_overrides(data=2, fsdp=2, tensor=2))
    return run_dir, run(config)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["same_mesh", "fsdp4_expert2"])
def test_float8_run_resumes_bit_exactly_and_onto_another_mesh(saved_fp8, tmp_path, target):
    saved_dir, reference = saved_fp8
    run_dir = tmp_path / "run"
    shutil.copytree(saved_dir, run_dir)
    shutil.rmtree(checkpoint_dir(run_dir) / "4")  # newest is now the step-2 checkpoint
    mesh = mesh_overrides(data=2, fsdp=2, tensor=2) if target == "same_mesh" else mesh_overrides(fsdp=4, expert=2)
    result = run(load(FP8, *DROPLESS, "train.steps=4", "checkpoint.every=2", f"run.dir={run_dir}").replace(**mesh))
    assert result.first_step == 2
    if target == "same_mesh":
        assert result.losses == reference.losses[2:]
    else:
        # another mesh sums in another order, and each device of the expert exchange scales its own rows and
        # experts (backend/fp8.py): agreement to float8 and bfloat16 rounding, not bit-exact
        np.testing.assert_allclose(result.losses, reference.losses[2:], rtol=1e-4)


@pytest.mark.parametrize("overrides, platform, device_kind, capability, words", [
    ([FP8, "cluster.device_kind=tpu-v5p"], "cpu", None, None, "not TPUs"),
    ([FP8, "cluster.device_kind=a100"], "cpu", None, None, "a100 has none"),
    ([FP8], "gpu", "NVIDIA A100-SXM4-80GB", "8.0", "compute capability 8.9+"),
    ([FP8], "gpu", "AMD Instinct MI300X", "gfx942", "compute capability 8.9+"),
])
def test_fp8_where_it_cannot_run_is_an_error_naming_the_key(overrides, platform, device_kind, capability, words):
    with pytest.raises(BackendError, match=words) as error:
        resolve_backend(backend_request(load(*overrides)), platform, device_kind, capability)
    assert error.value.key == "model.matmul_precision"


@pytest.mark.parametrize("platform, device_kind, capability", [
    ("gpu", "NVIDIA H100 80GB HBM3", "9.0"), ("gpu", "NVIDIA L4", None), ("cpu", None, None)])
def test_fp8_runs_on_float8_gpus_and_emulated_on_cpu(platform, device_kind, capability):
    backend = resolve_backend(backend_request(load(FP8, *DROPLESS)), platform, device_kind, capability)
    assert backend.matmul_precision == "fp8" and backend.report()["matmuls"].startswith("float8")
    assert backend.report()["grouped_matmul"].startswith("float8") == (backend.grouped_matmul == "xla")


def test_with_fp8_the_hopper_grouped_matmul_kernels_stay_bfloat16_and_ragged_dot_runs_float8():
    hopper = ("gpu", "NVIDIA H100 80GB HBM3", "9.0")
    kernels = resolve_backend(backend_request(load(FP8, *DROPLESS, "model.embed_dim=128")), *hopper)
    assert kernels.grouped_matmul == "mosaic_gpu_or_xla"  # XLA:GPU's ragged_dot is far slower (docs/benchmarks.md)
    assert kernels.report()["grouped_matmul"].startswith("Mosaic GPU kernels")
    assert kernels.report()["matmuls"].startswith("float8")
    ragged = resolve_backend(backend_request(load(FP8, *DROPLESS, "moe.grouped_matmul=xla")), *hopper)
    assert ragged.report()["grouped_matmul"].startswith("float8")


def test_fp8_outside_bfloat16_is_a_config_error_when_the_config_loads():
    with pytest.raises(ConfigError, match="model.matmul_precision: fp8 runs with model.dtype bfloat16"):
        load(FP8, "model.dtype=float32")
