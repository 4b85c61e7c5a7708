"""Attention through jax.nn.dot_product_attention: the numbers of the einsum it replaced, grouped-query
heads as they are, and a document mask that keeps packed documents apart (also where a bfloat16 model on CPU
computes attention from float32 sums, nestor.backend.xla_cpu)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nestor.backend import resolve_backend, xla_cpu
from nestor.models import ops
from nestor.models.transformer import Attention, Transformer, TransformerConfig, rotary
from nestor.orchestrator.data.batches import document_ids
from nestor.orchestrator.data.separator import BYTES_SEPARATOR as DOCUMENT_SEPARATOR
from nestor.orchestrator.specs.registry import build_model
from nestor.orchestrator.job.step import backend_request
from tests.helpers import ONE_DEVICE, assert_same_training, mesh_overrides, run_fresh

CONFIG = TransformerConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                           mlp_dim=64, init_std=0.2)
# (model config, ops installed): jax.nn.dot_product_attention, and xla_cpu.attention (what the model runs
# in bfloat16 on CPU)
CONFIGS = {"jax": (CONFIG, ops.PLAIN),
           "float32 sums": (dataclasses.replace(CONFIG, dtype="bfloat16"), xla_cpu.ops_from_float32_sums())}


def einsum_attention(self: Attention, x: jax.Array, segment_ids=None) -> jax.Array:
    """The model's attention before jax.nn.dot_product_attention: grouped heads by hand, causal mask by hand."""
    assert segment_ids is None
    cfg = self.cfg
    q = rotary(jnp.einsum("btd,dhk->bthk", x, self.query[...]), cfg.rope_theta)
    k = rotary(jnp.einsum("btd,dgk->btgk", x, self.key[...]), cfg.rope_theta)
    v = jnp.einsum("btd,dgk->btgk", x, self.value[...])
    batch, length = x.shape[:2]
    q = q.reshape(batch, length, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
    scores = jnp.einsum("btgrk,bsgk->bgrts", q, k) / math.sqrt(cfg.head_dim)
    scores = jnp.where(jnp.tril(jnp.ones((length, length), bool)), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    context = jnp.einsum("bgrts,bsgk->btgrk", probs, v).reshape(batch, length, cfg.num_heads, cfg.head_dim)
    return jnp.einsum("bthk,hkd->btd", context, self.out[...])


def tokens_without_separator(shape=(3, 24), seed=0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 1, CONFIG.vocab_size)


def test_dot_product_attention_equals_the_einsum_it_replaced(monkeypatch):
    model = Transformer(CONFIG, nnx.Rngs(params=0))
    tokens = tokens_without_separator()
    logits, _ = model(tokens)
    monkeypatch.setattr(Attention, "__call__", einsum_attention)
    reference, _ = model(tokens)
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
def test_a_mask_of_one_document_changes_nothing(config):
    config, model_ops = config
    model = Transformer(config, nnx.Rngs(params=0))
    tokens = tokens_without_separator()
    with ops.installed(model_ops):
        unmasked, _ = model(tokens)
        masked, _ = model(tokens, segment_ids=document_ids(tokens, DOCUMENT_SEPARATOR))
    np.testing.assert_array_equal(masked, unmasked)


def test_document_ids_open_a_segment_at_each_separator():
    tokens = jnp.array([[5, 6, DOCUMENT_SEPARATOR, 7, DOCUMENT_SEPARATOR, DOCUMENT_SEPARATOR, 8]])
    np.testing.assert_array_equal(document_ids(tokens, DOCUMENT_SEPARATOR), [[0, 0, 1, 1, 2, 3, 3]])


def two_documents(first_seed: int) -> jax.Array:
    """Returns rows [first document (10 tokens), separator, second document (13 tokens)]: the first varies."""
    first = tokens_without_separator((2, 10), seed=first_seed)
    second = tokens_without_separator((2, 13), seed=100)
    return jnp.concatenate([first, jnp.full((2, 1), DOCUMENT_SEPARATOR), second], axis=1)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS)
@pytest.mark.parametrize("masked", [True, False], ids=["masked", "unmasked"])
def test_document_mask_keeps_one_documents_tokens_out_of_the_next_ones_logits(masked, config):
    config, model_ops = config
    model = Transformer(config, nnx.Rngs(params=0))
    logits = []
    for seed in (1, 2):
        tokens = two_documents(seed)
        with ops.installed(model_ops):
            logits.append(model(tokens, segment_ids=document_ids(tokens, DOCUMENT_SEPARATOR) if masked else None)[0])
    second = slice(10, None)  # the separator and the second document
    assert not np.array_equal(logits[0][:, :10], logits[1][:, :10])
    if masked:
        np.testing.assert_array_equal(logits[0][:, second], logits[1][:, second])
    else:
        assert np.abs(logits[0][:, second] - logits[1][:, second]).max() > 1e-3


def test_auto_attention_is_cudnn_only_on_gpus_in_half_precision(tiny_config):
    attention = lambda dtype, platform, *more: resolve_backend(  # noqa: E731
        backend_request(tiny_config(f"model.dtype={dtype}", *more)), platform).attention
    assert attention("bfloat16", "cpu") == "float32 sums"  # XLA:CPU's bfloat16 ops
    assert attention("float32", "cpu") == "xla"
    assert attention("float32", "gpu") == "xla"
    assert attention("bfloat16", "tpu") == "xla"
    assert attention("bfloat16", "gpu") == "cudnn"
    assert attention("float16", "gpu", "cluster.accelerator=gpu") == "cudnn"
    assert attention("bfloat16", "gpu", "model.attention=xla") == "xla"
    assert attention("bfloat16", "cpu", "cluster.device_kind=h100") == "cudnn"  # explain for an H100


@pytest.mark.slow
def test_the_reported_attention_is_the_function_the_model_calls(tiny_config, monkeypatch):
    calls = []

    def counted(name, function):
        return lambda *args, **kwargs: calls.append(name) or function(*args, **kwargs)

    monkeypatch.setattr(xla_cpu, "_attention", counted("attention", xla_cpu._attention))
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        counted("jax.nn.dot_product_attention", jax.nn.dot_product_attention))
    for overrides in ((), ("model.dtype=bfloat16",)):  # float32: jax's; bfloat16 on CPU: float32 sums
        config = tiny_config(*overrides)
        backend = resolve_backend(backend_request(config), "cpu")
        calls.clear()
        with ops.installed(backend.ops()):
            build_model(config, seed=0)(jnp.zeros((1, 8), jnp.int32))
        assert calls and set(calls) == {backend.report()["attention"].split(" (")[0]}
    gpu = resolve_backend(backend_request(tiny_config("model.dtype=bfloat16")), "gpu")
    assert gpu.report()["attention"] == "jax.nn.dot_product_attention (cudnn)"


def test_mfu_rows_add_what_runs_where_it_is_not_the_implementation_asked_for(tiny_config):
    from bench.mfu import row_line

    row = {"model": "tiny", "remat": "dots", "error": "-"}
    for asked, config, platform, cell in (
            ("xla", tiny_config("model.dtype=bfloat16"), "cpu", "xla: attention (float32 sums)"),
            ("auto", tiny_config("model.dtype=bfloat16", "model.attention=auto"), "gpu",
             "auto: jax.nn.dot_product_attention (cudnn)"),
            ("xla", tiny_config(), "cpu", "xla")):
        runs = resolve_backend(backend_request(config), platform).report()["attention"]
        line = row_line(row | {"attention": asked, "attention_run": runs})
        assert line.startswith(f"| tiny | dots | {cell} |")


def test_cudnn_in_float32_names_model_attention(tiny_config):
    from nestor.orchestrator.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        tiny_config("model.attention=cudnn")
    assert [key for key, _ in error.value.problems] == ["model.attention"]


@pytest.fixture
def short_documents(tmp_path):
    """Returns a glob of 40 text files of 3 to 40 bytes: every 33-token row holds several documents."""
    rng = np.random.default_rng(0)
    for index in range(40):
        text = "".join(rng.choice(list("abcdefghij =()\n"), size=int(rng.integers(3, 41))))
        (tmp_path / f"doc{index:02d}.txt").write_text(text)
    return str(tmp_path / "*.txt")


@pytest.mark.slow
def test_pipelined_stages_mask_the_documents_of_their_own_micro_batch(tiny_config, short_documents):
    config = tiny_config("data.source=text", f"data.paths=[{short_documents}]", "pipeline.microbatches=4")
    reference = run_fresh(config.replace(**ONE_DEVICE))
    unmasked = run_fresh(config.replace(**ONE_DEVICE, **{"data.document_mask": False}))
    assert abs(reference.losses[-1] - unmasked.losses[-1]) > 1e-4  # the mask is on and matters
    assert_same_training(run_fresh(config.replace(**mesh_overrides(pipeline=2, data=2, tensor=2))), reference)
