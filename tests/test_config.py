"""Config errors a user can make are caught before any device is touched, each naming its key."""

import pytest

from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.errors import ConfigError
from tests.settings import ROOT


def error_keys(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        config_lib.load(None, ["model.preset=tiny", *overrides])
    return [key for key, _ in caught.value.problems]


def test_wrong_device_product_names_the_mesh_axes_and_devices_per_host():
    with pytest.raises(ConfigError) as caught:
        config_lib.load(None, ["model.preset=tiny", "mesh.data=2", "mesh.tensor=2"])
    [(key, message)] = caught.value.problems
    assert key == "mesh.data, mesh.tensor" and "cluster.devices_per_host=8" in message


def test_two_fill_axes_name_the_second():
    assert error_keys("mesh.fsdp=-1") == ["mesh.fsdp"]


def test_heads_not_divisible_by_tensor_names_heads():
    keys = error_keys("mesh.data=1", "mesh.tensor=8", "model.num_heads=12", "model.num_kv_heads=4")
    assert "model.num_heads" in keys and "model.num_kv_heads" in keys


def test_batch_not_divisible_by_batch_axes_names_global_batch():
    assert error_keys("train.global_batch=12", "mesh.data=8") == ["train.global_batch"]


def test_unknown_key_is_named_with_its_path():
    assert error_keys("model.num_experts=4") == ["model.num_experts"]
    assert error_keys("nonsense.key=1") == ["nonsense"]


def test_wrong_type_is_named():
    assert error_keys("train.steps=ten") == ["train.steps"]
    assert error_keys("optimizer.lr=fast") == ["optimizer.lr"]


def test_exponent_without_a_dot_is_a_number():
    # YAML 1.1 reads 1e-3 as a string; a float key takes it as the number it spells.
    assert config_lib.load(None, ["optimizer.lr=1e-3"]).optimizer.lr == 1e-3


def test_every_problem_is_listed_at_once():
    keys = error_keys("pipeline.schedule=zigzag", "model.dtype=int8", "train.seq_len=0")
    assert sorted(keys) == ["model.dtype", "pipeline.schedule", "train.seq_len"]


def test_unknown_mesh_axis_in_rules_is_named():
    assert error_keys("mesh.rules={embed: fdsp}") == ["mesh.rules.embed"]


def test_overrides_parse_as_yaml_and_layer_over_the_preset():
    config = config_lib.load(None, ["model.preset=125m", "model.num_layers=3", "mesh.rules={mlp: [tensor, fsdp]}",
                                    "train.global_batch=64"])
    assert config.model.embed_dim == 768 and config.model.num_layers == 3
    assert config.mesh.rules == {"mlp": ["tensor", "fsdp"]}


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = config_lib.load(None, ["model.preset=tiny", "checkpoint.async=false", "mesh.fsdp=2"])
    path = tmp_path / "config.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config.to_dict()))
    assert config_lib.load(path) == config


def test_mesh_files_layer_over_the_run_config():
    from tests.settings import ROOT

    config = config_lib.load(ROOT / "configs/quickstart.yaml", [str(ROOT / "configs/meshes/fsdp8.yaml"), "train.steps=3"])
    assert config.mesh.fsdp == 8 and config.mesh.data == 1 and config.train.steps == 3


def test_every_shipped_config_loads():
    from tests.settings import ROOT

    for path in sorted((ROOT / "configs/models").glob("*.yaml")):
        config_lib.load(None, [f"model.preset={path.stem}", "train.global_batch=64"])
    for path in sorted((ROOT / "configs/meshes").glob("*.yaml")):
        config_lib.load(ROOT / "configs/quickstart.yaml", [str(path)])


def test_decay_steps_is_positive_and_not_shorter_than_warmup():
    assert error_keys("optimizer.decay_steps=0") == ["optimizer.decay_steps"]
    assert error_keys("optimizer.decay_steps=5", "optimizer.warmup_steps=10") == ["optimizer.warmup_steps"]
    assert error_keys("optimizer.decay_steps=0", "optimizer.warmup_steps=-1") == ["optimizer.warmup_steps",
                                                                                   "optimizer.decay_steps"]


def test_profiled_steps_lie_within_the_run():
    assert error_keys("train.steps=10", "profile.start_step=11") == ["profile.start_step"]
    assert error_keys("train.steps=10", "profile.start_step=9", "profile.steps=3") == ["profile.steps"]
    assert error_keys("profile.start_step=-1", "profile.steps=0") == ["profile.start_step", "profile.steps"]
    assert config_lib.load(None, ["train.steps=10", "profile.start_step=8", "profile.steps=3"]).profile.steps == 3


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError) as caught:
        config_lib.load(None, ["model.preset=7b"])
    assert [key for key, _ in caught.value.problems] == ["model.preset"]
    assert {"tiny", "125m", "1b"} <= set(config_lib.presets())
    assert ", ".join(config_lib.presets()) in str(caught.value) and "not found" not in str(caught.value)


def test_preset_is_a_name_never_a_path():
    for path in ("../base", "models/tiny", "/etc/passwd"):
        with pytest.raises(ConfigError, match="is not a preset; the presets") as caught:
            config_lib.load(None, [f"model.preset={path}"])
        assert [key for key, _ in caught.value.problems] == ["model.preset"]


@pytest.mark.parametrize("overrides, key", [
    (["data.source=tokens", "data.paths=5"], "data.paths"),
    (["data.source=tokens", "data.mixture=5"], "data.mixture"),
    (["data.source=tokens", "data.mixture=[5]"], "data.mixture"),
    (["data=5"], "data"),
    (["model.init_from=[1]"], "model.init_from"),
])
def test_keys_the_load_derives_others_from_are_config_errors_when_malformed(overrides, key):
    """Prepared shards' tokenizer and a checkpoint's config.json are read while loading: a malformed
    section or path is still a config error naming its key, no traceback."""
    with pytest.raises(ConfigError) as raised:
        config_lib.load(ROOT / "configs" / "quickstart.yaml", overrides)
    assert any(problem_key == key for problem_key, _ in raised.value.problems), raised.value.problems


def test_the_schemas_choices_are_those_the_rooms_that_act_on_them_take():
    """The schema names its choices itself (it imports neither jax nor the backend); each list is the one
    the room that acts on the key declares."""
    from nestor import backend
    from nestor.backend import remat
    from nestor.orchestrator.config import schema as config_schema
    from nestor.parallel import context, rules

    assert config_schema.ATTENTION_CHOICES == backend.ATTENTION_CHOICES
    assert config_schema.GROUPED_MATMUL_CHOICES == backend.GROUPED_MATMUL_CHOICES
    assert config_schema.EXCHANGE_CHOICES == tuple(backend.EXCHANGE_CHOICES)
    assert config_schema.REMAT_CHOICES == remat.CHOICES
    assert config_schema.CONTEXT_STRATEGIES == context.STRATEGIES
    assert config_schema.MESH_AXES == rules.MESH_AXES


def test_the_schema_loads_without_jax_or_the_backend():
    """Reading a config's type costs no jax import: a fresh interpreter imports the schema alone."""
    import subprocess
    import sys

    script = ("import sys; import nestor.orchestrator.config.schema; "
              "print(sorted(m for m in ('jax', 'nestor.backend', 'flax') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[]"


def test_pipeline_repeats_without_a_repeating_schedule_is_named_before_the_device_count_is_known():
    # cluster.devices_per_host=-1 (every local device) leaves mesh.data=-1 unresolved until the run starts
    assert error_keys("mesh.pipeline=2", "mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1",
                      "cluster.devices_per_host=-1", "pipeline.repeats=2", "pipeline.schedule=gpipe") == \
        ["pipeline.repeats"]
