"""The backend (nestor.backend): the one place that reads the platform, its choices for a target, and what
`explain` reports for a target other than the compiling devices."""

import re
from pathlib import Path

import pytest

from nestor.backend import ALL_GATHER, BackendError, RAGGED_ALL_TO_ALL, resolve_backend
from nestor.models import ops
from nestor.orchestrator.commands.explain import explain, format_report
from nestor.orchestrator.job.build import build_job, traced_use
from nestor.orchestrator.job.step import backend_request
from nestor.parallel.pipeline import BUFFERED, PER_STAGE_SKIPPING
from tests.settings import ROOT

PLATFORM_WORDS = re.compile(r"\b(cpu|gpu|cuda|tpu|rocm|hopper)\b", re.IGNORECASE)


def test_no_file_of_models_or_parallel_names_a_platform():
    named = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for room in ("models", "parallel") for path in sorted((ROOT / room).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if PLATFORM_WORDS.search(line)]
    assert named == []
    # the check itself finds a platform name where the backend keeps them
    assert PLATFORM_WORDS.search((ROOT / "backend" / "xla_cpu.py").read_text())


def test_the_target_is_the_accelerator_or_device_kind_asked_for_else_the_devices(tiny_config):
    assert resolve_backend(backend_request(tiny_config()), "cpu").target == "cpu"
    assert resolve_backend(backend_request(tiny_config()), "cuda").target == "gpu"
    assert resolve_backend(backend_request(tiny_config("cluster.accelerator=tpu")), "cpu").target == "tpu"
    assert resolve_backend(backend_request(tiny_config("cluster.device_kind=tpu-v5p")), "cpu").target == "tpu"
    h100 = resolve_backend(backend_request(tiny_config("cluster.device_kind=h100")), "cpu")
    assert (h100.target, h100.platform, h100.device_kind) == ("gpu", "cpu", "h100")


def test_each_target_gets_its_own_ops_exchange_and_pipeline_loop(tiny_config):
    moe = ("moe.num_experts=4", "moe.every=1", "moe.capacity_factor=0", "model.dtype=bfloat16")
    cpu = resolve_backend(backend_request(tiny_config(*moe)), "cpu")
    assert (cpu.exchange, cpu.pipeline_loop, cpu.ops().einsum) == (ALL_GATHER, PER_STAGE_SKIPPING,
                                                                    ops.einsum_from_float32_sums)
    gpu = resolve_backend(backend_request(tiny_config(*moe)), "gpu", "NVIDIA H100 80GB HBM3", "9.0")
    assert (gpu.exchange, gpu.pipeline_loop, gpu.ops().einsum) == (RAGGED_ALL_TO_ALL, BUFFERED, ops.plain_einsum)
    assert (gpu.attention, gpu.grouped_matmul, gpu.remat) == ("cudnn", "mosaic_gpu_or_xla", "dots")
    assert gpu.compiled_here() is gpu  # compiled on the target itself: nothing substituted


def test_what_the_compiling_devices_cannot_lower_is_substituted_and_named(tiny_config):
    config = tiny_config("moe.num_experts=4", "moe.every=1", "moe.capacity_factor=0", "model.dtype=bfloat16",
                         "model.remat=offload", "cluster.device_kind=h100")
    here = resolve_backend(backend_request(config), "cpu").compiled_here()
    assert (here.attention, here.grouped_matmul, here.exchange, here.remat) == ("xla", "xla", ALL_GATHER, "minimal")
    assert len(here.substitutions) == 4 and all(": " in note for note in here.substitutions)
    assert not here.float32_sums  # the target's numerics, not the compiling CPU's


def test_a_choice_the_target_cannot_run_names_its_key(tiny_config):
    with pytest.raises(BackendError) as error:
        resolve_backend(backend_request(tiny_config("model.dtype=bfloat16", "model.attention=cudnn")), "cpu")
    assert error.value.key == "model.attention"


@pytest.mark.slow
def test_explain_for_an_h100_on_this_cpu_names_what_the_h100_runs(tiny_config):
    config = tiny_config("moe.num_experts=4", "moe.every=1", "moe.capacity_factor=0", "model.dtype=bfloat16",
                         "model.embed_dim=128", "moe.expert_mlp_dim=256", "cluster.device_kind=h100",
                         "mesh.data=2", "mesh.expert=4")
    report = explain(config, build_job(config, with_data=False))
    backend = report["backend"]
    assert (backend["target"], backend["remat"], backend["exchange"]) == ("gpu", "dots", RAGGED_ALL_TO_ALL)
    assert backend["attention"] == "jax.nn.dot_product_attention (cudnn)"
    assert backend["grouped_matmul"].startswith("Mosaic GPU kernels")
    assert report["dropless_moe"]["grouped_matmul"] == "mosaic_gpu"
    text = format_report(report)
    assert "backend for gpu (h100): remat dots; attention jax.nn.dot_product_attention (cudnn)" in text
    assert "compiled here: attention: cudnn compiled as xla" in text


def test_the_repository_root_maps_every_room_into_one_package():
    import nestor.backend
    import nestor.models

    assert Path(nestor.models.__file__).parent == ROOT / "models"
    assert Path(nestor.backend.__file__).parent == ROOT / "backend"


@pytest.mark.slow
def test_explain_for_an_h100_counts_grouped_matmuls_as_its_kernels_and_the_state_update_apart(tiny_config):
    # The comparison: data8, 4 layers, embed 128, E=32 experts 256 wide, top-2, against the dense model
    # of the same active parameters (mlp 512). XLA:CPU's ragged_dot multiplies every row by every expert (25x
    # the dense step's FLOPs); the H100's grouped GEMMs multiply each row once. What still grows with the
    # expert count is the per-parameter work of a replicated update: explain reports it apart.
    base = ("model.embed_dim=128", "model.num_layers=4", "train.global_batch=16", "train.seq_len=128", "mesh.data=8",
            "model.dtype=bfloat16", "cluster.device_kind=h100")
    dense = explain(tiny_config(*base, "model.mlp_dim=512"))
    moe = explain(tiny_config(*base, "moe.num_experts=32", "moe.every=1", "moe.top_k=2", "moe.expert_mlp_dim=256",
                              "moe.capacity_factor=0"))
    assert moe["grouped_matmuls_counted_as_target_runs_them"]
    # the LM calls attention and SwiGLU either way; only the dropless one runs grouped matmuls and an exchange
    assert dense["backend"]["attention"] and dense["backend"]["swiglu"] and moe["backend"]["exchange"]
    assert dense["backend"]["grouped_matmul"] is None and dense["backend"]["exchange"] is None
    assert dense["backend"]["pipeline_loop"] is None  # mesh.pipeline=1
    assert not dense["grouped_matmuls_counted_as_target_runs_them"]  # no grouped matmul: one compile
    assert moe["flops_per_step"] / dense["flops_per_step"] < 1.3  # measured 1.22
    model_work = [report["flops_per_step"] - report["update_flops_per_step"] for report in (moe, dense)]
    assert model_work[0] / model_work[1] <= 1.10  # measured 1.046
    assert moe["update_flops_per_step"] > 2 * dense["update_flops_per_step"]  # 4x the parameters


@pytest.mark.slow
def test_explain_says_where_each_setting_that_decides_speed_came_from(tiny_config):
    from nestor.orchestrator.loader.config import load, speed_key_sources

    sources = {key: (value, where) for key, value, where in speed_key_sources(
        load(None, ["model.preset=1b", "model.remat=full", "cluster.devices_per_host=8"]))}
    assert sources["model.scan_layers"] == (False, "preset 1b")  # measured faster on an H100 (the preset says so)
    assert sources["model.remat"] == ("full", "the run") and sources["model.attention"] == ("auto", "default")
    overridden = load(None, ["model.preset=1b", "model.scan_layers=true", "cluster.devices_per_host=8"])
    assert speed_key_sources(overridden)[0] == ("model.scan_layers", True, "the run")  # over the preset's
    text = format_report(explain(tiny_config("cluster.device_kind=h100")))
    assert "settings chosen for speed: model.scan_layers=true (default); model.remat=auto (default)" in text


def test_explains_trace_of_the_model_draws_as_the_step_does(tiny_config):
    """explain traces the model's forward pass to see which backend choices apply; a training trace has the
    step's key, which GShard's random second expert draws from."""
    config = tiny_config("moe.num_experts=4", "moe.every=1", "moe.top_k=2", "moe.second_expert_policy=random")
    called, _ = traced_use(build_job(config, with_data=False))
    assert {"attention", "einsum", "swiglu"} <= called and "grouped_matmul" not in called  # capacity dispatch
