"""Matmuls from float32 sums (models.ops.einsum_from_float32_sums) and the XLA:CPU backend's bfloat16 ops
(nestor.backend.xla_cpu): autodiff's numbers (float32) and precision (bfloat16), bfloat16 backward matmuls,
kept by `dots`, and on XLA:CPU dots whose operands stay bfloat16."""

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from nestor.backend import resolve_backend, xla_cpu
from nestor.backend.remat import policy as remat_policy
from nestor.models import ops
from nestor.models.moe import MoELayerConfig
from nestor.models.transformer import Transformer, TransformerConfig
from nestor.orchestrator.loader.config import load
from nestor.orchestrator.job.step import backend_request
from nestor.parallel.hlo import dot_operand_dtypes
from tests.helpers import equations, relative_error

# (equation, x shape, weight shape): the model's projections, its MLP's, an expert's
EQUATIONS = [("btd,dhk->bthk", (2, 8, 16), (16, 4, 8)), ("bthk,hkd->btd", (2, 8, 4, 8), (4, 8, 16)),
             ("...d,dm->...m", (2, 8, 16), (16, 32)), ("egcm,emh->egch", (4, 2, 8, 16), (4, 16, 32))]


def _operands(x_shape, weight_shape, dtype):
    x_key, weight_key = jax.random.split(jax.random.key(0))
    return jax.random.normal(x_key, x_shape).astype(dtype), jax.random.normal(weight_key, weight_shape).astype(dtype)


def _mlp(project):
    """Returns loss(x, up, down) of a two-matmul MLP on x [batch, length, embed] whose matmuls are
    `project(equation, x, weight)`."""
    def loss(x, up, down):
        hidden = jax.nn.silu(project("btd,dm->btm", x, up))
        return jnp.square(project("btm,md->btd", hidden, down).astype(jnp.float32)).sum()
    return loss


@pytest.mark.parametrize("equation, x_shape, weight_shape", EQUATIONS)
def test_float32_values_and_gradients_equal_the_plain_einsums(equation, x_shape, weight_shape):
    x, weight = _operands(x_shape, weight_shape, jnp.float32)
    ours = lambda x, w: (ops.einsum_from_float32_sums(equation, x, w) ** 2).sum()  # noqa: E731
    plain = lambda x, w: (jnp.einsum(equation, x, w) ** 2).sum()  # noqa: E731
    np.testing.assert_allclose(ours(x, weight), plain(x, weight), rtol=1e-6)
    for got, want in zip(jax.grad(ours, (0, 1))(x, weight), jax.grad(plain, (0, 1))(x, weight)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation, x_shape, weight_shape", EQUATIONS)
def test_bfloat16_matmuls_sum_in_float32_both_ways_on_bfloat16_operands(equation, x_shape, weight_shape):
    x, weight = _operands(x_shape, weight_shape, jnp.bfloat16)
    loss = lambda x, w: ops.einsum_from_float32_sums(equation, x, w).astype(jnp.float32).sum()  # noqa: E731
    assert ops.einsum_from_float32_sums(equation, x, weight).dtype == jnp.bfloat16
    dots = equations(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, weight).jaxpr, "dot_general")
    assert len(dots) == 3  # forward, and the gradients of x and of the weight
    assert all(v.aval.dtype == jnp.bfloat16 for eqn in dots for v in eqn.invars)
    assert all(eqn.params["preferred_element_type"] == jnp.float32 for eqn in dots)
    # Autodiff of the same float32-output einsum would feed its float32 cotangent to the backward matmuls.
    autodiff = lambda x, w: jnp.einsum(equation, x, w, preferred_element_type=jnp.float32).sum()  # noqa: E731
    autodiff_dots = equations(jax.make_jaxpr(jax.grad(autodiff, (0, 1)))(x, weight).jaxpr, "dot_general")
    assert sum(any(v.aval.dtype == jnp.float32 for v in eqn.invars) for eqn in autodiff_dots) == 2


@pytest.mark.parametrize("dtype, out_dtype, gradient_dtype", [
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32, jnp.bfloat16),  # logits too
    (jnp.float16, jnp.float16, jnp.float16), (jnp.float16, jnp.float32, jnp.float32),  # float16 would underflow
    (jnp.float32, jnp.float32, jnp.float32)])
def test_backward_matmuls_take_the_gradient_in_a_dtype_with_the_outputs_range(dtype, out_dtype, gradient_dtype):
    x, weight = _operands((2, 8, 16), (16, 32), dtype)
    loss = lambda x, w: ops.einsum_from_float32_sums("btd,dm->btm", x, w, out_dtype).sum()  # noqa: E731
    dots = equations(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, weight).jaxpr, "dot_general")
    assert [v.aval.dtype for eqn in dots[1:] for v in eqn.invars] == [gradient_dtype] * 4


@pytest.mark.parametrize("equation", ["btd,dm", "btd->btm", "btd,dm->bt", "btdq,dm->btm"])
def test_an_equation_without_a_backward_pass_of_the_same_kind_is_refused(equation):
    x, weight = _operands((2, 8, 16), (16, 32), jnp.float32)
    with pytest.raises(ValueError, match="every index of an operand"):
        ops.einsum_from_float32_sums(equation, x, weight)


def test_the_plain_einsum_returns_another_dtype_from_float32_sums_with_a_bfloat16_backward_pass():
    x, weight = _operands((2, 8, 16), (16, 32), jnp.bfloat16)
    assert ops.plain_einsum("btd,dm->btm", x, weight, jnp.float32).dtype == jnp.float32  # the logits
    loss = lambda x, w: ops.plain_einsum("btd,dm->btm", x, w, jnp.float32).sum()  # noqa: E731
    dots = equations(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, weight).jaxpr, "dot_general")
    assert [v.aval.dtype for eqn in dots for v in eqn.invars] == [jnp.bfloat16] * 6


def _saved_residuals(function, *args) -> list[str]:
    """Returns the types ("bf16[8,32]") of the residuals the backward pass of `function` reads, sorted (jax
    only prints them)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(function, *args)
    return sorted(line.split()[0] for line in printed.getvalue().splitlines())


def test_dots_keeps_what_it_keeps_of_plain_einsums():
    x, up = _operands((2, 8, 16), (16, 32), jnp.bfloat16)
    down = up.T
    policy = remat_policy("dots")

    def kept(project) -> list[str]:
        return _saved_residuals(jax.checkpoint(_mlp(project), policy=policy), x, up, down)

    ours = kept(lambda equation, x, w: ops.einsum_from_float32_sums(equation, x, w))
    plain = kept(lambda equation, x, w: jnp.einsum(equation, x, w))
    assert ours == plain
    assert "bf16[2,8,32]" in ours  # the first matmul's output, in the compute dtype


def test_the_backend_installs_float32_sums_in_bfloat16_for_cpus_only():
    bfloat16 = load(None, ["model.dtype=bfloat16"])
    assert resolve_backend(backend_request(bfloat16), "cpu").float32_sums
    assert resolve_backend(backend_request(bfloat16), "cpu").ops().einsum is ops.einsum_from_float32_sums
    assert not resolve_backend(backend_request(bfloat16), "gpu").float32_sums
    assert not resolve_backend(backend_request(bfloat16), "tpu").float32_sums
    assert resolve_backend(backend_request(bfloat16), "gpu").ops().einsum is ops.plain_einsum
    assert not resolve_backend(backend_request(load(None, ["model.dtype=float32"])), "cpu").float32_sums
    # `nestor explain` on CPU for an H100 or a TPU compiles the program those would run
    for target in ("cluster.device_kind=h100", "cluster.device_kind=tpu-v5e", "cluster.accelerator=gpu"):
        request = backend_request(load(None, ["model.dtype=bfloat16", target]))
        assert not resolve_backend(request, "cpu").compiled_here().float32_sums


def test_every_weight_matmul_and_attention_product_of_the_model_sums_bfloat16_operands_in_float32_both_ways():
    """A bfloat16 model with a dense and an MoE layer, its shapes chosen so that only the weight matmuls (the
    attention's, the SwiGLU's, the experts', the vocabulary projection) have a parameter-shaped operand or
    output, and only attention's products a five-dimensional operand (heads grouped): each of them, forward
    and backward, takes bfloat16 operands and sums in float32."""
    config = TransformerConfig(vocab_size=56, embed_dim=24, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=6,
                               mlp_dim=40, dtype="bfloat16",
                               moe=MoELayerConfig(num_experts=3, every=2, top_k=2, capacity_factor=2.0))
    graph, params = nnx.split(Transformer(config, nnx.Rngs(params=0)))
    router = (24, 3)  # routes in float32 by design
    shapes = {leaf.shape[1:] for leaf in jax.tree.leaves(params) if leaf.ndim > 1} - {router} | {(24, 56)}

    def loss(params):
        return nnx.merge(graph, params)(jnp.ones((2, 10), jnp.int32))[0].astype(jnp.float32).mean()

    with ops.installed(xla_cpu.ops_from_float32_sums()):
        dots = equations(jax.make_jaxpr(jax.grad(loss))(params).jaxpr, "dot_general")
    weight_dots = [eqn for eqn in dots if {tuple(v.aval.shape) for v in (*eqn.invars, *eqn.outvars)} & shapes]
    assert len(weight_dots) == 3 * (2 * 4 + 3 + 3 + 1)  # attention in 2 layers, SwiGLU, experts, logits
    attention_dots = [eqn for eqn in dots if any(v.aval.ndim == 5 for v in eqn.invars)]
    assert len(attention_dots) == 2 * (2 + 5)  # 2 layers: scores, context; the backward's scores again, 4 products
    for eqn in weight_dots + attention_dots:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16] * 2, eqn
        assert eqn.params["preferred_element_type"] == jnp.float32, eqn


def test_swiglu_from_float32_rounds_once_and_is_closer_to_float32():
    gate, up = _operands((4, 16, 32), (4, 16, 32), jnp.float32)
    want = jax.nn.silu(gate) * up
    np.testing.assert_array_equal(xla_cpu.swiglu(gate, up), want)
    np.testing.assert_array_equal(ops.plain_swiglu(gate, up), want)
    gate16, up16 = gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)
    ours = xla_cpu.swiglu(gate16, up16)
    exact = jax.nn.silu(gate16.astype(jnp.float32)) * up16.astype(jnp.float32)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(ours, exact.astype(jnp.bfloat16))
    assert relative_error(ours, exact) < relative_error(ops.plain_swiglu(gate16, up16), exact)


@pytest.mark.parametrize("capacity_factor", [2.0, 0.0])  # capacity dispatch, dropless (grouped matmuls)
@pytest.mark.parametrize("float32_outputs", [True, False])
def test_the_models_swiglus_run_in_float32_where_the_matmuls_return_float32_sums(float32_outputs, capacity_factor):
    """The dense layer's and the experts' silu, forward and backward: float32 with the CPU's float32 sums (where
    XLA:CPU would round between every bfloat16 operation), the compute dtype elsewhere (GPUs, TPUs)."""
    config = TransformerConfig(vocab_size=56, embed_dim=24, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=6,
                               mlp_dim=40, dtype="bfloat16",
                               moe=MoELayerConfig(num_experts=3, every=2, top_k=2, capacity_factor=capacity_factor))
    graph, params = nnx.split(Transformer(config, nnx.Rngs(params=0)))

    def loss(params):
        return nnx.merge(graph, params)(jnp.ones((2, 10), jnp.int32))[0].astype(jnp.float32).mean()

    with ops.installed(xla_cpu.ops_from_float32_sums() if float32_outputs else ops.PLAIN):
        silus = equations(jax.make_jaxpr(jax.grad(loss))(params).jaxpr, "logistic")
    assert len(silus) == 2  # the dense layer's and the experts'
    assert {eqn.invars[0].aval.dtype for eqn in silus} == {jnp.dtype(jnp.float32 if float32_outputs else jnp.bfloat16)}


def _upcast_dots(float32_outputs: bool) -> tuple[int, int]:
    """Returns (dots, dots of float32 operands) XLA:CPU compiles for the bfloat16 MLP's gradient."""
    x, up = _operands((4, 16, 128), (128, 256), jnp.bfloat16)
    project = ops.einsum_from_float32_sums if float32_outputs else jnp.einsum
    dots = dot_operand_dtypes(jax.jit(jax.grad(_mlp(project), (0, 1, 2))).lower(x, up, up.T).compile().as_text())
    return len(dots), sum("f32" in operands for operands in dots)


def test_xla_cpu_runs_the_matmuls_on_bfloat16_operands():
    """jax 0.10's XLA:CPU upcasts bfloat16 -> bfloat16 dots to float32 ones (half the rate); float32 sums it
    runs on bfloat16 operands. jax 0.11 keeps both in bfloat16, so only ours is asserted on every version."""
    dots, upcast = _upcast_dots(float32_outputs=True)
    assert dots == 6 and upcast == 0
    if jax.__version_info__ < (0, 11):
        assert _upcast_dots(float32_outputs=False)[1] > 0



def _model_gradients(dtype: str, float32_matmul_outputs: bool) -> list:
    """Returns the parameter gradients of a small model's mean cross-entropy, the same parameters each time."""
    config = TransformerConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                               mlp_dim=64, dtype=dtype)
    graph, params = nnx.split(Transformer(config, nnx.Rngs(params=0)))
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 64)

    def loss(params):
        logits = nnx.merge(graph, params)(tokens[:, :-1])[0]
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1).mean()

    with ops.installed(xla_cpu.ops_from_float32_sums() if float32_matmul_outputs else ops.PLAIN):
        return jax.tree.leaves(jax.jit(jax.grad(loss))(params))


@pytest.mark.slow
def test_bfloat16_gradients_are_as_close_to_float32_as_the_plain_einsums():
    """Measured on jax 0.10.2: relative errors 0.4-0.8% for both, equal to 3 digits (XLA:CPU computes a plain
    bfloat16 dot from float32 sums too)."""
    exact = _model_gradients("float32", False)
    ours, plain = _model_gradients("bfloat16", True), _model_gradients("bfloat16", False)
    errors = [(relative_error(got, want), relative_error(theirs, want)) for got, theirs, want in zip(ours, plain, exact)]
    assert len(errors) == 12  # embedding, unembedding, final norm, 9 stacked layer tensors
    assert all(error <= max(0.01, 1.1 * theirs) for error, theirs in errors), errors


MASKS = ("causal", "documents", "blind rows")


def _attention_inputs(dtype, masks: str):
    """Returns (query [2, 24, 4, 8], key and value [2, 24, 2, 8], mask or None): grouped-query heads, and
    besides the causal mask none ("causal"), two documents per row (positions 0-9 and 10-23), or those
    documents with queries 3-5 of the first row seeing no key at all ("blind rows")."""
    query_key, key_key, value_key = jax.random.split(jax.random.key(3), 3)
    query = jax.random.normal(query_key, (2, 24, 4, 8)).astype(dtype)
    key, value = (jax.random.normal(k, (2, 24, 2, 8)).astype(dtype) for k in (key_key, value_key))
    if masks == "causal":
        return query, key, value, None
    segments = (jnp.arange(24) >= 10).astype(jnp.int32)[None].repeat(2, axis=0)
    mask = (segments[:, :, None] == segments[:, None, :])[:, None]
    if masks == "blind rows":
        mask = mask.at[0, 0, 3:6].set(False)
    return query, key, value, mask


def _attention_loss(attend, mask):
    """Returns loss(query, key, value): a weighted sum of `attend`'s context (weights fixed, not uniform)."""
    weights = jax.random.normal(jax.random.key(4), (2, 24, 4, 8))
    return lambda q, k, v: (attend(q, k, v, mask).astype(jnp.float32) * weights).sum()


_jax_attention = functools.partial(ops.dot_product_attention, implementation="xla")


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("masks", MASKS)
def test_attention_from_float32_sums_equals_jax_dot_product_attention_in_float32(masks, causal):
    q, k, v, mask = _attention_inputs(jnp.float32, masks)
    ours_fn, jax_fn = (functools.partial(attend, causal=causal) for attend in (xla_cpu.attention, _jax_attention))
    np.testing.assert_allclose(ours_fn(q, k, v, mask), jax_fn(q, k, v, mask), rtol=1e-6, atol=1e-6)
    ours, theirs = (jax.grad(_attention_loss(attend, mask), (0, 1, 2))(q, k, v) for attend in (ours_fn, jax_fn))
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masks", MASKS)
def test_bfloat16_attention_is_as_close_to_float32_as_jax_and_sums_bfloat16_operands_both_ways(masks):
    exact = _attention_inputs(jnp.float32, masks)
    inputs = _attention_inputs(jnp.bfloat16, masks)
    want = jax.grad(_attention_loss(_jax_attention, exact[3]), (0, 1, 2))(*exact[:3])
    ours, theirs = (jax.grad(_attention_loss(attend, inputs[3]), (0, 1, 2))(*inputs[:3])
                    for attend in (xla_cpu.attention, _jax_attention))
    errors = [(relative_error(got, exact), relative_error(their, exact)) for got, their, exact in zip(ours, theirs, want)]
    # measured: 0.3-0.47%, at most 1.15x (the keys': flash attention's D reads the context rounded to bfloat16)
    assert all(error <= 1.2 * their for error, their in errors), errors
    assert relative_error(xla_cpu.attention(*inputs), _jax_attention(*exact)) < 0.01
    loss = _attention_loss(xla_cpu.attention, inputs[3])
    dots = equations(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(*inputs[:3]).jaxpr, "dot_general")
    assert len(dots) == 2 + 5  # scores and context; the backward's scores again and its four products
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16] * 2, eqn
        assert eqn.params["preferred_element_type"] == jnp.float32, eqn


def test_xla_cpu_runs_the_attention_products_on_bfloat16_operands():
    """jax 0.10's XLA:CPU upcasts 5 of the 6 dots of jax.nn.dot_product_attention's forward and backward pass
    in bfloat16 (jax 0.11's keeps them bfloat16); ours keep bfloat16 operands on every version."""
    q, k, v, mask = _attention_inputs(jnp.bfloat16, "documents")

    def upcast(attend) -> tuple[int, int]:
        text = jax.jit(jax.grad(_attention_loss(attend, mask), (0, 1, 2))).lower(q, k, v).compile().as_text()
        dots = dot_operand_dtypes(text)
        return len(dots), sum("f32" in operands for operands in dots)

    dots, upcast_dots = upcast(xla_cpu.attention)
    assert dots >= 5 and upcast_dots == 0  # 5 compiled here: without remat XLA shares the scores between passes
    if jax.__version_info__ < (0, 11):
        assert upcast(_jax_attention)[1] > 0


def test_a_mask_of_another_rank_or_per_head_is_refused():
    q, k, v, mask = _attention_inputs(jnp.bfloat16, "documents")
    for wrong in (mask[0, 0], mask[:, 0], jnp.repeat(mask, 4, axis=1)):
        with pytest.raises(ValueError, match=r"batch or 1, 1, length, length"):
            xla_cpu.attention(q, k, v, wrong)


def test_dots_keeps_the_attention_context_not_its_scores():
    """The output projection's backward pass reads the context: `dots` keeps it (jax's dots_saveable does not
    see it through the custom rule), not the [batch, heads, length, length] scores jax's own path keeps."""
    q, k, v, _ = _attention_inputs(jnp.bfloat16, "causal")
    out = jax.random.normal(jax.random.key(5), (4, 8, 16)).astype(jnp.bfloat16)

    def layer(attend):
        def loss(q, k, v, out):
            context = attend(q, k, v, None)
            return jnp.square(ops.einsum_from_float32_sums("bthk,hkd->btd", context, out)).sum()
        return loss

    def kept(attend) -> list[str]:
        policy = remat_policy("dots")
        return _saved_residuals(jax.checkpoint(layer(attend), policy=policy), q, k, v, out)

    inputs = ["bf16[2,24,2,8]"] * 2 + ["bf16[2,24,4,8]", "bf16[4,8,16]"]
    assert kept(xla_cpu.attention) == sorted([*inputs, "bf16[2,24,4,8]", "bf16[2,24,16]"])  # context, output
    assert any(residual.startswith("f32[") and residual.count(",") == 4 for residual in kept(_jax_attention))  # scores


def test_a_policy_keeping_the_attention_context_keeps_it_once_for_both_backward_passes():
    """The output projection's backward pass and the attention's (flash attention's D reads the context) share one
    kept array: `minimal` keeping only `attention_context` recomputes no attention product, as `dots` does not."""
    q, k, v, _ = _attention_inputs(jnp.bfloat16, "causal")
    out = jax.random.normal(jax.random.key(5), (4, 8, 16)).astype(jnp.bfloat16)

    def loss(q, k, v, out):  # linear in the projection: its own backward pass reads the context only
        context = xla_cpu.attention(q, k, v)
        return ops.einsum_from_float32_sums("bthk,hkd->btd", context, out).astype(jnp.float32).sum()

    def checkpointed(policy: str, names: tuple[str, ...] = ()):
        return jax.checkpoint(loss, policy=remat_policy(policy, names))

    def products(function) -> int:
        return len(equations(jax.make_jaxpr(jax.grad(function, (0, 1, 2, 3)))(q, k, v, out).jaxpr, "dot_general"))

    minimal = checkpointed("minimal", ("attention_context",))
    assert _saved_residuals(minimal, q, k, v, out).count("bf16[2,24,4,8]") == 2  # the queries and the context
    # forward: scores, context, projection; backward: the scores again and four products, the projection's two
    assert products(minimal) == products(checkpointed("dots")) == 2 + 1 + 5 + 2
