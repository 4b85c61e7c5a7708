"""Decoding with the KV cache: greedy tokens equal those of the full forward on the growing prefix, on tiny
dense and MoE models, on one device and on tensor2 x data2; `nestor sample` prints the prompt's continuation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nestor.models import ops
from nestor.models.axes import activation_sharding
from nestor.orchestrator.checkpoint.owner import Checkpointer
from nestor.orchestrator.commands.cli import main
from nestor.orchestrator.evaluation.commands import restore_newest, sample_checkpoint
from nestor.orchestrator.evaluation.sampling import batch_rows, make_generate, sampling_graphdef
from nestor.orchestrator.job.build import make_mesh
from nestor.orchestrator.job.state import init_state, state_layout
from nestor.parallel.rules import activation_constrainer, resolve_rules
from tests.settings import TINY
from tests.helpers import ONE_DEVICE, mesh_overrides

MODELS = {"dense": (), "moe": ("moe.num_experts=4", "moe.every=2"),
          "first_dense_biased": ("model.preset=deepseek-tiny",)}
MESHES = {"one_device": ONE_DEVICE, "tensor2_data2": {**mesh_overrides(tensor=2, data=2),
                                                      "cluster.devices_per_host": 4}}
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Returns {model: config}: each model's initial state saved once as its run.dir's checkpoint 0."""
    from nestor.orchestrator.loader.config import load

    configs = {}
    for name, overrides in MODELS.items():
        run_dir = tmp_path_factory.mktemp(name)
        config = load(None, [*TINY, f"run.dir={run_dir}", "model.init_std=0.2", *overrides]).replace(**ONE_DEVICE)
        mesh = make_mesh(config)
        layout = state_layout(config, mesh, resolve_rules(config.mesh.rules))
        checkpointer = Checkpointer(config, layout, log=lambda *_: None)
        checkpointer.save(0, init_state(config, layout), {"next_step": 0, "source": ""}, force=True)
        checkpointer.close()
        configs[name] = config
    return configs


def greedy_by_full_forward(graphdef, mesh, rules, variables: tuple, prompts: jax.Array, new_tokens: int) -> np.ndarray:
    """Returns [batch, new_tokens]: each token the argmax of the full forward's last logits on the prefix so far.

    The prefix runs in a buffer of the final length (one compile): causal attention keeps the positions
    after it out of its logits, and sampling's MoE layers drop no token, so the rest of the buffer is unseen.
    """
    constrainer = activation_constrainer(mesh, rules)

    @jax.jit
    def next_token(variables, buffer, length):
        with activation_sharding(constrainer):
            logits, _ = nnx.merge(graphdef, *variables)(buffer, train=False)
        return jnp.argmax(jax.lax.dynamic_index_in_dim(logits, length - 1, axis=1, keepdims=False), axis=-1)

    batch, prompt_len = prompts.shape
    buffer = jnp.zeros((batch, prompt_len + new_tokens), jnp.int32).at[:, :prompt_len].set(prompts)
    for length in range(prompt_len, prompt_len + new_tokens):
        buffer = buffer.at[:, length].set(next_token(variables, buffer, length))
    return np.asarray(buffer[:, prompt_len:])


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("model", MODELS)
def test_greedy_decoding_with_the_cache_equals_the_full_forward_on_the_prefix(checkpoints, model, mesh_name, capfd):
    config = checkpoints[model].replace(**MESHES[mesh_name])
    restored = restore_newest(config)
    mesh, rules, params = restored.mesh, restored.rules, restored.state["params"]
    assert batch_rows(mesh, rules) == (2 if mesh_name == "tensor2_data2" else 1)
    graphdef = sampling_graphdef(config)
    prompts = jnp.array([[0, 104, 101, 108, 108, 111], [0, 100, 101, 102, 32, 102]], jnp.int32)
    expert_bias = restored.state.get("expert_bias")  # the biased preset's balancing state
    cached = np.asarray(make_generate(graphdef, mesh, rules, ops.PLAIN, NEW_TOKENS)(params, prompts, jax.random.key(0),
                                                                         expert_bias=expert_bias))
    assert cached.shape == (2, NEW_TOKENS) and not np.array_equal(cached[0], cached[1])
    np.testing.assert_array_equal(cached, greedy_by_full_forward(graphdef, mesh, rules, (expert_bias or {}, params), prompts,
                                                                  NEW_TOKENS))
    assert "Involuntary full rematerialization" not in capfd.readouterr().err  # the cache keeps its layout


def test_nestor_sample_prints_the_prompt_and_its_greedy_continuation_on_any_mesh(checkpoints, capsys, tmp_path):
    config = checkpoints["dense"].replace(**{"data.source": "text"})  # text: the prompt opens a document
    expected = sample_checkpoint(config, "def ", 3)  # one device
    (tmp_path / "run.yaml").write_text("{}\n")
    command = ["sample", str(tmp_path / "run.yaml"), *TINY, f"run.dir={config.run.dir}", "model.init_std=0.2",
               "data.source=text", "--prompt", "def ", "--max-tokens", "3"]
    assert main(command) == 0  # this process's 8 devices: data8, 8 identical rows
    assert capsys.readouterr().out == expected + "\n" and expected.startswith("def ")
    assert main([*command, "mesh.context=2", "mesh.data=4"]) == 0  # a mesh that splits training rows
    assert capsys.readouterr().out == expected + "\n"
    assert main([*command, "--top-k", "300"]) == 2
    assert "--top-k: 300 is more than model.vocab_size=256" in capsys.readouterr().err


def test_sample_and_eval_take_a_run_directory_whose_config_names_the_data(checkpoints, capsys, tmp_path,
                                                                         monkeypatch):
    # `nestor sample CONFIG run.dir=...` asked for data.paths, which the run's config holds and sampling reads
    # only for the separator: the run's directory (its config.yaml, else its checkpoint's config) is enough.
    import shutil

    import yaml

    from nestor.orchestrator.data.prepare import Options, prepare
    from nestor.orchestrator.evaluation.commands import evaluate_checkpoint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    prepare([str(tmp_path / "text.txt")], Options(tokenizer="bytes", out=tmp_path / "shards", eval_fraction=0.0),
            log=lambda line: None)
    shutil.copytree(checkpoints["dense"].run.dir, tmp_path / "moved")  # a run directory that moved: run.dir is it
    trained = checkpoints["dense"].replace(**{"run.dir": str(tmp_path / "moved"), "data.source": "tokens",
                                              "data.paths": [str(tmp_path / "shards")], "eval.source": "synthetic"})
    expected = sample_checkpoint(trained, "def ", 3)
    here = ["cluster.devices_per_host=8", "mesh.data=-1"]  # this process's 8 devices (the run trained on one)
    sample = ["sample", "moved", "--prompt", "def ", "--max-tokens", "3", *here]

    assert main(sample) == 0  # no config.yaml: the config checkpoint 0 was written with (synthetic data)
    assert capsys.readouterr().out == sample_checkpoint(trained.replace(**{"data.source": "synthetic"}), "def ", 3) + "\n"
    (tmp_path / "moved" / "config.yaml").write_text(yaml.safe_dump(trained.to_dict(), sort_keys=False))
    assert main(sample) == 0 and capsys.readouterr().out == expected + "\n" and expected.startswith("def ")
    assert main(["eval", "moved", "eval.steps=2", *here]) == 0  # overrides still layer over the run's config
    result = evaluate_checkpoint(trained.replace(**{"eval.steps": 2, "cluster.devices_per_host": 8, "mesh.data": -1}))
    assert capsys.readouterr().out.startswith(f"step 0: eval_loss {result['eval_loss']:.4f} ")

    (tmp_path / "empty").mkdir()
    assert main(["sample", "empty", "--prompt", "def "]) == 2
    assert "RUN_DIR: empty holds no config.yaml and no checkpoint" in capsys.readouterr().err
