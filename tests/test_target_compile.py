"""The GPU and TPU programs compiled on this CPU machine by the targets' own compilers (backend.targets):
XLA:GPU from nestor[gpu-compile] for an 8-GPU H100 host, XLA:TPU from nestor[tpu-compile] for a v5p slice.
Nothing here needs a device; without an extra its tests are skipped (CI installs both, .ci/run)."""

from __future__ import annotations

import dataclasses
import gzip
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nestor.backend import BackendError
from nestor.backend.targets import (GPU_TARGET_DIR, GPU_TARGETS, compiler_version, cudnn_installed, standing_in,
                                    target_devices, target_name)
from nestor.orchestrator.commands.explain import compile_step, explain, format_report
from nestor.orchestrator.commands.launch_checks import check_target_fit
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.abstract_check import check_abstractly
from nestor.orchestrator.job.build import build_job, compile_target
from nestor.orchestrator.job.compiled import FIGURES_DIR, lower_step
from nestor.parallel.experts import RAGGED_ALL_TO_ALL
from nestor.parallel.hlo import collective_lines, collectives
from tests.helpers import child_env
from tests.settings import TINY

needs_gpu_compile = pytest.mark.skipif(
    compiler_version("h100") is None,
    reason="XLA:GPU's deviceless compile needs the gpu-compile extra: pip install -e '.[gpu-compile]'")
needs_tpu_compile = pytest.mark.skipif(
    compiler_version("tpu-v5p") is None,
    reason="XLA:TPU's deviceless compile needs the tpu-compile extra: pip install -e '.[tpu-compile]'")

H100 = ("cluster.device_kind=h100", "model.dtype=bfloat16", "cluster.hosts=1", "cluster.devices_per_host=8")
DROPLESS = ("moe.num_experts=4", "moe.every=1", "moe.top_k=2", "moe.capacity_factor=0", "moe.expert_mlp_dim=128")
# a Triton GEMM fusion's computation and the dtypes of its dot's two operands
GEMM_FUSION_OPERANDS = re.compile(r"^%gemm_fusion\S* \(parameter_0\S*: (\w+)\[[^\]]*\], parameter_1\S*: (\w+)\[", re.M)


@pytest.fixture
def tiny_config(tiny_config):
    """The suite's tiny_config without a compile cache: each test compiles (the cache's own tests name theirs)."""
    return lambda *overrides, **dotted: tiny_config("run.compile_cache=null", *overrides, **dotted)


def compiled_for_target(config):
    """Returns (the job built on the target's deviceless devices, its compiled train step)."""
    target = compile_target(config)
    assert target.devices is not None, target.compiler
    job = build_job(config, devices=target.devices, with_data=False)
    return job, compile_step(job)


def test_each_shipped_gpu_target_names_its_device_and_each_device_kind_its_target():
    for name in GPU_TARGETS:
        proto = (GPU_TARGET_DIR / f"{name}.textproto").read_text()
        described = re.search(r'device_description_str: "([^"]+)"', proto)[1]
        assert target_name(described) == name, described  # jax's device_kind of the compiled devices
        assert re.search(r"core_count: \d+", proto) and re.search(r"device_memory_size: \d+", proto)
    assert [target_name(kind) for kind in ("h100", "a100-80gb", "tpu-v5p", "TPU v5 lite", "tpu-v6e", "a100-40gb")] == [
        "h100", "a100", "tpu-v5p", "tpu-v5e", "tpu-v6e", None]


def test_without_the_target_compiler_explain_names_xla_cpu_standing_in(tiny_config, monkeypatch):
    import nestor.backend.targets as targets

    monkeypatch.setattr(targets, "compiler_version", lambda target: None)
    target = compile_target(tiny_config("cluster.device_kind=h100"))
    assert target.devices is None
    said = []  # nestor train's check before its workers start compiles nothing either: the state alone is checked
    assert check_target_fit(tiny_config("cluster.device_kind=h100"), said.append) is None and said == []
    assert target.compiler == standing_in("h100") == (
        "XLA:CPU standing in for h100: install nestor[gpu-compile] for the target's compiler")


def test_a_target_size_the_compiler_cannot_build_names_the_key_to_change(monkeypatch):
    import nestor.backend.targets as targets

    monkeypatch.setattr(targets, "compiler_version", lambda target: "installed")
    with pytest.raises(BackendError) as error:
        target_devices("tpu-v5p", "cpu", hosts=3, devices_per_host=4)  # 12 chips: no v5p slice has 12
    assert error.value.key == "cluster.hosts" and "one of [4, 8, 16, 32, 64, 128, 256, 512] chips" in str(error.value)
    with pytest.raises(BackendError) as error:
        target_devices("tpu-v5e", "cpu", hosts=8, devices_per_host=2)
    assert error.value.key == "cluster.devices_per_host"
    with pytest.raises(BackendError) as error:
        target_devices("h100", "cpu", hosts=1, devices_per_host=-1)
    assert error.value.key == "cluster.devices_per_host"


def test_a_deviceless_compiles_figures_are_kept_in_run_compile_cache_and_read_back(tiny_config, tmp_path):
    # XLA:CPU compiles here what the target's compiler would: the same path, taken for the job's backend
    config = tiny_config(f"run.compile_cache={tmp_path / 'cache'}", "mesh.data=2", "mesh.fsdp=4")
    job = build_job(config, with_data=False)
    job = dataclasses.replace(job, backend=dataclasses.replace(job.backend, deviceless=True))
    program = lower_step(job).compile()
    first = compile_step(job)
    [kept] = (tmp_path / "cache" / FIGURES_DIR).iterdir()
    again = compile_step(job)
    assert not first.cached and again.cached and again == dataclasses.replace(first, cached=True)
    assert again.as_text() == program.as_text() and again.cost_analysis() == program.cost_analysis()
    assert again.memory_analysis().temp_size_in_bytes == program.memory_analysis().temp_size_in_bytes
    for damage in (b"damaged", kept.read_bytes()[:-9], gzip.compress(b'{"text": "HloModule"}')):
        kept.write_bytes(damage)  # not gzip, cut short, no memory analysis: compiled again and written over
        assert not compile_step(job).cached and compile_step(job).cached
    other = build_job(config.replace(**{"mesh.data": 4, "mesh.fsdp": 2}), with_data=False)
    assert not compile_step(dataclasses.replace(other, backend=job.backend)).cached  # another program
    assert len(list((tmp_path / "cache" / FIGURES_DIR).iterdir())) == 2  # and no file left half-written
    off = dataclasses.replace(job, config=config.replace(**{"run.compile_cache": None}))
    assert compile_step(off) == first  # compiled again, kept nowhere


@pytest.fixture
def jax_cache(tmp_path):
    """JAX's persistent cache turned on afresh in tmp_path/jax for every program, as a process with
    run.compile_cache set has it; yields a function that lists its entries."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in names}
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        yield lambda: sorted((tmp_path / "jax").glob("*-cache"))
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def test_a_deviceless_compile_writes_no_entry_to_jaxs_cache_which_stays_on_for_the_others(tiny_config, tmp_path,
                                                                                         jax_cache):
    import jax

    job = build_job(tiny_config(f"run.compile_cache={tmp_path / 'cache'}", "mesh.data=8"), with_data=False)
    deviceless = dataclasses.replace(job, backend=dataclasses.replace(job.backend, deviceless=True))
    compile_step(deviceless)  # the process's first compile: JAX's cache must stay on after it
    assert jax_cache() == []
    jax.jit(lambda x: x * 3).lower(1.0).compile()
    assert len(jax_cache()) == 1
    compile_step(dataclasses.replace(deviceless, config=job.config.replace(**{"mesh.data": 2, "mesh.fsdp": 4})))
    assert len(jax_cache()) == 1


def test_a_custom_partitioning_calls_callback_address_is_left_out_of_the_figures_key():
    from nestor.orchestrator.job.compiled import _PARTITIONING_CALLBACKS

    line = ('%54:2 = stablehlo.custom_call @CustomSPMDPartitioning(%36, %52) {api_version = 2 : i32, '
            'backend_config = "{address}", sdy.sharding_rule = #sdy.op_sharding_rule<([i, j])>}')
    keys = {_PARTITIONING_CALLBACKS.sub(r"\1", line.replace("{address}", address))
            for address in ("140483235132048", "140485160795024")}
    assert keys == {line.replace('"{address}"', "")}
    other = 'stablehlo.custom_call @Sharding(%1) {backend_config = "12", mhlo.sharding = "{replicated}"}'
    assert _PARTITIONING_CALLBACKS.sub(r"\1", other) == other


@needs_gpu_compile
def test_explain_for_h100s_compiles_with_xla_gpu_and_its_memory_analysis_decides_the_fit(tiny_config, monkeypatch):
    import nestor.backend.targets as targets

    # cuDNN's attention cannot lower without cuDNN's library: substituted, and said so
    monkeypatch.setattr(targets, "cudnn_installed", lambda: False)
    report = explain(tiny_config(*H100, "mesh.data=8"))
    compiler = report["compiler"]
    assert compiler.startswith("XLA:GPU (jax-cuda12-plugin ") and compiler.endswith(", deviceless, h100 target)")
    assert report["mesh"]["platform"] == "gpu" and report["fit"]["compiler"] == report["compiler"]
    assert report["fit"]["fits"] and report["fit"]["device_memory_bytes"] == 80 * 2**30
    assert report["backend"]["substitutions"] == [
        "attention: cudnn compiled as xla (cuDNN is not installed: nvidia-cudnn-cu12)"]
    # no cost analysis deviceless: the HLO's instructions are counted, and come within 5% of XLA:CPU's cost
    # analysis of the same program here (both saving the dots' outputs, the GPU's automatic remat)
    assert report["flops_counted_by"] == "the HLO's instructions" and report["flops_left_out_in"] == []
    assert "counted from the HLO: XLA:GPU" in format_report(report)
    here = explain(tiny_config("model.dtype=bfloat16", "mesh.data=8", "model.remat=dots"))
    assert here["flops_counted_by"] == "XLA cost analysis" and here["remat"] == report["remat"] == "dots"
    assert abs(report["flops_per_step"] / here["flops_per_step"] - 1) < 0.05, (report["flops_per_step"],
                                                                               here["flops_per_step"])


@needs_gpu_compile
def test_explain_for_h100s_again_reads_its_figures_from_the_compile_cache_and_reports_the_same(tiny_config, tmp_path,
                                                                                                jax_cache, recwarn):
    config = tiny_config(*H100, "mesh.data=8", "model.attention=xla", f"run.compile_cache={tmp_path / 'cache'}")
    first, again = explain(config), explain(config)
    assert not first["compile_cached"] and again["compile_cached"]
    assert "(its figures read from run.compile_cache)" in format_report(again)
    assert {k: v for k, v in again.items() if not k.startswith("compile_")} == {
        k: v for k, v in first.items() if not k.startswith("compile_")}
    # JAX's own cache is not written: its entry of a deviceless compile cannot be read back (a warning)
    assert jax_cache() == [] and [path.name for path in (tmp_path / "cache").iterdir()] == [FIGURES_DIR]
    assert not [w for w in recwarn if "persistent compilation cache" in str(w.message)]


@needs_gpu_compile
def test_train_under_ray_compiles_for_the_target_first_and_refuses_a_step_its_memory_cannot_hold(tiny_config):
    said = []
    plain = (*H100, "mesh.data=8", "model.attention=xla")  # no kernel substituted: the target's own program
    fit = check_target_fit(tiny_config(*plain), said.append)
    assert said[0] == ("compile check: " + compile_target(tiny_config(*H100)).compiler
                       + " compiles the step for 8 x h100 (cluster.compile_check=false skips it)")
    assert fit["fits"] and said[1].startswith("compile check: ") and said[1].endswith(": fits")
    assert fit == {k: v for k, v in explain(tiny_config(*plain))["fit"].items() if k != "compiler"}
    # Memory between the state and the step's total: the state alone fits (the check without the target's
    # compiler passes), the compiled step does not, and its line names the key and the compiler.
    between = f"cluster.device_memory_gb={(fit['state_bytes'] + fit['total_bytes']) / 2 / 2**30}"
    tight = tiny_config(*plain, between)
    check_abstractly(tight)
    with pytest.raises(ConfigError) as refused:
        check_target_fit(tight, said.append)
    [(key, message)] = refused.value.problems
    assert key == "model.remat" and "XLA:GPU (jax-cuda12-plugin" in message and "short by" in message, message
    assert check_target_fit(tight.replace(**{"cluster.compile_check": False}), said.append) is None
    assert check_target_fit(tight.replace(**{"cluster.address": "10.0.0.5:6379"}), said.append) is None
    assert len(said) == 3  # the refused compile's first line; nothing from the checks turned off


@needs_gpu_compile
def test_a_step_compiled_with_a_kernel_substituted_is_an_upper_bound_and_never_refused(tiny_config, monkeypatch):
    import nestor.backend.targets as targets

    monkeypatch.setattr(targets, "cudnn_installed", lambda: False)  # cuDNN's attention compiled as XLA's
    said = []
    fit = check_target_fit(tiny_config(*H100, "mesh.data=8", "cluster.device_memory_gb=0.003"), said.append)
    assert fit["fits"] is False and "(an upper bound: attention: cudnn compiled as xla" in said[1], said
    assert said[1].endswith("started anyway: the target's own kernels need less"), said


@needs_gpu_compile
def test_nestor_train_refuses_a_step_that_does_not_fit_before_ray_starts(tmp_path):
    from nestor.orchestrator.loader.config import load

    given = (*TINY, *H100, "mesh.data=8", "model.attention=xla", "data.source=synthetic", f"run.dir={tmp_path / 'run'}",
             f"run.compile_cache={tmp_path / 'cache'}")
    fit = check_target_fit(load(None, list(given)), lambda line: None)
    between = f"cluster.device_memory_gb={(fit['state_bytes'] + fit['total_bytes']) / 2 / 2**30:.6f}"
    (tmp_path / "tiny.yaml").write_text("model:\n  preset: tiny\n")  # base.yaml as CONFIG would undo the preset
    done = subprocess.run([str(Path(sys.executable).parent / "nestor"), "train", str(tmp_path / "tiny.yaml"), *given,
                           between], capture_output=True, text=True, timeout=600, env=child_env(),
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compile check: XLA:GPU" in done.stdout and "model.remat" in done.stderr, done.stderr[-3000:]
    assert "short by" in done.stderr and not (tmp_path / "run").exists(), done.stderr[-3000:]
    # the command's compile check read the figures this process kept: the same key in another process
    assert len(list((tmp_path / "cache" / FIGURES_DIR).iterdir())) == 1


@needs_gpu_compile
@pytest.mark.skipif(not cudnn_installed(), reason="cuDNN's attention lowers without a GPU only with cuDNN's wheel: "
                                                  "pip install -e '.[gpu-compile-cudnn]'")
def test_with_cudnn_installed_the_h100_program_runs_cudnns_flash_attention(tiny_config):
    job, compiled = compiled_for_target(tiny_config(*H100, "mesh.data=8"))
    assert job.backend.attention == job.backend.compiled_here().attention == "cudnn"
    assert job.backend.compiled_here().substitutions == ()
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', compiled.as_text())
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= set(calls)  # forward and backward


@needs_gpu_compile
@pytest.mark.parametrize(("kind", "device", "capability"), [("h200", "NVIDIA H200 141GB HBM3e", "9.0"),
                                                            ("b200", "NVIDIA B200", "10.0"),
                                                            ("a100-80gb", "NVIDIA A100-SXM4-80GB", "8.0")])
def test_each_shipped_gpu_target_compiles_the_step_for_its_device(tiny_config, kind, device, capability):
    job, compiled = compiled_for_target(tiny_config(f"cluster.device_kind={kind}", *H100[1:], "mesh.data=8"))
    first = job.mesh.devices.flat[0]
    assert (first.device_kind, first.compute_capability) == (device, capability)
    assert compiled.memory_analysis().temp_size_in_bytes > 0


@needs_gpu_compile
def test_the_1f1b_pipeline_compiles_for_8_h100s_with_its_permutes(tiny_config):
    job, compiled = compiled_for_target(tiny_config(*H100, "mesh.pipeline=2", "mesh.data=4", "pipeline.schedule=1f1b",
                                                    "pipeline.microbatches=4"))
    assert job.backend.deviceless and job.mesh.shape["pipeline"] == 2
    assert collectives(compiled.as_text())["collective-permute"]["count"] > 0
    assert compiled.memory_analysis().temp_size_in_bytes > 0


@needs_gpu_compile
def test_the_expert_exchange_is_a_ragged_all_to_all_on_h100s(tiny_config):
    # experts 128 x 256 on each device: the Mosaic GPU kernels' tiles, which cannot trace without the device
    job, compiled = compiled_for_target(tiny_config(*H100, *DROPLESS, "model.embed_dim=128", "moe.expert_mlp_dim=256",
                                                    "mesh.data=2", "mesh.expert=4"))
    here = job.backend.compiled_here()
    assert job.backend.exchange == here.exchange == RAGGED_ALL_TO_ALL
    assert job.backend.grouped_matmul == "mosaic_gpu_or_xla" and here.grouped_matmul == "xla"
    assert "grouped matmuls: Mosaic GPU kernels compiled as jax.lax.ragged_dot (they read the device's SM count)" in (
        here.substitutions)
    hlo = compiled.as_text()
    # asynchronous on GPU: a start and a done each; out to the experts and back, forward and backward
    assert len(re.findall(r" ragged-all-to-all-start\(", hlo)) >= 4
    assert collectives(hlo)["all-to-all"]["count"] >= 4  # explain counts them as all-to-alls


@needs_gpu_compile
def test_a_plan_for_h100s_ranks_both_expert_exchanges_of_a_dropless_model(tmp_path, monkeypatch):
    from nestor.orchestrator.loader.config import load
    from nestor.orchestrator.planning import search as search_module
    from nestor.orchestrator.planning.candidates import free_mesh, pinned_keys
    from nestor.orchestrator.planning.search import RANKED, search

    pins = [*H100, *DROPLESS, "mesh.expert=4", "mesh.fsdp=2", "mesh.pipeline=1", "mesh.tensor=1", "mesh.context=1",
            "model.remat=full", "train.grad_accum=1", "optimizer.shard_update=false"]
    config = load(None, [*TINY, f"run.compile_cache={tmp_path}", *free_mesh(pins), *pins], device_checks=False)
    plan = search(config, pinned_keys(pins), budget_s=600)
    assert plan.compiler.startswith("XLA:GPU") and plan.count(RANKED) == 2 and plan.cached == 0
    ranked = {j.candidate.as_dict()["moe.exchange"]: j.predicted for j in plan.ranked}
    assert set(ranked) == {"all_gather", "ragged_all_to_all"}
    # each costed by its own program's collectives (docs/plan.md, "How far to trust it")
    assert ranked["all_gather"]["within_host_s"] != ranked["ragged_all_to_all"]["within_host_s"]
    # planned again, as by another process: every compile's figures come from run.compile_cache, the ranking too
    monkeypatch.setattr(search_module, "_COMPILED", {})
    again = search(config, pinned_keys(pins), budget_s=600)
    assert again.compiles == again.cached == plan.compiles == 2
    assert [(j.candidate, j.predicted) for j in again.ranked] == [(j.candidate, j.predicted) for j in plan.ranked]


def gathered_layer_weights(report, hlo: str) -> set[tuple[int, ...]]:
    """Returns the shapes of the layers' weights (stacked, or one layer's) that the program all-gathers."""
    layers = {shape for row in report["params"] if row["name"].startswith("blocks/")
              for shape in (tuple(row["shape"]), tuple(row["shape"][1:]))}
    # every array of the result (XLA:GPU combines all-gathers into one start of tuples: operands, results)
    gathered = {tuple(int(size) for size in dims.split(",") if size)
                for line in collective_lines(hlo, "all-gather")
                for dims in re.findall(r"\w+\[([\d,]*)\]", line.split("=", 1)[1].split(" all-gather")[0])}
    return gathered & layers


@needs_gpu_compile
def test_on_h100s_each_mesh_axis_brings_its_own_collectives_and_explain_reports_xla_gpus(tiny_config):
    # fsdp: each layer's weights gathered forward, their gradients reduce-scattered backward
    fsdp = explain(tiny_config(*H100, "mesh.fsdp=8"))
    assert fsdp["compiler"].startswith("XLA:GPU")
    assert fsdp["collectives"]["all-gather"]["count"] > 0 and fsdp["collectives"]["reduce-scatter"]["count"] > 0
    assert gathered_layer_weights(fsdp, compiled_for_target(tiny_config(*H100, "mesh.fsdp=8"))[1].as_text())
    # tensor: activations summed over the axis in every layer (attention and MLP outputs), no weight gathered
    config = tiny_config(*H100, "model.num_kv_heads=4", "mesh.tensor=4", "mesh.data=2")
    report = explain(config)
    assert report["collectives"]["all-reduce"]["count"] >= 2 * config.model.num_layers
    assert report["collectives"]["reduce-scatter"]["count"] == 0
    job, compiled = compiled_for_target(config)
    assert not gathered_layer_weights(report, compiled.as_text())
    assert collectives(compiled.as_text()) == report["collectives"]  # explain's figures are this program's


@needs_gpu_compile
def test_the_context_ring_compiles_for_h100s(tiny_config):
    _, compiled = compiled_for_target(tiny_config(*H100, "mesh.context=4", "mesh.data=2",
                                                  "model.context_attention=ring"))
    assert collectives(compiled.as_text())["collective-permute"]["count"] > 0


@needs_gpu_compile
def test_fp8_dots_are_float8_gemms_in_xla_gpus_program(tiny_config):
    _, compiled = compiled_for_target(tiny_config(*H100, "mesh.data=8", "model.matmul_precision=fp8"))
    hlo = compiled.as_text()
    # XLA:GPU runs a GEMM as cuBLAS (Lt's float8 call) or as a Triton GEMM fusion; at the tiny model's sizes,
    # without autotuning, it picks Triton: the fusions' dots take float8 operands
    cublas = re.findall(r'custom_call_target="__cublas\$lt\$matmul\$f8"', hlo)
    triton = GEMM_FUSION_OPERANDS.findall(hlo)
    float8 = [pair for pair in triton if all(dtype.startswith("f8") for dtype in pair)]
    # the 7 weight matmuls of a block (query, key, value, out, gate, up, down) forward (e4m3 x e4m3) and their
    # two gradients (e5m2 gradients x e4m3)
    assert len(cublas) + len(float8) >= 3 * 7, (len(cublas), triton)
    assert {("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")} <= set(float8) or cublas


@needs_tpu_compile
def test_a_v5p_slice_compiles_with_xla_tpu(tiny_config):
    config = tiny_config("cluster.device_kind=tpu-v5p", "model.dtype=bfloat16", "cluster.hosts=2",
                         "cluster.devices_per_host=4", "mesh.data=2", "mesh.fsdp=4")
    report = explain(config)
    assert report["compiler"].startswith("XLA:TPU (libtpu ") and "tpu-v5p x8" in report["compiler"]
    assert report["mesh"]["platform"] == "tpu" and report["fit"]["fits"]
    assert report["collectives"]["all-gather"]["count"] > 0  # fsdp gathers each layer's weights


@needs_tpu_compile
def test_mesh_dcn_splits_a_tpu_target_into_slices(tiny_config):
    config = tiny_config("cluster.device_kind=tpu-v5p", "model.dtype=bfloat16", "cluster.hosts=4",
                         "cluster.devices_per_host=4", "mesh.dcn.data=2", "mesh.data=1", "mesh.fsdp=8")
    job, compiled = compiled_for_target(config)
    assert {device.slice_index for device in job.mesh.devices.flat} == {0, 1}  # two v5:2x2x2 slices of 8 chips
    # the data axis crosses the slices: each row of the mesh's data axis is one slice
    assert [{device.slice_index for device in row.flat} for row in job.mesh.devices.reshape(2, -1)] == [{0}, {1}]
    assert compiled.memory_analysis().temp_size_in_bytes > 0
