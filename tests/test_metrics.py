"""Metrics: TensorBoard holds what metrics.jsonl holds; expert-load heatmap; honest FLOPs and MFU;
`nestor explain` compiles once and reports what it compiled."""

import functools
import gzip
import json
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.commands.explain import explain, format_report
from nestor.orchestrator.job.compiled import compile_step, cost_flops, step_flops
from nestor.orchestrator.loop.peak_flops import peak_tflops
from nestor.orchestrator.specs.lm_flops import executed_flops_per_step, model_flops_per_step
from nestor.orchestrator.loop.goodput import RUN_CATEGORIES
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.loop.metrics import (EXPERT_LOAD, MetricsWriter, Throughput, expert_load_figure, expert_load_image,
                                  spec_text, tensorboard_tag)
from tests.settings import ROOT, TINY
from tests.helpers import run

TIMINGS = {"compile_s": [1], "checkpoint_s": [2, 4]}  # logged steps of the loop's one-off times in traced_run
SCALARS = ("loss", "lm_loss", "lr", "grad_norm", "param_norm", "step_time_s", "tokens_per_s",
           "tflops_per_device", "mfu", "goodput_fraction", *(f"goodput_{name}" for name in RUN_CATEGORIES))
MOE = ("moe.num_experts=4", "moe.every=2", "moe.top_k=2")


def read_events(tb_dir) -> EventAccumulator:
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """Returns the config of a finished tiny run of 4 steps: steps 2..3 traced, a checkpoint every 2 steps,
    and a made-up peak that gives CPU an MFU so the tag can be checked (a real CPU run logs none)."""
    config = config_lib.load(None, [*TINY, f"run.dir={tmp_path_factory.mktemp('run')}", "train.steps=4",
                                    "metrics.peak_tflops=1.0", "profile.start_step=2", "profile.steps=2",
                                    "checkpoint.every=2"])
    run(config)
    return config


def test_tensorboard_scalars_equal_metrics_jsonl(traced_run):
    records = [json.loads(line) for line in open(f"{traced_run.run.dir}/metrics.jsonl")]
    events = read_events(f"{traced_run.run.dir}/tb")
    assert sorted(events.Tags()["scalars"]) == sorted(tensorboard_tag(name) for name in (*SCALARS, *TIMINGS))
    for name in (*SCALARS, *TIMINGS):
        logged = {e.step: e.value for e in events.Scalars(tensorboard_tag(name))}
        assert sorted(logged) == TIMINGS.get(name, [1, 2, 3, 4])
        np.testing.assert_allclose([logged[r["step"]] for r in records if name in r],
                                   [r[name] for r in records if name in r], rtol=1e-6)
    texts = set(events.Tags()["tensors"])  # tensorboardX text summaries read back as tensors
    assert {"config/text_summary", "sharding/text_summary"} <= texts


def test_compile_and_checkpoint_seconds_are_logged_where_they_were_spent(traced_run):
    records = {r["step"]: r for r in map(json.loads, open(f"{traced_run.run.dir}/metrics.jsonl"))}
    assert 0 < records[1]["compile_s"] < 300  # the step is compiled before step 1 runs
    assert [step for step, r in records.items() if "checkpoint_s" in r] == [2, 4]  # checkpoint.every=2
    assert all(0 < records[step]["checkpoint_s"] < 60 for step in (2, 4))


def test_profile_plugin_lists_a_trace_of_exactly_the_requested_steps(traced_run):
    import argparse

    from tensorboard.plugins.base_plugin import TBContext
    from xprof.profile_plugin import ProfilePlugin

    tb_dir = Path(traced_run.run.dir) / "tb"
    plugin = ProfilePlugin(TBContext(logdir=str(tb_dir), flags=argparse.Namespace(master_tpu_unsecure_channel="")))
    [profile_run] = plugin.runs_imp()  # one trace, at the TensorBoard run the scalars are in
    assert {"trace_viewer@", "overview_page", "op_profile"} <= set(plugin.run_tools_imp(profile_run))
    [trace] = (tb_dir / "plugins/profile" / profile_run).glob("*.trace.json.gz")
    events = json.load(gzip.open(trace))["traceEvents"]
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    assert steps == [2, 3]  # profile.start_step=2, profile.steps=2


TRACER_SECONDS = 1.0  # a stand-in tracer's start and stop each take this long


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [("profile.start_step=2",), ("profile.start_step=1",),
                                       ("checkpoint.every=1", "profile.start_step=3")],
                         ids=["mid_run", "first_step", "after_a_checkpoint"])
def test_traced_steps_are_timed_without_the_trace_starting_or_being_written(tmp_path, monkeypatch, overrides):
    # The last traced step used to be timed from after the trace was written to just after the next
    # step's dispatch: near zero on a GPU (0.008 s against 0.43 s per step on an H100, MFU 2759%), while
    # the step before it carried the writing; and a trace started after a checkpoint, or at step 1, was
    # timed into the first traced step. A tiny step takes about 0.03 s here.
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *_, **__: time.sleep(TRACER_SECONDS))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: time.sleep(TRACER_SECONDS))
    config = config_lib.load(None, [*TINY, f"run.dir={tmp_path}", "train.steps=4", "profile.steps=2", *overrides])
    run(config)
    seconds = {r["step"]: r["step_time_s"] for r in map(json.loads, open(tmp_path / "metrics.jsonl"))}
    assert sorted(seconds) == [1, 2, 3, 4] and max(seconds.values()) < TRACER_SECONDS, seconds


EVALUATOR_SECONDS = 2.0  # a stand-in evaluation takes at least this long; a tiny step about 0.05 s


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [(), ("profile.start_step=3", "profile.steps=1")],
                         ids=["untraced", "trace_after_the_evaluation"])
def test_an_evaluation_is_timed_as_eval_s_and_never_as_a_step(tmp_path, monkeypatch, overrides):
    # An evaluation used to be dispatched before the previous step was read, so on CPU (where it runs
    # as it is dispatched) its time, its first compile included, landed on the step before it; and a
    # trace starting after an evaluated step must not move that step's end past its evaluation.
    from nestor.orchestrator.job.eval_loss import Evaluator

    evaluate = Evaluator.__call__

    def slow(self, state):
        time.sleep(EVALUATOR_SECONDS)
        return evaluate(self, state)

    monkeypatch.setattr(Evaluator, "__call__", slow)
    config = config_lib.load(None, [*TINY, f"run.dir={tmp_path}", "train.steps=4", "eval.every=2",
                                    "eval.steps=1", "eval.source=synthetic", *overrides])
    run(config)
    records = {r["step"]: r for r in map(json.loads, open(tmp_path / "metrics.jsonl"))}
    assert sorted(records) == [1, 2, 3, 4]
    assert max(r["step_time_s"] for r in records.values()) < EVALUATOR_SECONDS, records
    assert [step for step, r in records.items() if "eval_s" in r] == [2, 4]
    assert all(EVALUATOR_SECONDS <= records[step]["eval_s"] < 120 for step in (2, 4))
    assert tensorboard_tag("eval_s") == "perf/eval_s"
    assert {tensorboard_tag("eval_s"), tensorboard_tag("eval_loss")} <= set(
        read_events(tmp_path / "tb").Tags()["scalars"])


def test_profile_kinds_sort_the_kernels_of_an_h100_trace():
    from bench.profile_top import kind

    # kernel names from bench.mfu --profile on an H100 (docs/benchmarks.md)
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64") == "attention"
    assert kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "matmul"
    assert kind("gemm_fusion_dot_22") == kind("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n") == "matmul"
    assert kind("memcpy128") == kind("loop_transpose_fusion_2") == kind("loop_dynamic_update_slice_fusion_4") == "copy"
    assert kind("input_scatter_fusion") == kind("loop_gather_fusion_1") == kind("dynamic_slice_fusion") == \
        "sort, gather, scatter"
    assert kind("loop_add_multiply_fusion") == kind("input_add_reduce_fusion_5") == "elementwise, reductions"


def test_tensorboard_tags_are_grouped_and_new_metrics_get_one():
    assert [tensorboard_tag(name) for name in ("loss", "lr", "grad_norm", "mfu", "step_time_s")] == [
        "train/loss", "train/lr", "train/grad_norm", "perf/mfu", "perf/step_time_s"]
    assert [tensorboard_tag(name) for name in ("moe_aux_loss", "moe_expert_load", "eval_loss")] == [
        "moe/aux_loss", "moe/expert_load", "eval/loss"]
    assert tensorboard_tag("attention_entropy") == "train/attention_entropy"  # a metric no table names


def test_expert_load_heatmap_is_logged_every_image_every_steps(tiny_config):
    config = tiny_config("metrics.image_every=2")
    writer = MetricsWriter(config, Throughput(config, 8, "cpu"), enabled=True)
    writer.start(0, "table", "data 8 over 1 process(es)")
    load = np.array([[10, 0, 5, 1], [4, 4, 4, 4], [0, 0, 0, 16]], np.float32)  # [layers, experts]
    for step in (1, 2, 3, 4):
        writer.write(step, {"loss": np.float32(1.0), EXPERT_LOAD: load}, 0.5)
    writer.close()
    images = read_events(f"{config.run.dir}/tb").Images("moe/expert_load")
    assert [image.step for image in images] == [2, 4]
    assert (images[0].height, images[0].width, 3) == expert_load_image(load, 2).shape
    # metrics.jsonl keeps the per-layer numbers the image shows
    assert json.loads(open(f"{config.run.dir}/metrics.jsonl").readline())[EXPERT_LOAD][1] == [4.0] * 4


def test_expert_load_heatmap_colours_cells_by_load_with_axes_and_colour_bar():
    load = np.array([[10, 0, 5, 1], [4, 4, 4, 4], [0, 0, 0, 16]], np.float32)  # [MoE layers, experts]
    figure = expert_load_figure(load, 7, layers=[1, 3, 5])
    figure.canvas.draw()
    pixels = np.asarray(figure.canvas.buffer_rgba())[..., :3].astype(int)
    assert 200 <= pixels.shape[0] <= 1200 and 400 <= pixels.shape[1] <= 1200
    heatmap, colour_bar = figure.axes

    def cell(layer, expert):
        x, y = heatmap.transData.transform((expert, layer))  # a cell's centre, from the bottom left
        return pixels[pixels.shape[0] - round(y), round(x)]

    idle, even, overloaded = cell(0, 1), cell(1, 2), cell(2, 3)
    assert idle[2] > idle[0] + 50 and overloaded[0] > overloaded[2] + 50  # blue vs red
    assert even.min() > 200  # balanced is near white
    shown = [label.get_text() for label in heatmap.get_yticklabels() if label.get_text()]
    assert shown == ["1", "3", "5"]  # the model's layer index of each MoE layer
    assert heatmap.get_xlabel() == "expert" and "step 7" in heatmap.get_title()
    assert colour_bar.get_ylabel() == "tokens / even share"
    rendered = expert_load_image(load, 7, layers=[1, 3, 5])
    assert rendered.dtype == np.uint8 and np.array_equal(rendered, pixels)


@pytest.mark.slow
def test_every_tag_and_metrics_key_of_a_moe_run_is_documented(tiny_config):
    config = tiny_config("train.steps=2", "metrics.peak_tflops=1.0", "metrics.image_every=1", *MOE,
                         "moe.bias_update_rate=0.001")
    run(config)
    events = read_events(f"{config.run.dir}/tb")
    tags = {tag for kind in ("scalars", "images", "tensors") for tag in events.Tags()[kind]}
    bias_tags = {tag for tag in tags if tag.startswith("moe/expert_bias/")}
    assert len(bias_tags) == 2 * 4  # MoE layers 1 and 3 x 4 experts
    tags = tags - bias_tags | {"moe/expert_bias/layer_<L>/expert_<e>"}
    keys = {key for line in open(f"{config.run.dir}/metrics.jsonl") for key in json.loads(line)}
    resumed = MetricsWriter(config, Throughput(config, 8, "cpu"), enabled=False)  # what a resume adds, untrained
    resumed.start(2, "", "data 8 over 1 process(es)")
    keys |= set(resumed.write(3, {"loss": np.float32(1.0)}, 0.5))
    assert {"moe/expert_load", "perf/mfu", "moe/aux_loss"} <= tags and {"resumed_from", EXPERT_LOAD} <= keys
    docs = (ROOT / "docs/monitoring.md").read_text()
    assert sorted(name for name in tags | keys if f"`{name}`" not in docs) == []


@pytest.mark.slow
@pytest.mark.parametrize("model", [(), (*MOE, "moe.dispatch=einsum"), (*MOE, "moe.dispatch=sort")],
                         ids=["dense", "moe_einsum", "moe_sort"])
def test_analytic_flops_match_xla_cost_analysis(tiny_config, model):
    # XLA multiplies the whole masked T x T attention and GShard's dispatch/combine einsums over
    # every capacity slot (sort dispatch: only the gate-weighted sum): executed_flops_per_step counts
    # those; the model FLOPs used for MFU do not.
    config = tiny_config("train.seq_len=128", "cluster.devices_per_host=1", "mesh.data=1", "model.remat=none", *model)
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
    "moe_pipeline2_accum2": pytest.param(("mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", "pipeline.microbatches=2",
                                          "train.grad_accum=2", *MOE), marks=pytest.mark.slow),
}


@pytest.mark.default_cpu_codegen  # XLA's FLOPs of an unrolled step with no loop left
@pytest.mark.slow
@pytest.mark.parametrize("overrides", STEPS.values(), ids=STEPS.keys())
def test_one_compile_flops_match_xla_on_the_unrolled_step(tiny_config, monkeypatch, overrides):
    # The two are different programs: unrolled, XLA keeps more elementwise work (the pipeline's
    # bubble selects); the matmuls are the same. Measured: 1.000, 1.001, 0.986.
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_mfu_bench_rows_are_model_flops_over_measured_time_and_peak(tmp_path):
    from bench import mfu

    printed = []
    model = "tiny train.global_batch=8 train.seq_len=32 cluster.devices_per_host=2"  # 2 devices: a cheaper compile
    row, failed = mfu.rows([model], ["full"], ["xla", "cudnn"], "float32", steps=2, warmup=1, peak_override=2.0,
                           report=printed.append, profile_dir=str(tmp_path))
    config = mfu.model_config(model, "full", "xla", "float32", 2)
    assert row["devices"] == 2 and row["flops_per_step"] == model_flops_per_step(config)
    assert row["attention_run"] == "jax.nn.dot_product_attention (xla)"  # what was asked: the cell says xla
    assert row["tflops_per_device"] == pytest.approx(row["flops_per_step"] * 2 / row["seconds"] / 2 / 1e12)
    assert row["tokens_per_s"] == pytest.approx(8 * 32 * 2 / row["seconds"])
    assert row["mfu"] == pytest.approx(row["tflops_per_device"] / 2.0)
    assert 0 < row["temp_gib"] < 1
    cells = [cell.strip() for cell in printed[0].strip("|").split("|")]
    assert cells[2] == "xla"
    assert float(cells[3].replace(",", "")) == pytest.approx(row["tokens_per_s"], abs=0.5)
    assert float(cells[5].rstrip("%")) == pytest.approx(100 * row["mfu"], abs=0.05)
    assert "model.attention" in failed["error"]  # cuDNN in float32 is refused with the config key, the row kept
    # --profile: per timeline its busy time, printed under the row, is the sum of its operations in costs.tsv
    busy = {line.strip().split(": ")[0]: float(line.split(": ")[1].split(" ms")[0])
            for line in printed[1:] if "busy per step" in line}
    costs = {}
    for line in (tmp_path / "0" / "costs.tsv").read_text().splitlines():
        timeline, kind, ms, name = line.split("\t")
        costs[timeline] = costs.get(timeline, 0.0) + float(ms)
    assert busy and busy.keys() == costs.keys()
    assert all(busy[timeline] == pytest.approx(costs[timeline], abs=0.01) for timeline in busy)
    assert (tmp_path / "0" / "step.hlo.txt").read_text().startswith("HloModule")
