"""The vocabulary projection: float32 logits, and a bfloat16 backward pass whose matmuls run in bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nestor.models.ops import plain_einsum
from nestor.models.transformer import Transformer, TransformerConfig
from tests.helpers import equations, relative_error


def _inputs(dtype, tokens=8, vocab=32):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (2, tokens, 16)).astype(dtype)
    unembedding = jax.random.normal(keys[1], (16, vocab)).astype(dtype)
    labels = jax.random.randint(keys[2], (2, tokens), 0, vocab)
    return x, unembedding, labels


def project_to_vocab(x, unembedding):
    return plain_einsum("btd,dv->btv", x, unembedding, jnp.float32)


def _einsum_logits(x, unembedding):
    return jnp.einsum("btd,dv->btv", x, unembedding, preferred_element_type=jnp.float32)


def _loss(logits_fn):
    """Returns a float32 cross-entropy of `logits_fn`'s logits, as the train step takes it."""
    def loss(x, unembedding, labels):
        logits = logits_fn(x, unembedding)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1).mean()
    return loss


def _gradients(logits_fn, x, unembedding, labels):
    return jax.grad(_loss(logits_fn), (0, 1))(x, unembedding, labels)


def test_float32_gradients_equal_autodiff_of_the_plain_einsum():
    inputs = _inputs(jnp.float32)
    for got, want in zip(_gradients(project_to_vocab, *inputs), _gradients(_einsum_logits, *inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tolerance", [(jnp.bfloat16, 0.01), (jnp.float16, 1e-3)])
def test_low_precision_gradients_are_as_close_to_float32_as_autodiffs(dtype, tolerance):
    # A real batch and vocabulary give softmax terms below float16's smallest number: it keeps float32 matmuls.
    x, unembedding, labels = _inputs(dtype, tokens=8192, vocab=4096)  # terms of 1/(4096 x 16384) ~ 1.5e-8
    exact = _gradients(_einsum_logits, x.astype(jnp.float32), unembedding.astype(jnp.float32), labels)
    ours, autodiff = _gradients(project_to_vocab, x, unembedding, labels), _gradients(_einsum_logits, x, unembedding,
                                                                                      labels)
    for got, theirs, want in zip(ours, autodiff, exact):
        assert got.dtype == dtype
        assert relative_error(got, want) <= max(tolerance, 1.1 * relative_error(theirs, want))


def _matmuls(fn, *args) -> list:
    """Returns the dot_general equations of `fn`'s jaxpr, those of nested jaxprs included."""
    return equations(jax.make_jaxpr(fn)(*args).jaxpr, "dot_general")


def _float32_vocab_matmuls(matmuls, vocab: int) -> int:
    """Returns how many of `matmuls` take a float32 operand with a vocabulary-sized dimension."""
    return sum(any(v.aval.dtype == jnp.float32 and vocab in v.aval.shape for v in eqn.invars) for eqn in matmuls)


def test_bfloat16_logits_are_float32_and_their_backward_matmuls_are_bfloat16():
    x, unembedding, labels = _inputs(jnp.bfloat16)
    assert project_to_vocab(x, unembedding).dtype == jnp.float32
    grad = lambda fn: jax.grad(_loss(fn), (0, 1))  # noqa: E731
    assert _float32_vocab_matmuls(_matmuls(grad(project_to_vocab), x, unembedding, labels), 32) == 0
    assert _float32_vocab_matmuls(_matmuls(grad(_einsum_logits), x, unembedding, labels), 32) == 2  # tf32 GEMMs


def test_the_model_projects_to_the_vocabulary_through_it_in_bfloat16():
    vocab = 96  # no other dimension of the model has this size
    config = TransformerConfig(vocab_size=vocab, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                               head_dim=8, mlp_dim=64, dtype="bfloat16")
    model = Transformer(config, nnx.Rngs(params=0))
    graph, params = nnx.split(model)
    tokens = jnp.ones((2, 8), jnp.int32)

    def loss(params):
        return nnx.merge(graph, params)(tokens)[0].mean()

    matmuls = _matmuls(jax.grad(loss), params)
    assert sum(any(vocab in v.aval.shape for v in eqn.invars) for eqn in matmuls) == 3  # forward, two backward
    assert _float32_vocab_matmuls(matmuls, vocab) == 0
