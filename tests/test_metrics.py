"""Metrics: TensorBoard holds what metrics.jsonl holds; expert-load heatmap; honest FLOPs and MFU;
`nestor explain` compiles once and reports what it compiled."""

import functools
import json

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from orchestrator import config as config_lib
from orchestrator.explain import compile_step, cost_flops, explain, format_report, step_flops
from orchestrator.flops import executed_flops_per_step, model_flops_per_step, peak_tflops
from orchestrator.metrics import EXPERT_LOAD, MetricsWriter, Throughput, expert_load_image, spec_text
from orchestrator.train import build_job
from tests.conftest import TINY
from tests.helpers import run

SCALARS = ("loss", "lm_loss", "lr", "grad_norm", "param_norm", "step_time_s", "tokens_per_s",
           "tflops_per_device", "mfu")


def read_events(tb_dir) -> EventAccumulator:
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_scalars_equal_metrics_jsonl(tiny_config):
    # A made-up peak gives CPU an MFU so the tag can be checked; a real CPU run logs none.
    config = tiny_config("train.steps=4", "metrics.peak_tflops=1.0")
    run(config)
    records = [json.loads(line) for line in open(f"{config.run.dir}/metrics.jsonl")]
    events = read_events(f"{config.run.dir}/tb")
    assert set(SCALARS) <= set(events.Tags()["scalars"])
    for tag in SCALARS:
        logged = {e.step: e.value for e in events.Scalars(tag)}
        assert sorted(logged) == [1, 2, 3, 4]
        np.testing.assert_allclose([logged[r["step"]] for r in records], [r[tag] for r in records], rtol=1e-6)
    texts = set(events.Tags()["tensors"])  # tensorboardX text summaries read back as tensors
    assert {"config/text_summary", "sharding/text_summary"} <= texts


def test_expert_load_heatmap_is_logged_every_image_every_steps(tiny_config):
    config = tiny_config("metrics.image_every=2")
    writer = MetricsWriter(config, Throughput(config, 8, "cpu"), enabled=True)
    writer.start(0, "table")
    load = np.array([[10, 0, 5, 1], [4, 4, 4, 4], [0, 0, 0, 16]], np.float32)  # [layers, experts]
    for step in (1, 2, 3, 4):
        writer.write(step, {"loss": np.float32(1.0), EXPERT_LOAD: load}, 0.5)
    writer.close()
    images = read_events(f"{config.run.dir}/tb").Images(EXPERT_LOAD)
    assert [image.step for image in images] == [2, 4]
    assert (images[0].height, images[0].width) == (3 * 16, 4 * 16)
    pixels = expert_load_image(load)[::16, ::16, 0]  # one pixel per (layer, expert)
    assert pixels[1].tolist() == [128] * 4  # even load is mid-grey
    assert pixels[0, 1] == 0 and pixels[2, 3] == 255  # idle expert black, overloaded white
    # metrics.jsonl keeps the per-layer numbers the image shows
    assert json.loads(open(f"{config.run.dir}/metrics.jsonl").readline())[EXPERT_LOAD][1] == [4.0] * 4


MOE = ("moe.num_experts=4", "moe.every=2", "moe.top_k=2")


@pytest.mark.parametrize("model", [(), MOE], ids=["dense", "moe"])
def test_analytic_flops_match_xla_cost_analysis(tiny_config, model):
    # XLA multiplies the whole masked T x T attention and GShard's dispatch/combine einsums over
    # every capacity slot: executed_flops_per_step counts those; the model FLOPs used for MFU do not.
    config = tiny_config("train.seq_len=128", "cluster.devices_per_host=1", "mesh.data=1", *model)
    xla = step_flops(compile_step(build_job(config)))
    executed = executed_flops_per_step(config)
    assert executed / xla == pytest.approx(1.0, abs=0.10)
    assert model_flops_per_step(config) < 0.9 * executed  # masked attention and routing are not credited to MFU


def unrolled_xla_flops(config, monkeypatch) -> float:
    """Returns XLA's cost analysis of the train step compiled with every scan unrolled (no loop left to count once)."""
    with monkeypatch.context() as patch:
        patch.setattr(jax.lax, "scan", functools.partial(jax.lax.scan, unroll=True))
        compiled = compile_step(build_job(config))
    assert " while(" not in compiled.as_text()
    return cost_flops(compiled)


STEPS = {  # loops: layer scan; accumulation > layer scan; accumulation > pipeline > stage's layers
    "dense_accum2": ("cluster.devices_per_host=1", "mesh.data=1", "train.grad_accum=2"),
    "moe": ("cluster.devices_per_host=1", "mesh.data=1", *MOE),
    "moe_pipeline2_accum2": pytest.param(("mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", "pipeline.microbatches=4",
                                          "train.grad_accum=2", *MOE), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("overrides", STEPS.values(), ids=STEPS.keys())
def test_one_compile_flops_match_xla_on_the_unrolled_step(tiny_config, monkeypatch, overrides):
    # The two are different programs: unrolled, XLA keeps more elementwise work (the pipeline's
    # bubble selects); the matmuls are the same. Measured: 1.001, 1.001, 0.973.
    config = tiny_config(*overrides)
    assert step_flops(compile_step(build_job(config))) / unrolled_xla_flops(config, monkeypatch) == pytest.approx(
        1.0, abs=0.05)


@pytest.fixture(scope="module")
def moe_explained(tmp_path_factory):
    """Returns (report, compiles of the train step) of `explain` on a tiny MoE model without a pipeline,
    its embed axis split over two mesh axes."""
    config = config_lib.load(None, [*TINY, f"run.dir={tmp_path_factory.mktemp('run')}", *MOE, "mesh.data=2",
                                    "mesh.expert=2", "mesh.tensor=2", "mesh.rules.embed=[fsdp,data]"])
    compiles = []

    def count(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and kwargs.get("fun_name") == "jit(step)":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        report = explain(config)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    return report, len(compiles)


def test_explain_compiles_the_train_step_once(moe_explained):
    _, compiles = moe_explained
    assert compiles == 1


def test_explain_json_gives_specs_as_lists_and_no_pipeline_without_one(moe_explained):
    report, _ = moe_explained
    report = json.loads(json.dumps(report))
    specs = {row["name"]: row["spec"] for row in report["params"]}
    assert specs["blocks/expert_layer/mlp/up"] == ["pipeline", "expert", ["fsdp", "data"], "tensor"]
    assert specs["final_norm/scale"] == [None]
    assert report["pipeline"] is None
    assert "pipeline:" not in format_report(report)


def test_explain_parameter_table_columns_line_up_whatever_their_widths(moe_explained):
    report, _ = moe_explained
    lines = format_report(report).splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["name", "shape"])
    rows = lines[header + 1:header + 1 + len(report["params"])]
    spec_column, bytes_column = lines[header].index("spec"), lines[header].index("per device")
    for line, row in zip(rows, report["params"]):
        assert line.index(spec_text(row["spec"]), spec_column) == spec_column, line
        assert line[bytes_column - 2:bytes_column] == "  " and line[bytes_column] != " ", line


def test_peak_table_knows_accelerators_and_refuses_to_guess():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert peak_tflops("TPU v5 lite", "bfloat16") == 197.0
    assert peak_tflops("TPU v5p", "bfloat16") == 459.0
    assert peak_tflops("cpu", "float32") is None
    assert peak_tflops("TPU v4", "float32") is None
    assert peak_tflops("cpu", "float32", override=2.5) == 2.5


def test_mfu_is_flops_over_peak_and_absent_on_cpu(tiny_config):
    config = tiny_config()
    per_device = model_flops_per_step(config) / 8 / 1e12 / 0.5
    assert "mfu" not in Throughput(config, 8, "cpu").measure(0.5)
    measured = Throughput(config, 8, "NVIDIA H100 80GB HBM3").measure(0.5)
    assert measured["tflops_per_device"] == pytest.approx(per_device)
    assert measured["mfu"] == pytest.approx(per_device / 67.0)  # tiny_config is float32
