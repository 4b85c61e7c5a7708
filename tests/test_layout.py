"""Where bytes live and what moves: read from XLA's memory analysis and the compiled HLO."""

import pytest

from nestor.models import axes
from nestor.orchestrator.commands.explain import compile_step, explain, param_table
from nestor.orchestrator.job.build import build_job
from nestor.parallel.hlo import collective_lines, collectives
from nestor.parallel.rules import DEFAULT_RULES
from tests.helpers import TESTED_MESHES, mesh_overrides



def test_every_logical_axis_the_model_uses_has_a_rule(tiny_config):
    job = build_job(tiny_config())
    used = {name for row in param_table(job.layout) for name in row["logical_axes"]}
    # the module's axis names: its upper-case constants that are identifiers (LAYOUT_READ marks a read, not an axis)
    declared = {value for name, value in vars(axes).items()
                if name.isupper() and isinstance(value, str) and value.isidentifier()}
    assert used <= set(DEFAULT_RULES)
    assert declared <= set(DEFAULT_RULES)


@pytest.mark.parametrize("mesh", TESTED_MESHES, ids=list(TESTED_MESHES))
def test_no_involuntary_rematerialization(tiny_config, mesh, capfd):
    config = tiny_config("model.num_kv_heads=4").replace(**mesh_overrides(**TESTED_MESHES[mesh]))
    compile_step(build_job(config))
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.parametrize("mesh", [dict(fsdp=8), dict(fsdp=4, tensor=2), dict(fsdp=2, tensor=4)],
                         ids=["fsdp8", "fsdp4_tensor2", "fsdp2_tensor4"])
def test_fsdp_times_tensor_8_keeps_an_eighth_of_params_and_optimizer_per_device(tiny_config, mesh):
    config = tiny_config("model.num_kv_heads=4").replace(**mesh_overrides(**mesh))
    report = explain(config)
    total = sum(row["bytes_total"] for row in report["params"])
    # Norm scales are deliberately replicated; Adam keeps two moments per parameter.
    replicated = sum(row["bytes_total"] for row in report["params"] if axes.NORM in row["logical_axes"])
    memory = report["memory_per_device_bytes"]
    per_device = memory["params"] + memory["optimizer"]
    bound = 1.10 * 3 * total / 8 + 3 * replicated + 64  # + Adam's step counters
    assert per_device <= bound, (per_device, bound)
    assert memory["params"] <= 1.10 * total / 8 + replicated


def test_pure_tensor_parallelism_moves_activations_not_weights(tiny_config):
    config = tiny_config("model.num_kv_heads=4", "cluster.devices_per_host=4").replace(**mesh_overrides(tensor=4))
    job = build_job(config)
    hlo = compile_step(job).as_text()
    layer_shapes = set()
    for row in param_table(job.layout):
        if row["name"].startswith("blocks/"):
            layer_shapes.add(tuple(row["shape"]))
            layer_shapes.add(tuple(row["shape"][1:]))
    gathered = [line.split("=", 1)[1].split("{")[0].split("[")[1].rstrip("]") for line in collective_lines(hlo, "all-gather")]
    gathered_shapes = {tuple(int(d) for d in dims.split(",") if d) for dims in gathered}
    assert not gathered_shapes & layer_shapes, gathered_shapes
    # Activations move: the attention and MLP outputs are summed over the tensor axis in every layer.
    assert collectives(hlo)["all-reduce"]["count"] >= 2 * config.model.num_layers


def test_explain_json_reports_the_contract_keys(tiny_config):
    # without remat: the executed count has no recomputation in it
    report = explain(tiny_config("model.remat=none").replace(**mesh_overrides(data=2, fsdp=2, tensor=2)))
    for key in ("mesh", "params", "memory_per_device_bytes", "collectives", "flops_per_step"):
        assert key in report
    assert report["mesh"]["shape"] == {"pipeline": 1, "data": 2, "fsdp": 2, "context": 1, "expert": 1, "tensor": 2}
    assert report["collectives"]["all-gather"]["count"] > 0  # fsdp gathers weights
    # XLA counts the masked half of causal attention: the executed count has it, the model count not.
    assert report["flops_per_step"] / report["executed_flops_per_step"] == pytest.approx(1.0, abs=0.10)
    assert report["model_flops_per_step"] < report["executed_flops_per_step"]
