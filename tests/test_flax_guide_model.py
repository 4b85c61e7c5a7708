"""A model written as Flax's sharding guide writes one trains as written: nnx.Linear kernels named by
`nnx.with_partitioning` with names of its own (mapped by mesh.rules), blocks stacked by `nnx.vmap` and run by
`nnx.scan`, biases and LayerNorm parameters left unnamed. GSPMD and Flax's get_partition_spec replicate an
unannotated tensor; nestor does too, and says so in one warning line."""

import re
import sys
import textwrap

import numpy as np
import pytest

from nestor.cluster.connect import USER_CODE_ENV
from nestor.orchestrator.commands.explain import explain
from nestor.orchestrator.loader import config as config_lib
from nestor.orchestrator.loop.console import Console
from nestor.orchestrator.loop.train import train
from tests.settings import COMPARABLE_ADAM
from tests.helpers import ONE_DEVICE, assert_same_training, mesh_overrides

# An MLP-Mixer (Tolstikhin et al. 2021, arXiv 2105.01601) in the guide's style: nestor appears nowhere in it.
MIXER = '''
import jax.numpy as jnp
import optax
from flax import nnx

INIT = nnx.initializers.lecun_normal()


def linear(features_in, features_out, names, rngs):
    return nnx.Linear(features_in, features_out, kernel_init=nnx.with_partitioning(INIT, names), rngs=rngs)


class MixerBlock(nnx.Module):
    def __init__(self, patches, channels, hidden, rngs):
        self.token_norm = nnx.LayerNorm(channels, rngs=rngs)
        self.token_in = linear(patches, hidden, ("patch", "hidden"), rngs)
        self.token_out = linear(hidden, patches, ("hidden", "patch"), rngs)
        self.channel_norm = nnx.LayerNorm(channels, rngs=rngs)
        self.channel_in = linear(channels, hidden, ("channel", "hidden"), rngs)
        self.channel_out = linear(hidden, channels, ("hidden", "channel"), rngs)

    def __call__(self, x):  # [batch, patches, channels]
        y = self.token_norm(x).swapaxes(1, 2)  # [batch, channels, patches]: mix across patches
        x = x + self.token_out(nnx.gelu(self.token_in(y))).swapaxes(1, 2)
        return x + self.channel_out(nnx.gelu(self.channel_in(self.channel_norm(x))))


class Mixer(nnx.Module):
    def __init__(self, patches=4, patch_features=8, channels=16, hidden=32, depth=2, classes=4, *, rngs):
        self.stem = linear(patch_features, channels, (None, "channel"), rngs)

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "depth"})
        def blocks(rngs):
            return MixerBlock(patches, channels, hidden, rngs)

        self.blocks = blocks(rngs)
        self.norm = nnx.LayerNorm(channels, rngs=rngs)
        self.head = linear(channels, classes, ("channel", "class"), rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "depth"})
        def through(x, block):
            return block(x)

        return self.head(self.norm(through(self.stem(x), self.blocks)).mean(axis=1))

    def loss(self, batch):
        logits = self(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}
'''
YAML = '''
model:
  class: mixer:Mixer
data:
  source: arrays
  paths: [train.npz]
train:
  steps: 4
  global_batch: 16
mesh:
  rules: {channel: fsdp, hidden: tensor}
run:
  dir: runs/mixer
  compile_cache: null
'''
# the Mixer's unnamed parameters: nnx.Linear's biases, nnx.LayerNorm's scales and biases
UNNAMED = [*(f"blocks/{layer}/bias" for layer in ("channel_in", "channel_out", "token_in", "token_out")),
           *(f"blocks/{norm}/{part}" for norm in ("channel_norm", "token_norm") for part in ("bias", "scale")),
           "head/bias", "norm/bias", "norm/scale", "stem/bias"]


@pytest.fixture
def mixer_dir(tmp_path, monkeypatch):
    """The Mixer, random patches with labels of a linear rule, and its YAML, in a fresh directory."""
    (tmp_path / "mixer.py").write_text(textwrap.dedent(MIXER))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4, 8)).astype(np.float32)
    np.savez(tmp_path / "train.npz", x=x, y=np.argmax(x.mean(1) @ rng.normal(size=(8, 4)), -1).astype(np.int32))
    (tmp_path / "my.yaml").write_text(YAML)
    monkeypatch.delitem(sys.modules, "mixer", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(USER_CODE_ENV, str(tmp_path))
    return tmp_path


def mixer_config(tmp_path, *overrides, **dotted):
    config = config_lib.load("my.yaml", ["cluster.launcher=inprocess", "cluster.devices_per_host=8", COMPARABLE_ADAM,
                                         *overrides])
    return config.replace(**{"run.dir": str(tmp_path / "runs" / "_".join(map(str, dotted.values()))), **dotted})


def trained(config):
    lines: list[str] = []
    return train(config, console=Console(log=lines.append)), [line for line in lines if line.startswith("warning")]


def test_flax_guides_mixer_trains_on_data2_fsdp2_tensor2_as_on_one_device_its_unnamed_params_replicated(mixer_dir):
    reference, quiet = trained(mixer_config(mixer_dir, **ONE_DEVICE))
    result, warnings = trained(mixer_config(mixer_dir, **mesh_overrides(data=2, fsdp=2, tensor=2)))
    assert_same_training(result, reference)
    assert quiet == [] and len(warnings) == 1, warnings  # one device: nothing is split, nothing to say
    named = re.findall(r"([\w/]+) \[[\d, ]+\] \d+ B", warnings[0])
    assert sorted(named) == sorted(UNNAMED), warnings[0]
    # a stacked vector [depth, channels] of float32 is 2 x 16 x 4 bytes on every device
    assert "blocks/token_norm/scale [2, 16] 128 B" in warnings[0] and "mesh.fsdp=2, mesh.tensor=2" in warnings[0]


def test_explain_lists_the_replicated_params_and_an_fsdp_that_splits_no_parameter(mixer_dir):
    report = explain(mixer_config(mixer_dir, **mesh_overrides(data=2, fsdp=2, tensor=2)))
    specs = {row["name"]: row["spec"] for row in report["params"]}
    assert specs["blocks/channel_in/kernel"] == [None, "fsdp", "tensor"] and specs["blocks/channel_in/bias"] == [None, None]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert report["warnings"][0].startswith(f"warning: {len(UNNAMED)} parameter(s) have no logical name the rules map")
    unsplit = explain(mixer_config(mixer_dir, "mesh.rules={hidden: tensor}", **mesh_overrides(data=2, fsdp=2, tensor=2)))
    assert unsplit["warnings"][1:] == ["warning: mesh.fsdp=2 splits no parameter, only the batch: no logical name of "
                                       "the parameters maps to fsdp; map one with mesh.rules (mesh.rules={NAME: fsdp}) "
                                       "or give its devices to another mesh axis"], unsplit["warnings"]
    assert "stem/kernel [8, 16]" in unsplit["warnings"][0]  # named ('channel') with no rule now: replicated
