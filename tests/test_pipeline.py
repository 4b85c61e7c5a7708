"""Pipeline parallelism: same training as one device, stages on the pipeline axis, one checkpoint layout."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.commands.explain import compile_step, explain, format_report, param_table
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.job.state import init_state
from nestor.parallel.hlo import collective_lines, collectives, conditional_branch_ops, dot_operand_dtypes
from nestor.parallel.mesh import build_mesh
from nestor.parallel.pipeline import (BUFFERED, PER_STAGE_SKIPPING, PipelineLoop, Schedule, buffered_loop,
                                     pipeline_runner, skipping_stages, streamed_loop, vmapped_stages)
from nestor.parallel.pipeline_1f1b import _phases, one_f_one_b
from nestor.parallel.rules import DEFAULT_RULES
from tests.helpers import ONE_DEVICE, assert_same_training, mesh_overrides, run_fresh

PIPELINED = {
    "pipeline2_data2_tensor2_gpipe": (dict(pipeline=2, data=2, tensor=2), ["pipeline.microbatches=4"]),
    "pipeline4_fsdp2_gpipe": (dict(pipeline=4, fsdp=2), ["pipeline.microbatches=8"]),
    "pipeline2_data4_circular": (dict(pipeline=2, data=4), ["pipeline.microbatches=4", "pipeline.schedule=circular",
                                                            "pipeline.repeats=2", "model.num_layers=8"]),
    "pipeline2_fsdp2_tensor2_remat": (dict(pipeline=2, fsdp=2, tensor=2), ["pipeline.microbatches=4",
                                                                           "model.remat=full"]),
    "pipeline2_data2_tensor2_1f1b": (dict(pipeline=2, data=2, tensor=2), ["pipeline.microbatches=4",
                                                                          "pipeline.schedule=1f1b"]),
    "pipeline4_fsdp2_1f1b": (dict(pipeline=4, fsdp=2), ["pipeline.microbatches=8", "pipeline.schedule=1f1b"]),
    "pipeline2_data4_interleaved_1f1b": (dict(pipeline=2, data=4), ["pipeline.microbatches=4",
                                                                    "pipeline.schedule=interleaved_1f1b",
                                                                    "pipeline.repeats=2", "model.num_layers=8"]),
    "pipeline4_data2_zero_bubble": (dict(pipeline=4, data=2), ["pipeline.microbatches=8",
                                                               "pipeline.schedule=zero_bubble"]),
}
INVOLUNTARY = "Involuntary full rematerialization"


@pytest.fixture(scope="module")
def one_device_runs():
    """Returns runs(tiny_config, num_layers) -> the one-device result, trained once per depth."""
    cache = {}

    def runs(tiny_config, model_overrides):
        key = tuple(model_overrides)
        if key not in cache:
            cache[key] = run_fresh(tiny_config(*model_overrides).replace(**ONE_DEVICE))
        return cache[key]

    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", PIPELINED, ids=list(PIPELINED))
def test_pipelined_training_matches_one_device_without_involuntary_remat(name, tiny_config, one_device_runs, capfd):
    degrees, overrides = PIPELINED[name]
    reference = one_device_runs(tiny_config, [o for o in overrides if o.startswith("model.")])
    result = run_fresh(tiny_config(*overrides).replace(**mesh_overrides(**degrees)))
    assert_same_training(result, reference)
    assert INVOLUNTARY not in capfd.readouterr().err


def _pipeline_positions(job) -> dict[int, int]:
    """Returns device id -> its index on the pipeline mesh axis."""
    axis = list(job.mesh.axis_names).index("pipeline")
    return {device.id: index[axis] for index, device in np.ndenumerate(job.mesh.devices)}


def _permute_shifts(job, hlo: str) -> list[set[int]]:
    """Returns, for each collective-permute, the set of pipeline-position shifts (mod stages) it makes."""
    position = _pipeline_positions(job)
    stages = job.mesh.shape["pipeline"]
    shifts = []
    for line in collective_lines(hlo, "collective-permute"):
        pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])]
        shifts.append({(position[b] - position[a]) % stages for a, b in pairs})
    return shifts


def _assert_no_all_gather_of_the_stack(job, hlo: str) -> None:
    stack_shapes = {tuple(row["shape"]) for row in param_table(job.layout) if "layers" in row["logical_axes"]}
    layers = job.config.model.num_layers
    for line in collective_lines(hlo, "all-gather"):
        shape = tuple(int(d) for d in re.search(r"=\s*\(?\w+\[([\d,]*)\]", line).group(1).split(",") if d)
        assert shape not in stack_shapes and (not shape or shape[0] != layers), line


def test_pipelined_step_moves_activations_by_collective_permute_and_never_gathers_the_stack(tiny_config):
    job = build_job(tiny_config("pipeline.microbatches=8", "model.num_layers=8").replace(
        **mesh_overrides(pipeline=4, fsdp=2)))
    hlo = compile_step(job).as_text()
    assert {1} in _permute_shifts(job, hlo)
    assert collectives(hlo)["collective-permute"]["count"] >= 2 * job.config.pipeline.microbatches
    _assert_no_all_gather_of_the_stack(job, hlo)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["cpu", "cluster.device_kind=h100"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_full_remat_recovers_layer_inputs_without_a_second_stage_forward(schedule, target, tiny_config):
    # Each layer is its own checkpoint, so the backward pass gathers a stage's weights over fsdp as often under
    # `full` as under `dots`. With one checkpoint around the whole stage it ran the stage's forward once more to
    # recover the layer inputs and gathered them again: 204 and 276 all-gathers here against dots' 144 and 216.
    # A GPipe step meant for CPU skips its bubbles by a cond per layer (for an H100 it does not): there `full`
    # recomputes a layer inside the backward pass's cond, else it gathered the weights again (204 against 144).
    programs = {}
    for remat in ("full", "dots"):
        overrides = ["pipeline.microbatches=4", f"pipeline.schedule={schedule}", f"model.remat={remat}"]
        job = build_job(tiny_config(*overrides, *([target] if target != "cpu" else []))
                        .replace(**mesh_overrides(pipeline=2, fsdp=2, tensor=2)), with_data=False)
        compiled = compile_step(job)
        programs[remat] = (collectives(compiled.as_text())["all-gather"]["count"],
                           compiled.memory_analysis().temp_size_in_bytes)
    (full_gathers, full_temp), (dots_gathers, dots_temp) = programs["full"], programs["dots"]
    assert full_gathers == dots_gathers, programs
    assert full_temp < dots_temp, programs


def test_layer_stack_params_per_device_are_a_quarter_with_four_stages(tiny_config):
    job = build_job(tiny_config("pipeline.microbatches=4").replace(**mesh_overrides(pipeline=4, data=2)))
    rows = [row for row in param_table(job.layout) if "layers" in row["logical_axes"]]
    per_device = sum(row["bytes_per_device"] for row in rows)
    total = sum(row["bytes_total"] for row in rows)
    assert per_device <= 1.10 * total / 4


def _state_after(job, state, steps):
    for step in range(steps):
        state, _ = job.step_fn(state, job.data.batch(step))
    return state


@pytest.mark.slow
def test_state_trained_without_pipeline_continues_under_two_stages_with_the_same_loss(tiny_config):
    flat = build_job(tiny_config().replace(**mesh_overrides(data=4, tensor=2)))
    piped = build_job(tiny_config("pipeline.microbatches=4").replace(**mesh_overrides(pipeline=2, data=4)))
    assert jax.tree.map(lambda s: s.shape, flat.layout.abstract) == jax.tree.map(lambda s: s.shape,
                                                                                  piped.layout.abstract)
    saved = jax.device_get(_state_after(flat, init_state(flat.config, flat.layout), steps=2))
    losses = []
    for job in (flat, piped):
        _, metrics = job.step_fn(jax.device_put(saved, job.layout.shardings), job.data.batch(2))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_written_under_gpipe_on_two_stages_resumes_under_1f1b_on_four(tiny_config):
    import shutil

    from nestor.orchestrator.checkpoint.files import checkpoint_dir
    from tests.helpers import run

    gpipe = tiny_config("train.steps=3", "checkpoint.every=2", "pipeline.microbatches=4").replace(
        **mesh_overrides(pipeline=2, data=4))
    uninterrupted = run(gpipe)
    shutil.rmtree(checkpoint_dir(gpipe.run.dir) / "3")  # the newest is now the step-2 checkpoint
    resumed = run(gpipe.replace(**mesh_overrides(pipeline=4, data=2), **{"pipeline.schedule": "1f1b"}))
    assert resumed.first_step == 2
    np.testing.assert_allclose(resumed.losses, uninterrupted.losses[2:], rtol=1e-5)


INVALID = {
    "model.num_layers": ["mesh.pipeline=4", "mesh.data=2", "model.num_layers=6", "pipeline.microbatches=4"],
    "pipeline.repeats": ["mesh.pipeline=2", "mesh.data=4", "pipeline.repeats=2", "pipeline.microbatches=4",
                         "pipeline.schedule=1f1b"],
    "pipeline.microbatches": ["mesh.pipeline=4", "mesh.data=2", "model.num_layers=8", "pipeline.schedule=circular",
                              "pipeline.repeats=2", "pipeline.microbatches=2"],
    # interleaved 1F1B: layers into stages x repeats, micro-batches in whole groups of one per stage
    "model.num_layers interleaved": ["mesh.pipeline=2", "mesh.data=4", "pipeline.schedule=interleaved_1f1b",
                                     "pipeline.repeats=2", "pipeline.microbatches=4", "model.num_layers=6"],
    "pipeline.microbatches interleaved": ["mesh.pipeline=4", "mesh.data=2", "pipeline.schedule=interleaved_1f1b",
                                          "pipeline.repeats=2", "model.num_layers=8", "pipeline.microbatches=6",
                                          "train.global_batch=12"],
    "train.global_batch": ["mesh.pipeline=2", "mesh.data=4", "pipeline.microbatches=3"],
}


@pytest.mark.parametrize("key", INVALID)
def test_invalid_pipeline_config_raises_config_error_naming_its_key(key, tiny_config):
    with pytest.raises(ConfigError) as error:
        tiny_config(*INVALID[key])
    assert key.split()[0] in [problem_key for problem_key, _ in error.value.problems]


def test_microbatch_that_does_not_split_over_batch_axes_names_microbatches(tiny_config):
    with pytest.raises(ConfigError) as error:
        tiny_config("mesh.pipeline=2", "mesh.data=4", "pipeline.microbatches=8")
    assert [key for key, _ in error.value.problems] == ["pipeline.microbatches"]


EXPLAINED = {  # schedule overrides -> ticks, bubble fraction, in flight per stage (pipeline2 x data4, M = 4)
    "circular": (("pipeline.schedule=circular", "pipeline.repeats=2", "model.num_layers=8"), 9, 1 / 9, [8, 8],
                 "bubble 11.1%"),
    "1f1b": (("pipeline.schedule=1f1b",), 6, 1 / 5, [3, 1], "bubble 20.0%, micro-batches in flight per stage 3/1"),
    # R*M + (R+1)S - 2 ticks, bubble (S-1)/(R*M + S-1), (R+1)S - 1 - 2s in flight
    "interleaved_1f1b": (("pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2", "model.num_layers=8"), 12,
                         1 / 9, [5, 3], "bubble 11.1%, micro-batches in flight per stage 5/3"),
    # 1f1b's ticks; stage s keeps each input s ticks longer, for its deferred weight pass: 2S - 1 - s
    # weight passes in M of those ticks: bubble 2(S-1)/(3M + 2(S-1))
    "zero_bubble": (("pipeline.schedule=zero_bubble",), 6, 2 / 14, [3, 2],
                    "bubble 14.3%, micro-batches in flight per stage 3/2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", EXPLAINED)
def test_explain_reports_ticks_bubble_in_flight_and_temporaries(schedule, tiny_config):
    overrides, ticks, bubble, in_flight, line = EXPLAINED[schedule]
    config = tiny_config("pipeline.microbatches=4", *overrides).replace(**mesh_overrides(pipeline=2, data=4))
    report = explain(config)
    temporaries = report["memory_per_device_bytes"]["temporaries"]
    assert report["pipeline"] == {"schedule": schedule, "ticks": ticks, "microbatches": 4, "stages": 2,
                                  "repeats": 2 if "repeats=2" in " ".join(overrides) else 1,
                                  "bubble_fraction": pytest.approx(bubble), "in_flight": in_flight,
                                  "temporaries": temporaries}
    assert temporaries > 0 and line in format_report(report)


def _toy_layer(w, x, rows=None):
    """A layer whose stats depend on the micro-batch, so averaging and bubble masking show."""
    y = jnp.tanh(x * w + 0.1)
    return y, {"mean": jnp.mean(y), "rows": jnp.asarray(x.shape[0], jnp.float32)}


LOOPS = {"plain": BUFFERED, "skip": PipelineLoop("skip", skipping_stages, buffered_loop),
         "stream": PipelineLoop("stream", vmapped_stages, streamed_loop), "both": PER_STAGE_SKIPPING}


@pytest.mark.slow
@pytest.mark.parametrize("options", LOOPS)
@pytest.mark.parametrize("stages,repeats", [(4, 1), (2, 2), (4, 2)])
def test_runner_matches_a_scan_and_averages_stats_over_microbatches(stages, repeats, options):
    mesh = build_mesh({"pipeline": stages, "data": 8 // stages, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1})
    runner = pipeline_runner(Schedule(stages, microbatches=4, repeats=repeats), mesh, DEFAULT_RULES, ("batch", None),
                             loop=LOOPS[options])
    layers, x = 8, jax.random.normal(jax.random.key(0), (16, 8))
    w = 1 + 0.1 * jax.random.normal(jax.random.key(1), (layers, 8))

    def scanned(w, x):
        return jax.lax.scan(lambda h, wl: _toy_layer(wl, h), x, w)

    def microbatch_stats(w, x):  # each layer's stats per micro-batch (rows r % 4 == m), averaged
        per_micro = [scanned(w, x[m::4])[1] for m in range(4)]
        return jax.tree.map(lambda *s: sum(s) / 4, *per_micro)

    with jax.set_mesh(mesh):
        out, stats = jax.jit(lambda w, x: runner(_toy_layer, w, x))(w, x)
        grad = jax.jit(jax.grad(lambda w, x: jnp.sum(runner(_toy_layer, w, x)[0] ** 2)))(w, x)
    want_out, _ = scanned(w, x)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    want_stats = microbatch_stats(w, x)
    np.testing.assert_allclose(stats["mean"], want_stats["mean"], rtol=1e-5)
    np.testing.assert_array_equal(stats["rows"], np.full(layers, 4.0))
    want_grad = jax.grad(lambda w, x: jnp.sum(scanned(w, x)[0] ** 2))(w, x)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)


def _matmul_layer(w, x, rows=None):
    return jnp.tanh(x @ w), {}


def _row_layer(w, x, rows):
    """A layer that adds its row inputs, so a micro-batch reading another's rows shows."""
    return jnp.tanh(x * w + rows["offset"]), {}


@pytest.mark.parametrize("options", ["plain", "both"])
@pytest.mark.parametrize("stages,repeats", [(2, 1), (2, 2)])
def test_each_stage_reads_the_row_inputs_of_its_own_micro_batch(stages, repeats, options):
    mesh = build_mesh({"pipeline": stages, "data": 8 // stages, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1})
    runner = pipeline_runner(Schedule(stages, microbatches=4, repeats=repeats), mesh, DEFAULT_RULES, ("batch", None),
                             loop=LOOPS[options])
    x = jax.random.normal(jax.random.key(0), (16, 8))
    rows = {"offset": jax.random.normal(jax.random.key(2), (16, 8))}
    w = 1 + 0.1 * jax.random.normal(jax.random.key(1), (4, 8))
    with jax.set_mesh(mesh):
        out, _ = jax.jit(lambda w, x, rows: runner(_row_layer, w, x, rows))(w, x, rows)
    want, _ = jax.lax.scan(lambda h, wl: _row_layer(wl, h, rows), x, w)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_saveable,
            "full": jax.checkpoint_policies.nothing_saveable}


@pytest.mark.parametrize("skip_bubbles", [False, True])
@pytest.mark.parametrize("remat", POLICIES)
@pytest.mark.parametrize("repeats", [1, 2])
def test_backward_pass_keeps_no_copy_of_the_weights_per_iteration(remat, repeats, skip_bubbles, capsys):
    from jax.ad_checkpoint import print_saved_residuals  # the public form of jax's residual listing

    mesh = build_mesh({"pipeline": 2, "data": 4, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1})
    runner = pipeline_runner(Schedule(2, microbatches=4, repeats=repeats), mesh, DEFAULT_RULES, ("batch", None),
                             POLICIES[remat], LOOPS["skip" if skip_bubbles else "plain"])
    w, x = jnp.ones((8, 32, 32)), jnp.ones((16, 32))  # activations [micro-batch 4, 32] never end in (32, 32)
    capsys.readouterr()
    with jax.set_mesh(mesh):
        print_saved_residuals(lambda w: jnp.sum(runner(_matmul_layer, w, x)[0]), w)
    residuals = capsys.readouterr().out.splitlines()
    assert residuals
    weight_elements = 0  # one reshaped view of the stack is fine; a copy per iteration is not
    for line in residuals:
        shape = re.match(r"\w+\[([\d,]*)\] ", line)
        dims = [int(d) for d in shape.group(1).split(",") if d] if shape else []
        if dims[-2:] == [32, 32] and "from the argument" not in line:
            weight_elements += int(np.prod(dims))
    assert weight_elements <= w.size


@pytest.mark.parametrize("stages,repeats", [(2, 1), (2, 2)])
def test_skip_bubbles_puts_every_layer_product_in_a_branch_that_a_bubble_skips(stages, repeats):
    # Compiled forward and backward: with skipping_stages every matmul of the layers, forward and backward, sits in
    # one branch of a conditional whose other branch (the bubble's) has none; without it there is no conditional.
    mesh = build_mesh({"pipeline": stages, "data": 8 // stages, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1})
    w, x = jnp.ones((8, 32, 32)), jnp.ones((16, 32))
    dots = {}
    for skip in (False, True):
        runner = pipeline_runner(Schedule(stages, microbatches=4, repeats=repeats), mesh, DEFAULT_RULES,
                                 ("batch", None), loop=LOOPS["skip" if skip else "plain"])
        with jax.set_mesh(mesh):
            hlo = jax.jit(jax.grad(lambda w: jnp.sum(runner(_matmul_layer, w, x)[0]))).lower(w).compile().as_text()
        dots[skip] = (dot_operand_dtypes(hlo), conditional_branch_ops(hlo, "dot"))
    (plain, no_branches), (skipping, branches) = dots[False], dots[True]
    assert plain and not no_branches
    layer_branches = [counts for counts in branches if any(counts)]
    assert len(layer_branches) >= 2 and all(sorted(counts)[0] == 0 for counts in layer_branches), branches
    assert sum(sum(counts) for counts in layer_branches) == len(skipping) == len(plain)


@pytest.mark.parametrize("stream", [False, True])
def test_streamed_gpipe_loop_carries_no_microbatch_buffer(stream):
    # GPipe streamed: the micro-batches are the loop's xs and the outputs its ys; the carry is the stages' state.
    mesh = build_mesh({"pipeline": 2, "data": 4, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1})
    runner = pipeline_runner(Schedule(2, microbatches=4), mesh, DEFAULT_RULES, ("batch", None),
                             loop=LOOPS["stream" if stream else "plain"])
    w, x = jnp.ones((4, 8)), jnp.ones((16, 8))  # micro-batches [4, 4, 8]; the stages' state [2, 4, 8]
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda w, x: runner(_toy_layer, w, x))(w, x)
    loops = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    carries = [tuple(v.aval.shape) for eqn in loops
               for v in eqn.invars[eqn.params["num_consts"]:eqn.params["num_consts"] + eqn.params["num_carry"]]]
    assert len(loops) == 1 and (2, 4, 8) in carries
    assert ((4, 4, 8) in carries) is not stream, carries


def _toy_input(h, inputs):
    return inputs["x"] / h


def _toy_head(h, y, inputs):
    return jnp.mean((y * h - inputs["targets"]) ** 2), {"output_mean": jnp.mean(y)}


def _toy_stats_loss(stats):
    return 0.5 * jnp.sum(stats["mean"])


@pytest.mark.slow
@pytest.mark.parametrize("stages,microbatches,repeats,remat,zero_bubble", [
    (4, 8, 1, "none", False), (4, 2, 1, "full", False), (4, 4, 2, "full", False),
    (4, 8, 1, "none", True), (4, 2, 1, "full", True)])
def test_1f1b_gradients_equal_autodiff_of_the_microbatched_loss(stages, microbatches, repeats, remat, zero_bubble):
    mesh = build_mesh({"pipeline": stages, "data": 8 // stages, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1})
    schedule = Schedule(stages, microbatches, repeats, one_f_one_b=True, zero_bubble=zero_bubble)
    value_and_grad = one_f_one_b(schedule, mesh, DEFAULT_RULES, ("batch", None), POLICIES[remat])
    inputs = {"x": jax.random.normal(jax.random.key(0), (16, 8)), "targets": jax.random.normal(jax.random.key(2), (16, 8))}
    w, h = 1 + 0.1 * jax.random.normal(jax.random.key(1), (8, 8)), jnp.linspace(0.5, 1.5, 8)

    def per_microbatch(w, h):  # micro-batch m holds rows r % M == m, as the pipeline splits them
        for m in range(microbatches):
            rows = jax.tree.map(lambda leaf: leaf[m::microbatches], inputs)
            y, stats = jax.lax.scan(lambda carry, wl: _toy_layer(wl, carry), _toy_input(h, rows), w)
            yield y, stats, _toy_head(h, y, rows)[0] + _toy_stats_loss(stats)

    def reference(w, h):
        return sum(loss for _, _, loss in per_microbatch(w, h)) / microbatches

    with jax.set_mesh(mesh):
        (loss, metrics, stats), grads = jax.jit(lambda w, h: value_and_grad(
            _toy_layer, _toy_input, _toy_head, w, h, inputs, None, _toy_stats_loss))(w, h)
    want_loss, want_grads = jax.value_and_grad(reference, argnums=(0, 1))(w, h)
    np.testing.assert_allclose(loss + _toy_stats_loss(stats), want_loss, rtol=1e-6)
    np.testing.assert_array_equal(stats["rows"], np.full(8, 16 / microbatches))
    np.testing.assert_allclose(metrics["output_mean"], np.mean([jnp.mean(y) for y, _, _ in per_microbatch(w, h)]),
                               rtol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stages,microbatches", [(4, 8), (4, 2), (2, 4)])
def test_zero_bubble_defers_each_weight_pass_after_its_input_pass_into_m_ticks(stages, microbatches):
    zero_bubble = Schedule(stages, microbatches, one_f_one_b=True, zero_bubble=True)
    one_f_one_b = dataclasses.replace(zero_bubble, zero_bubble=False)
    ticks = {}
    for schedule in (zero_bubble, one_f_one_b):
        runs = {pass_: {} for pass_ in ("backward", "weights")}
        for tick in range(schedule.iterations):
            for stage in range(stages):
                for pass_, work in (("backward", schedule.backward_work(tick, stage)),
                                    ("weights", schedule.weight_work(tick, stage))):
                    if 0 <= work.position < microbatches:
                        runs[pass_][stage, int(work.microbatch)] = tick
        assert sorted(runs["weights"]) == sorted(runs["backward"]) == [
            (s, m) for s in range(stages) for m in range(microbatches)]
        assert all(runs["weights"][key] - runs["backward"][key] == (key[0] if schedule.zero_bubble else 0)
                   for key in runs["backward"])
        ticks[schedule.name] = set(runs["weights"].values())
        assert set(range(*schedule.spans()["weights"])) == ticks[schedule.name]
    assert len(ticks["zero_bubble"]) == microbatches and len(ticks["1f1b"]) == microbatches + stages - 1
    # the loop runs the weight pass in exactly those ticks
    assert {t for start, stop, (_, _, weights) in _phases(zero_bubble) if weights
            for t in range(start, stop)} == ticks["zero_bubble"]
    assert zero_bubble.in_flight() == [min(microbatches, 2 * stages - 1 - s) for s in range(stages)]


@pytest.fixture(scope="module")
def compiled_by_schedule(tmp_path_factory):
    """Returns {(schedule, M): (job, compiled step)} on pipeline4 x data2, 2 sequences per micro-batch
    (global batch 2M), compiled only."""
    from nestor.orchestrator.loader import config as config_lib
    from tests.settings import TINY

    compiled = {}
    interleaved = ("pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2", "model.num_layers=8")
    for schedule, overrides, microbatches_range in (("gpipe", ("pipeline.schedule=gpipe",), (4, 32)),
                                                    ("1f1b", ("pipeline.schedule=1f1b",), (4, 32)),
                                                    ("interleaved_1f1b", interleaved, (4, 32)),
                                                    ("zero_bubble", ("pipeline.schedule=zero_bubble",), (4, 32))):
        for microbatches in microbatches_range:
            config = config_lib.load(None, [*TINY, f"run.dir={tmp_path_factory.mktemp('run')}",
                                            f"train.global_batch={2 * microbatches}",
                                            f"pipeline.microbatches={microbatches}", *overrides])
            job = build_job(config.replace(**mesh_overrides(pipeline=4, data=2)), with_data=False)
            compiled[schedule, microbatches] = job, compile_step(job)
    return compiled


@pytest.mark.slow
def test_1f1b_temporaries_stay_flat_in_microbatches_while_gpipe_grows(compiled_by_schedule):
    temp = {key: compiled.memory_analysis().temp_size_in_bytes for key, (_, compiled) in compiled_by_schedule.items()}
    assert temp["1f1b", 32] <= 1.25 * temp["1f1b", 4]
    assert temp["gpipe", 32] > 2 * temp["gpipe", 4]
    assert temp["1f1b", 32] < temp["gpipe", 32]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_interleaved_and_zero_bubble_temporaries_stay_flat_in_microbatches(schedule, compiled_by_schedule):
    temp = {key: compiled.memory_analysis().temp_size_in_bytes for key, (_, compiled) in compiled_by_schedule.items()}
    assert temp[schedule, 32] <= 1.25 * temp[schedule, 4]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zero_bubble"])
def test_1f1b_permutes_both_ways_along_the_pipeline_and_never_gathers_the_stack(schedule, compiled_by_schedule):
    job, compiled = compiled_by_schedule[schedule, 4]
    hlo = compiled.as_text()
    shifts = _permute_shifts(job, hlo)
    assert {1} in shifts and {job.mesh.shape["pipeline"] - 1} in shifts  # to the next stage and to the previous
    _assert_no_all_gather_of_the_stack(job, hlo)
