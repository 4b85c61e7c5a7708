"""The vocabulary projection: float32 logits, and a backward pass whose matmuls run in the compute dtype."""

import jax
import jax.numpy as jnp
import numpy as np

from models.transformer import project_to_vocab


def _inputs(dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (2, 8, 16)).astype(dtype)
    unembedding = jax.random.normal(keys[1], (16, 32)).astype(dtype)
    weights = jax.random.normal(keys[2], (2, 8, 32))  # a float32 loss of the logits
    return x, unembedding, weights


def _einsum_logits(x, unembedding):
    return jnp.einsum("btd,dv->btv", x, unembedding, preferred_element_type=jnp.float32)


def test_float32_gradients_equal_autodiff_of_the_plain_einsum():
    x, unembedding, weights = _inputs(jnp.float32)
    ours = jax.grad(lambda *a: (project_to_vocab(*a) * weights).sum(), (0, 1))(x, unembedding)
    plain = jax.grad(lambda *a: (_einsum_logits(*a) * weights).sum(), (0, 1))(x, unembedding)
    for got, want in zip(ours, plain):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _backward_matmuls(logits_fn) -> tuple[int, int]:
    """Returns (dot_generals with a float32 operand, all dot_generals) in the bfloat16 gradient of a
    loss of `logits_fn`."""
    x, unembedding, weights = _inputs(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: (logits_fn(*a) * weights).sum(), (0, 1)))(x, unembedding).jaxpr
    matmuls = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"]
    return sum(any(v.aval.dtype == jnp.float32 for v in eqn.invars) for eqn in matmuls), len(matmuls)


def test_bfloat16_logits_are_float32_and_their_backward_matmuls_are_bfloat16():
    x, unembedding, _ = _inputs(jnp.bfloat16)
    assert project_to_vocab(x, unembedding).dtype == jnp.float32
    assert _backward_matmuls(project_to_vocab) == (0, 2)
    assert _backward_matmuls(_einsum_logits)[0] == 2  # autodiff promotes the other operand: float32 (tf32) matmuls
