"""Bring your own model (docs/models.md): a Flax NNX module in the user's own directory, named by
`model.class`, trained with nestor's meshes, checkpoints and launchers."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nestor.cluster.connect import USER_CODE_ENV
from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.commands.explain import backend_lines, explain
from tests.settings import COMPARABLE_ADAM
from tests.helpers import ONE_DEVICE, assert_same_training, child_env, mesh_overrides, run, run_fresh

# A classifier written the way Flax's guides write models: parameters named with nnx.with_partitioning,
# its repeated blocks one nestor Stack, activations pinned by logical name.
MODEL = '''
import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nestor.models.axes import constrain
from nestor.models.stack import Stack


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    features: int = 16
    width: int = 32
    hidden: int = 64
    depth: int = 2
    classes: int = 4


def dense(rngs, shape, names):
    return nnx.Param(nnx.with_partitioning(nnx.initializers.lecun_normal(), names)(rngs.params(), shape))


class Block(nnx.Module):
    def __init__(self, cfg: MLPConfig, rngs: nnx.Rngs):
        self.up = dense(rngs, (cfg.width, cfg.hidden), ("embed", "mlp"))
        self.down = dense(rngs, (cfg.hidden, cfg.width), ("mlp", "embed"))
        self.scale = nnx.Param(jnp.ones((cfg.width,)))

    def __call__(self, x):
        h = jax.nn.gelu(constrain(x * self.scale[...] @ self.up[...], ("batch", "act_mlp")))
        return x + constrain(h @ self.down[...], ("batch", "act_embed"))


class MLP(nnx.Module):
    def __init__(self, cfg: MLPConfig, rngs: nnx.Rngs):
        self.embed = dense(rngs, (cfg.features, cfg.width), (None, "embed"))
        self.blocks = Stack(lambda r: Block(cfg, r), cfg.depth, rngs=rngs, name="blocks")
        self.head = dense(rngs, (cfg.width, cfg.classes), ("embed", "classes"))

    def loss(self, batch):
        x, _ = self.blocks(self.pipeline_input(batch))
        return self.pipeline_output(x, batch)

    def pipeline_input(self, batch):  # before the stack: what a 1F1B pipeline's first stage runs
        return constrain(batch["x"] @ self.embed[...], ("batch", "act_embed"))

    def pipeline_output(self, x, batch):  # after it: the last stage
        logits = x @ self.head[...]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}
'''
YAML = '''
model:
  class: mlp:MLP
  args: {width: 32, hidden: 64, depth: 2}
data:
  source: arrays
  paths: [train.npz]
train:
  steps: 6
  global_batch: 16
optimizer:
  warmup_steps: 2
  decay_steps: 6               # the schedule of 6 steps, however many a run trains: a resume continues it
run:
  dir: runs/mlp
  compile_cache: null
'''


def write_user_directory(directory: Path, module: str = "mlp", source: str = MODEL) -> Path:
    """Writes the model, its data (a linearly separable 4-class problem) and my.yaml into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{module}.py").write_text(textwrap.dedent(source))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(16, 4)), axis=-1).astype(np.int32)
    np.savez(directory / "train.npz", x=x, y=y)
    (directory / "my.yaml").write_text(YAML)
    return directory


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A fresh directory outside the repository holding the user's model and config, nestor pointed at it."""
    directory = write_user_directory(tmp_path / "project")
    monkeypatch.chdir(directory)
    monkeypatch.setenv(USER_CODE_ENV, str(directory))
    return directory


EVAL = ("eval.every=3", "eval.steps=2", "eval.source=arrays", "eval.paths=[train.npz]")


def user_config(*overrides: str, **dotted):
    config = config_lib.load("my.yaml", ["cluster.devices_per_host=8", COMPARABLE_ADAM, *overrides])
    return config.replace(**dotted) if dotted else config


@pytest.fixture
def one_device(user_dir):
    return run_fresh(user_config(*EVAL, **ONE_DEVICE))


PIPELINED = ("pipeline.microbatches=4",)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,overrides", [
    (dict(data=2, fsdp=2, tensor=2), ()), (dict(fsdp=4, tensor=2), ()), (dict(data=8), ()),
    (dict(pipeline=2, data=2, tensor=2), PIPELINED),
    (dict(pipeline=2, fsdp=4), (*PIPELINED, "pipeline.schedule=circular", "pipeline.repeats=2", "model.args.depth=4")),
    (dict(pipeline=2, data=4), (*PIPELINED, "pipeline.schedule=1f1b")),
    (dict(pipeline=2, data=2, tensor=2), (*PIPELINED, "pipeline.schedule=zero_bubble")),
])
def test_a_users_model_trains_on_any_mesh_as_on_one_device(one_device, user_dir, mesh, overrides):
    if "model.args.depth=4" in overrides:  # circular: 2 stages x 2 repeats of the 4 blocks
        one_device = run_fresh(user_config(*EVAL, "model.args.depth=4", **ONE_DEVICE))
    result = run_fresh(user_config(*EVAL, *overrides, **mesh_overrides(**mesh)))
    assert_same_training(result, one_device)
    evaluated = [[record["eval_loss"] for record in run.history if "eval_loss" in record] for run in (result, one_device)]
    assert len(evaluated[0]) == 2  # after steps 3 and 6, on the eval arrays
    np.testing.assert_allclose(*evaluated, rtol=1e-5)
    assert {"loss", "accuracy", "grad_norm", "rows_per_s"} <= set(result.history[-1])


def test_a_users_model_resumes_exactly_and_restores_onto_another_mesh(one_device):
    first = run(user_config(*EVAL, "train.steps=3", **mesh_overrides(data=2, fsdp=2, tensor=2)))
    resumed = run(user_config(*EVAL, **mesh_overrides(fsdp=4, tensor=2)))  # the same run.dir: steps 4..6
    assert resumed.first_step == 3
    np.testing.assert_allclose(first.losses + resumed.losses, one_device.losses, rtol=1e-5)


def test_explain_prints_the_layout_of_the_users_parameters(user_dir):
    report = explain(user_config(**mesh_overrides(data=2, fsdp=2, tensor=2)))
    specs = {row["name"]: (row["logical_axes"], row["spec"]) for row in report["params"]}
    assert specs["blocks/blocks/up"] == (["layers", "embed", "mlp"], ["pipeline", "fsdp", "tensor"])
    assert specs["embed"] == ([None, "embed"], [None, "fsdp"])
    assert specs["head"] == (["embed", "classes"], ["fsdp", None])  # a name without a rule is replicated
    assert specs["blocks/blocks/scale"][1] == ["pipeline", None]  # a vector without names is replicated
    assert report["warnings"] == ["warning: 1 parameter(s) have no logical name the rules map, so every device holds "
                                  "them whole (256 B per device, their optimizer state aside) while mesh.fsdp=2, "
                                  "mesh.tensor=2 split the others: blocks/blocks/scale [2, 32] 256 B; name their "
                                  "dimensions (nnx.with_partitioning) or map their names with mesh.rules to split "
                                  "them (docs/models.md)"]
    assert report["model_flops_per_step"] is None and report["flops_per_step"] > 0
    # a model that calls none of models.ops and runs no pipeline gets none of those choices reported
    backend = report["backend"]
    assert [backend[key] for key in ("attention", "matmuls", "swiglu", "grouped_matmul", "exchange",
                                     "pipeline_loop")] == [None] * 6, backend
    assert backend_lines(backend)[0] == f"backend for cpu: remat {backend['remat']}"


def test_mesh_rules_map_a_users_own_logical_name(user_dir):
    report = explain(user_config("mesh.rules={classes: tensor}", **mesh_overrides(data=4, tensor=2)))
    assert {row["name"]: row["spec"] for row in report["params"]}["head"] == ["fsdp", "tensor"]


# A sequence classifier whose every block is nestor's MoE feed-forward (models.moe), its routing, capacity and
# balancing set from model.args.
MOE_MODEL = '''
import jax.numpy as jnp
import optax
from flax import nnx

from nestor.models.axes import constrain
from nestor.models.moe import MoEFeedForward, MoELayerConfig, moe_losses
from nestor.models.stack import Stack


class Block(nnx.Module):
    def __init__(self, width, hidden, moe, rngs):
        self.experts = MoEFeedForward(width, hidden, moe, rngs, init_std=0.1)

    def __call__(self, x):
        y, stats = self.experts(x)
        return constrain(x + y, ("batch", "length", "act_embed")), stats


class MoEClassifier(nnx.Module):
    def __init__(self, *, width=16, hidden=32, depth=2, classes=4, routing, rngs):
        self.moe = MoELayerConfig(**routing)
        init = nnx.initializers.normal(0.1)
        self.embed = nnx.Param(nnx.with_partitioning(init, (None, "embed"))(rngs.params(), (16, width)))
        self.blocks = Stack(lambda r: Block(width, hidden, self.moe, r), depth, rngs=rngs, name="blocks")
        self.head = nnx.Param(nnx.with_partitioning(init, ("embed", None))(rngs.params(), (width, classes)))

    def loss(self, batch):
        x = constrain(batch["x"] @ self.embed[...], ("batch", "length", "act_embed"))
        x, stats = self.blocks(x)
        logits = x.mean(axis=1) @ self.head[...]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        aux, metrics = moe_losses(stats, self.moe)
        return loss + aux, {"class_loss": loss, **metrics}
'''


def write_sequences(directory: Path) -> None:
    """Writes train.npz of sequences [rows, 8, 16] whose class is the argmax of a projection of their mean."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 8, 16)).astype(np.float32)
    np.savez(directory / "train.npz", x=x, y=np.argmax(x.mean(axis=1) @ rng.normal(size=(16, 4)), -1).astype(np.int32))


@pytest.mark.slow
@pytest.mark.parametrize("routing,mesh", [
    ("{num_experts: 4, top_k: 2, capacity_factor: 1.25, second_expert_policy: random, group_size: 4}",
     dict(expert=2, data=2, tensor=2)),
    ("{num_experts: 4, top_k: 2, capacity_factor: 0, bias_update_rate: 0.01}", dict(expert=4, data=2)),
])
def test_a_users_model_with_nestors_moe_layers_trains_on_an_expert_mesh_as_on_one_device(user_dir, routing, mesh):
    write_user_directory(user_dir, "moe_classifier", MOE_MODEL)
    write_sequences(user_dir)
    overrides = ("model.class=moe_classifier:MoEClassifier", f"model.args.routing={routing}")
    reference = run_fresh(user_config(*overrides, **ONE_DEVICE))
    result = run_fresh(user_config(*overrides, **mesh_overrides(**mesh)))
    assert_same_training(result, reference)
    last = result.history[-1]
    assert last["moe_aux_loss"] > 0 and np.sum(last["moe_expert_load"], axis=1) == pytest.approx([1.0, 1.0])
    if "bias_update_rate" in routing:  # auxiliary-loss-free balancing moved the biases, the same on both meshes
        np.testing.assert_allclose(last["moe_expert_bias"], reference.history[-1]["moe_expert_bias"], atol=1e-6)
        assert np.abs(last["moe_expert_bias"]).max() > 0


UNNAMED = MODEL.replace('dense(rngs, (cfg.width, cfg.classes), ("embed", "classes"))',
                        'nnx.Param(jnp.zeros((cfg.width, cfg.classes)))')
NO_LOSS = MODEL.replace("def loss(self, batch):", "def forward(self, batch):")
TWO_STACKS = MODEL.replace(
    '        self.head = dense(rngs, (cfg.width, cfg.classes), ("embed", "classes"))',
    '        self.head = dense(rngs, (cfg.width, cfg.classes), ("embed", "classes"))\n'
    '        self.more = Stack(lambda r: Block(cfg, r), cfg.depth, rngs=rngs, name="blocks")')
DROPOUT = MODEL.replace(
    "        self.scale = nnx.Param(jnp.ones((cfg.width,)))",
    "        self.scale = nnx.Param(jnp.ones((cfg.width,)))\n        self.dropout = nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=0))")
GUIDE_NAMES = MODEL.replace('("embed", "classes"))', '("model", "classes"))')  # mesh axis names as Flax's guide
UNSPLIT = MODEL.replace("def pipeline_input(self, batch):", "def embed_batch(self, batch):").replace(
    "self.pipeline_input(batch)", "self.embed_batch(batch)")
LOGITS = MODEL.replace("        return loss, {", "        return logits\n        return loss, {")
PER_ROW = MODEL.replace('batch["y"]).mean()', 'batch["y"])')  # a loss per row, not their mean
SWAPPED = MODEL.replace("        return loss, {", "        return {'loss': loss}, loss\n        return loss, {")


@pytest.mark.parametrize("overrides,module,source,key,says", [
    (("model.class=nowhere.mlp:MLP",), "mlp", MODEL, "model.class", "cannot import 'nowhere.mlp'"),
    (("model.class=mlp:Missing",), "mlp", MODEL, "model.class", "has no 'Missing'; it defines"),
    (("model.args={depth: 2, colour: red}",), "mlp", MODEL, "model.args", "colour"),
    (("mesh.rules={heads: tensor, cls: tensor}",), "mlp", MODEL, "mesh.rules.cls",
     "the model never names 'cls'; its parameters' logical axes are classes, embed, layers, mlp"),
    (("model.class=noloss:MLP",), "noloss", NO_LOSS, "model.class", "has no method loss(batch)"),
    (("model.class=logits:MLP",), "logits", LOGITS, "model.class",
     "returned an array float32 (16, 4); it must return"),
    (("model.class=perrow:MLP",), "perrow", PER_ROW, "model.class",
     "returned a tuple of 2 (an array float32 (16,), a dict); it must return (a float scalar loss, a dict"),
    (("model.class=swapped:MLP",), "swapped", SWAPPED, "model.class",
     "returned a tuple of 2 (a dict, an array float32 ()); it must return"),
    (("model.class=mlp:MPL",), "mlp", MODEL, "model.class",
     "has no 'MPL'; it defines MLP, Block, MLPConfig, dense"),  # its imports (Stack, constrain, ...) left out
    (("model.args={hidden: 63}",), "mlp", MODEL, "model.class", "'mlp' dimension of 63 does not split over"),
    (("mesh.pipeline=2", "pipeline.schedule=1f1b", "model.class=unsplit:MLP"), "unsplit", UNSPLIT, "pipeline.schedule",
     "1f1b runs the backward pass inside its loop, which needs the model split around its stack: MLP has no "
     "pipeline_input"),
    (("mesh.pipeline=2", "pipeline.stack=encoder"), "mlp", MODEL, "pipeline.stack",
     "the model has no stack named 'encoder' to pipeline; its stacks (models.stack.Stack) are blocks"),
    (("mesh.pipeline=2", "model.args.depth=3"), "mlp", MODEL, "pipeline.stack",
     "stack 'blocks': 3 layers do not split into 2 stages"),
    (("data.source=synthetic",), "mlp", MODEL, "data.source", "reads named arrays"),
    (("mesh.pipeline=2", "model.class=twostacks:MLP"), "twostacks", TWO_STACKS, "model.class",
     "two stacks are named 'blocks'"),
    (("model.class=dropout:MLP",), "dropout", DROPOUT, "model.class", "the step trains nnx.Param"),
    (("data.source=python",), "mlp", MODEL, "data.factory", "data.source=python needs module:function"),
    (("data.source=python", "data.factory=mlp:MLPConfig"), "mlp", MODEL, "data.args", "cannot be called"),
    (("eval.every=2", "eval.source=text", "eval.paths=[my.yaml]"), "mlp", MODEL, "eval.source",
     "named arrays evaluate a model of your own"),
])
def test_each_mistake_in_a_users_model_is_one_config_error(user_dir, overrides, module, source, key, says):
    write_user_directory(user_dir, module, source)
    mesh = mesh_overrides(pipeline=2, data=4) if "mesh.pipeline=2" in overrides else mesh_overrides(data=2, fsdp=2,
                                                                                                   tensor=2)
    with pytest.raises(ConfigError) as error:
        explain(user_config(*(o for o in overrides if o != "mesh.pipeline=2"), **mesh))
    assert error.value.problems[0][0] == key and says in error.value.problems[0][1], error.value.problems


@pytest.mark.parametrize("module,source,head,entry", [("unnamed", UNNAMED, [None, None], ""),
                                                       ("guide", GUIDE_NAMES, ["model", "classes"], "{classes: tensor}")])
def test_a_matrix_without_names_the_rules_map_is_replicated_and_named_in_one_warning(user_dir, module, source, head,
                                                                                    entry):
    write_user_directory(user_dir, module, source)
    report = explain(user_config(f"model.class={module}:MLP", **mesh_overrides(data=2, fsdp=2, tensor=2)))
    row = {row["name"]: row for row in report["params"]}["head"]
    assert row["logical_axes"] == head and row["spec"] == [None, None] and row["bytes_per_device"] == 32 * 4 * 4
    assert len(report["warnings"]) == 1 and "2 parameter(s) have no logical name the rules map" in report["warnings"][0]
    assert "blocks/blocks/scale [2, 32] 256 B, head [32, 4] 512 B;" in report["warnings"][0], report["warnings"]
    # a name of the largest parameter's own, where it has one
    assert f"mesh.rules{f' (e.g. mesh.rules={entry})' if entry else ''} to split" in report["warnings"][0]


@pytest.mark.timeout(300)
def test_the_console_script_reports_a_users_mistake_in_one_line_with_exit_2(user_dir):
    result = subprocess.run([sys.executable, "-m", "nestor.orchestrator.commands.cli", "train", "my.yaml",
                             "model.class=mlp:Nope"], cwd=user_dir, env=child_env(), capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 2 and "model.class" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_the_users_code_a_remote_cluster_receives_is_what_the_run_imports_from_its_directory(user_dir):
    from nestor.orchestrator.specs.registry import user_code_paths

    write_user_directory(user_dir, "shipped", MODEL)  # a module no other test imported from elsewhere
    assert user_code_paths(user_config("model.class=shipped:MLP")) == (str(user_dir / "shipped.py"),)
    vit = user_config("model.class=nestor.models.vit:ViT", "data.source=python",
                      "data.factory=nestor.orchestrator.data.examples:digits")
    assert user_code_paths(vit) == ()  # nestor's own models travel with nestor


REGRESSION = MODEL.replace(  # a mean squared error: its exponential is no perplexity
    'loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()',
    'loss = jnp.mean((logits[:, 0] - batch["y"]) ** 2)')
TOKEN_LOSS = MODEL.replace("class MLP(nnx.Module):\n", "class MLP(nnx.Module):\n    token_cross_entropy = True\n")


@pytest.mark.parametrize("module,source,perplexity", [("regression", REGRESSION, False), ("tokens", TOKEN_LOSS, True)])
def test_eval_reports_a_perplexity_only_for_a_model_that_declares_a_token_cross_entropy(user_dir, module, source,
                                                                                        perplexity):
    from nestor.orchestrator.job.eval_loss import Evaluator
    from nestor.orchestrator.job.state import state_layout
    from nestor.orchestrator.job.build import make_mesh
    from nestor.parallel.rules import resolve_rules

    write_user_directory(user_dir, module, source)
    config = user_config(f"model.class={module}:MLP", *EVAL, **ONE_DEVICE)
    mesh, rules = make_mesh(config), resolve_rules(config.mesh.rules)
    layout = state_layout(config, mesh, rules)
    assert layout.perplexity is perplexity
    state = {"params": jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), layout.abstract["params"])}
    evaluated = Evaluator(config, layout, mesh, rules)(state)
    assert ("eval_perplexity" in evaluated) is perplexity and "eval_accuracy" in evaluated
    if perplexity:
        assert float(evaluated["eval_perplexity"]) == pytest.approx(np.exp(float(evaluated["eval_loss"])), rel=1e-6)
