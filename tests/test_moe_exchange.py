"""The ragged all-to-all exchange of dropless experts (parallel/experts.py): its sizes and offsets
against a numpy reference of who sends which rows to whom, the whole exchange against the all-gather
exchange (the collective emulated on CPU, whose XLA lacks it), its StableHLO for GPU, and the choice of
exchange by platform and `moe.exchange`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nestor.backend import EXCHANGE_CHOICES, resolve_backend
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.job.state import init_state
from nestor.orchestrator.job.step import make_grad_fn
from nestor.orchestrator.job.step import backend_request
from nestor.parallel.experts import ALL_GATHER, RAGGED_ALL_TO_ALL, receive_plan, send_plan
from nestor.parallel.hlo import collective_lines
from tests.helpers import mesh_overrides
from tests.test_moe import MOE

DEVICES, LOCAL_EXPERTS, ROWS = 4, 3, 10


def numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
    """Returns every device's result of jax.lax.ragged_all_to_all with one slice per device, as its
    docstring specifies: device s sends operand[input_offsets[d]:+send_sizes[d]] to device d, which
    writes it at s's output_offsets[d]; recv_sizes must agree with the sizes sent."""
    results = [np.array(output) for output in outputs]
    for source in range(len(operands)):
        for target in range(len(operands)):
            start, size, at = input_offsets[source][target], send_sizes[source][target], output_offsets[source][target]
            assert recv_sizes[target][source] == size
            results[target][at:at + size] = operands[source][start:start + size]
    return results


def all_to_all(per_device: list[np.ndarray]) -> list[np.ndarray]:
    """Returns jax.lax.all_to_all(x, axis, 0, 0, tiled=True) of one entry per device: device d gets
    element d of every device's x, in device order."""
    return [np.array([x[target] for x in per_device]) for target in range(len(per_device))]


def test_ragged_plan_sends_each_row_to_its_experts_device_and_back():
    rng = np.random.default_rng(0)
    experts = [rng.integers(0, DEVICES * LOCAL_EXPERTS + 1, ROWS) for _ in range(DEVICES)]  # the last: no expert
    sorted_rows = []  # per device: (source, expert, row) of its rows sorted by expert, as rows of 3 numbers
    for source, chosen in enumerate(experts):
        order = np.argsort(chosen, kind="stable")
        sorted_rows.append(np.stack([np.full(ROWS, source), chosen[order], order], axis=1))
    counts = [np.bincount(chosen, minlength=DEVICES * LOCAL_EXPERTS + 1)[:-1] for chosen in experts]
    sends = [send_plan(jnp.asarray(count), DEVICES) for count in counts]
    received_counts = all_to_all([count.reshape(DEVICES, LOCAL_EXPERTS) for count in counts])
    buffer_rows = ROWS * DEVICES
    receives = [receive_plan(jnp.asarray(count), buffer_rows) for count in received_counts]
    input_offsets, send_sizes = ([np.asarray(plan[i]) for plan in sends] for i in (0, 1))
    receive_offsets, recv_sizes, row_experts = ([np.asarray(plan[i]) for plan in receives] for i in (0, 1, 2))
    output_offsets = all_to_all(receive_offsets)
    empty = [np.full((buffer_rows, 3), -1) for _ in range(DEVICES)]
    received = numpy_ragged_all_to_all(sorted_rows, empty, input_offsets, send_sizes, output_offsets, recv_sizes)
    for device in range(DEVICES):
        own = [(source, expert, row) for source in range(DEVICES) for expert, row in
               sorted(zip(experts[source], range(ROWS)), key=lambda pair: pair[0])
               if expert // LOCAL_EXPERTS == device]  # by source, then expert, then row
        np.testing.assert_array_equal(received[device][:len(own)], np.array(own).reshape(-1, 3))
        assert np.all(received[device][len(own):] == -1)
        local = [expert - device * LOCAL_EXPERTS for _, expert, _ in own]
        np.testing.assert_array_equal(row_experts[device], local + [LOCAL_EXPERTS] * (buffer_rows - len(own)))
    # the way back: the same call reversed puts every routed row where its source sorted it
    empty = [np.full((ROWS, 3), -1) for _ in range(DEVICES)]
    returned = numpy_ragged_all_to_all(received, empty, receive_offsets, recv_sizes, all_to_all(input_offsets),
                                       send_sizes)
    for source in range(DEVICES):
        routed = experts[source] < DEVICES * LOCAL_EXPERTS
        np.testing.assert_array_equal(returned[source][:routed.sum()], sorted_rows[source][:routed.sum()])
        assert np.all(returned[source][routed.sum():] == -1)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """jax.lax.ragged_all_to_all with one slice per device, built from all-gathers (which XLA:CPU has)."""
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [devices, rows, embed]
    starts, sizes, targets = (jax.lax.all_gather(x, axis_name)[:, me] for x in (input_offsets, send_sizes,
                                                                                 output_offsets))
    rows = jnp.arange(output.shape[0])
    for source in range(operands.shape[0]):
        inside = (rows >= targets[source]) & (rows < targets[source] + sizes[source])
        source_rows = jnp.clip(starts[source] + rows - targets[source], 0, operand.shape[0] - 1)
        output = jnp.where(inside[:, None], operands[source][source_rows], output)
    return output


DROPLESS = (*MOE, "moe.capacity_factor=0", "model.num_layers=2", "model.num_kv_heads=4")  # one MoE layer


def grad_fn_with(config, exchange: str):
    """Returns (jitted grad_fn, job) of `config` with the backend's exchange `exchange` (a moe.exchange
    choice), as if the CPU had ragged-all-to-all (the collective itself is looked up when the function is
    traced)."""
    job = build_job(config, with_data=False)
    backend = dataclasses.replace(job.backend, exchange=EXCHANGE_CHOICES[exchange])
    return jax.jit(make_grad_fn(job.config, job.layout, job.mesh, job.rules, backend)), job


@pytest.mark.slow
@pytest.mark.parametrize("mesh, overrides", [(dict(expert=4, data=2), ()),
                                             (dict(expert=2, tensor=2, data=2), ("moe.second_expert_policy=random",))],
                         ids=["expert4_data2", "expert2_tensor2_data2_random_second"])
def test_ragged_exchange_equals_all_gather_exchange(tiny_config, monkeypatch, mesh, overrides):
    config = tiny_config(*DROPLESS, *overrides).replace(**mesh_overrides(**mesh))
    tokens = jax.random.randint(jax.random.key(0), (16, 33), 0, config.model.vocab_size)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["axis_name"])
        return emulated_ragged_all_to_all(*args, **kwargs)

    results = {}
    for exchange in ("all_gather", "ragged_all_to_all"):
        with monkeypatch.context() as patch:  # traced (at the call) while the emulation is installed
            patch.setattr(jax.lax, "ragged_all_to_all", counted)
            grad_fn, job = grad_fn_with(config, exchange)
            # with random routing some second choices go to no expert: rows that are never sent
            results[exchange] = grad_fn(init_state(job.config, job.layout)["params"], {"tokens": tokens},
                                        key=jax.random.key(1))
    assert calls == [("expert",)] * 2  # one MoE layer: to the experts and back (autodiff transposes the emulation)
    (loss, _), grads = results["ragged_all_to_all"]
    (reference_loss, _), reference_grads = results["all_gather"]
    np.testing.assert_allclose(loss, reference_loss, rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(reference_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_ragged_exchange_lowers_for_gpu_with_no_all_gather(tiny_config):
    # without remat, which would run the forward exchange again in the backward pass
    config = tiny_config(*DROPLESS, "model.remat=none").replace(**mesh_overrides(expert=4, data=2))
    texts = {}
    for exchange in ("all_gather", "ragged_all_to_all"):
        grad_fn, job = grad_fn_with(config, exchange)
        params = jax.eval_shape(lambda: init_state(job.config, job.layout)["params"])
        tokens = jax.ShapeDtypeStruct((16, 33), jnp.int32)
        texts[exchange] = grad_fn.trace(params, {"tokens": tokens}).lower(lowering_platforms=("cuda",)).as_text()
    ragged = texts["ragged_all_to_all"]
    assert ragged.count("@ragged_all_to_all(") == 4  # to the experts and back, forward and backward
    assert "all_gather" not in ragged and "all_gather" in texts["all_gather"]
    # the all-to-alls carry only per-expert counts and offsets: int32 vectors, never token rows
    exchanged = [line for line in ragged.splitlines() if "stablehlo.all_to_all" in line]
    assert exchanged and all("f32" not in line for line in exchanged)


@pytest.mark.parametrize("choice, platform, kind", [("auto", "cpu", ALL_GATHER), ("auto", "cuda", RAGGED_ALL_TO_ALL),
                                                    ("auto", "tpu", RAGGED_ALL_TO_ALL),
                                                    ("all_gather", "cuda", ALL_GATHER),
                                                    ("ragged_all_to_all", "gpu", RAGGED_ALL_TO_ALL)])
def test_exchange_is_chosen_by_platform(tiny_config, choice, platform, kind):
    assert resolve_backend(backend_request(tiny_config(*MOE, f"moe.exchange={choice}")), platform).exchange == kind


def test_ragged_all_to_all_forced_on_cpu_is_a_config_error_naming_the_key(tiny_config):
    config = tiny_config(*MOE, "moe.capacity_factor=0", "moe.exchange=ragged_all_to_all")
    with pytest.raises(ConfigError) as error:
        build_job(config.replace(**mesh_overrides(expert=4, data=2)), with_data=False)
    assert error.value.problems[0][0] == "moe.exchange"
    assert build_job(tiny_config(*MOE), with_data=False).backend.exchange == ALL_GATHER
    # explain on CPU for an H100 names the H100's exchange and compiles the one XLA:CPU has
    for_h100 = build_job(tiny_config(*MOE, "cluster.device_kind=h100"), with_data=False).backend
    assert (for_h100.exchange, for_h100.compiled_here().exchange) == (RAGGED_ALL_TO_ALL, ALL_GATHER)


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["all_gather", "ragged_all_to_all"])
def test_expert_weights_are_gathered_in_bfloat16_and_their_gradients_reduce_scattered_in_float32(
        tiny_config, monkeypatch, exchange):
    # fsdp4 x expert2: each device stores an eighth of the expert weights [4 experts, 64 embed, 128 mlp]
    config = tiny_config(*DROPLESS, "model.remat=none", "model.dtype=bfloat16").replace(
        **mesh_overrides(fsdp=4, expert=2))
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    grad_fn, job = grad_fn_with(config, exchange)
    params = jax.eval_shape(lambda: init_state(job.config, job.layout)["params"])
    lowered = grad_fn.lower(params, {"tokens": jax.ShapeDtypeStruct((16, 33), jnp.int32)})
    text = lowered.compile().as_text()
    # as handed to XLA (XLA:CPU then gathers 16-bit floats as float32)
    gathered = [line for line in collective_lines(lowered.as_text(dialect="hlo"), "all-gather")
                if "bf16[2,64,128]" in line or "bf16[2,128,64]" in line]
    scattered = [line for line in collective_lines(text, "reduce-scatter") if "f32[2,16,128]" in line
                 or "f32[2,128,16]" in line]
    # gate, up and down: each device's two experts gathered along the embedding in bfloat16, and their
    # gradients summed back to the slices in float32; no all-reduce of a whole expert weight's gradient
    assert len(gathered) >= 3 and len(scattered) >= 3, (gathered, scattered)
    whole = ("[2,64,128]", "[4,64,128]", "[2,128,64]", "[4,128,64]")  # gate/up and down, local or all experts
    assert not [line for line in collective_lines(text, "all-reduce") if any(shape in line for shape in whole)]
