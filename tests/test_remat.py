"""Remat (`model.remat`) changes memory, never results, whether the stack is scanned or pipelined."""

import time

import numpy as np
import pytest

from nestor.backend import resolve_backend
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.commands.explain import compile_step
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.job.step import backend_request
from tests.settings import TINY
from tests.helpers import assert_same_training, equations, mesh_overrides, run_fresh

STACKS = {
    "scanned_fsdp4_tensor2": (dict(fsdp=4, tensor=2), ()),
    "pipeline2_data2_tensor2": (dict(pipeline=2, data=2, tensor=2), ("pipeline.microbatches=4",)),
    "moe_expert2_data4": (dict(expert=2, data=4), ("moe.num_experts=4", "moe.every=2")),
    # a dense first layer (its own stack, run before the units) and random routing keys stacked with the units
    "moe_first_dense_random": (dict(expert=2, data=4), ("moe.num_experts=4", "moe.every=1", "moe.first_dense_layers=2",
                                                        "moe.second_expert_policy=random")),
    # bfloat16 on CPU: the matmuls and attention from float32 sums (nestor.backend.xla_cpu), their custom backward passes
    "bfloat16_scanned_fsdp4_tensor2": (dict(fsdp=4, tensor=2), ("model.dtype=bfloat16",)),
    "bfloat16_pipeline2_data2_tensor2": (dict(pipeline=2, data=2, tensor=2),
                                         ("pipeline.microbatches=4", "model.dtype=bfloat16")),
}
# Every stack with full (it changes the most); the named-tensor policies where they differ: the scan
# (per unit) and the pipeline (per layer inside a stage). offload is minimal on CPU (tested below).
# The unrolled stack (model.scan_layers=false) against the scanned one without remat: same training.
CASES = [("scanned_fsdp4_tensor2", "full"), ("scanned_fsdp4_tensor2", "dots"), ("scanned_fsdp4_tensor2", "minimal"),
         ("pipeline2_data2_tensor2", "full"), ("pipeline2_data2_tensor2", "minimal"), ("moe_expert2_data4", "full"),
         ("scanned_fsdp4_tensor2", "dots unrolled"), ("scanned_fsdp4_tensor2", "none unrolled"),
         ("moe_expert2_data4", "dots unrolled"), ("moe_first_dense_random", "dots unrolled"),
         ("bfloat16_scanned_fsdp4_tensor2", "dots"), ("bfloat16_scanned_fsdp4_tensor2", "full"),
         ("bfloat16_pipeline2_data2_tensor2", "dots")]


@pytest.fixture(scope="module")
def without_remat(tmp_path_factory):
    """Returns runs(stack) -> (make, the run of that stack with model.remat=none), trained once per stack."""
    from nestor.orchestrator.loader import config as config_lib

    cache = {}

    def runs(stack):
        degrees, overrides = STACKS[stack]

        def make(*more):
            base = [*TINY, "train.steps=3", "optimizer.warmup_steps=1", f"run.dir={tmp_path_factory.mktemp('run')}",
                    *overrides, *more]
            return config_lib.load(None, base).replace(**mesh_overrides(**degrees))

        if stack not in cache:
            cache[stack] = make, run_fresh(make("model.remat=none"))
        return cache[stack]

    return runs


@pytest.mark.slow
@pytest.mark.parametrize("stack, policy", CASES, ids=[f"{stack}-{policy}" for stack, policy in CASES])
def test_every_policy_trains_to_the_same_losses_as_no_remat(without_remat, stack, policy):
    make, reference = without_remat(stack)
    policy, *unrolled = policy.split()
    result = run_fresh(make(f"model.remat={policy}", *(["model.scan_layers=false"] if unrolled else [])))
    if stack.startswith("bfloat16"):
        # XLA skips some bfloat16 roundings inside its fusions (excess precision), which fuse differently with and
        # without remat: the pipelined step-0 loss moves by 6e-6 relative under `dots` before any update (equal
        # with --xla_allow_excess_precision=false, which the suite's process does not set), and
        # AdamW's normalised steps turn such differences in near-zero gradients into parameter differences of
        # 1e-3. So for every bfloat16 stack the three steps' losses are compared, at rtol 1e-4 (after two updates
        # the pipelined `dots` run's losses differ by up to 2.5e-5 relative).
        np.testing.assert_allclose(result.losses, reference.losses, rtol=1e-4)
    else:
        assert_same_training(result, reference, loss_rtol=1e-6)


def temporaries(config) -> tuple[int, float]:
    """Returns (XLA's temporary bytes per device of the compiled train step, seconds to build and compile)."""
    started = time.perf_counter()
    compiled = compile_step(build_job(config))
    return compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - started


@pytest.mark.slow
def test_full_remat_at_least_halves_temporaries_of_125m_on_fsdp8(tiny_config):
    # Compile only (nothing allocated): about 12 s per compile on 2 cores. Measured: none 1,250,360,768 B,
    # full 498,031,688 B per device (0.40x).
    base = ("model.preset=125m", "train.seq_len=512", "train.global_batch=8")
    none, _ = temporaries(tiny_config(*base, "model.remat=none").replace(**mesh_overrides(fsdp=8)))
    full, _ = temporaries(tiny_config(*base, "model.remat=full").replace(**mesh_overrides(fsdp=8)))
    assert full <= 0.5 * none, (full, none)


def test_offload_is_minimal_on_cpu_and_offloads_on_accelerators(tiny_config):
    offload = tiny_config("model.remat=offload")
    assert resolve_backend(backend_request(offload), "cpu").remat == "minimal"
    assert resolve_backend(backend_request(offload), "gpu").remat == "offload"
    # explain on CPU for a GPU reports offload and compiles minimal (no pinned host memory apart from the host's)
    for_gpu = resolve_backend(backend_request(tiny_config("model.remat=offload", "cluster.device_kind=h100")), "cpu")
    assert (for_gpu.remat, for_gpu.compiled_here().remat) == ("offload", "minimal")
    assert resolve_backend(backend_request(tiny_config("model.remat=none")), "cpu").remat_policy() is None


@pytest.mark.parametrize("overrides, key", [
    (("model.remat=some",), "model.remat"),
    (("model.remat=minimal", "model.remat_names=[query_proj,scores]"), "model.remat_names[1]"),
    (("model.remat=full", "model.remat_names=[query_proj]"), "model.remat_names"),
    (("pipeline.remat=full",), "pipeline.remat"),
], ids=["unknown_policy", "unknown_name", "names_without_named_policy", "removed_alias"])
def test_invalid_remat_config_names_its_key_path(tiny_config, overrides, key):
    with pytest.raises(ConfigError) as error:
        tiny_config(*overrides)
    assert key in [problem_key for problem_key, _ in error.value.problems]


def test_the_removed_pipeline_remat_names_model_remat(tiny_config):
    with pytest.raises(ConfigError) as error:
        tiny_config("pipeline.remat=dots_saveable")
    [(key, message)] = error.value.problems
    assert key == "pipeline.remat" and "write model.remat" in message
    # an older run's resolved config.yaml holds `pipeline: {remat: null}`: it still loads
    assert tiny_config("pipeline.remat=null").model.remat == "auto"


def test_auto_is_dots_for_accelerators_and_full_on_cpu(tiny_config):
    policy = lambda config, platform: resolve_backend(backend_request(config), platform).remat  # noqa: E731
    assert policy(tiny_config(), "cpu") == "full"
    assert policy(tiny_config(), "gpu") == "dots"
    assert policy(tiny_config(), "cuda") == "dots"
    assert policy(tiny_config(), "tpu") == "dots"
    # explain on CPU for an accelerator compiles what that accelerator would run
    assert policy(tiny_config("cluster.device_kind=h100"), "cpu") == "dots"
    assert policy(tiny_config("cluster.device_kind=tpu-v5p"), "cpu") == "dots"
    assert policy(tiny_config("cluster.accelerator=gpu"), "cpu") == "dots"
    assert policy(tiny_config("model.remat=none"), "gpu") == "none"
    assert policy(tiny_config("model.remat=full"), "cpu") == "full"


def test_dots_keeps_the_fused_attention_outputs_instead_of_running_its_forward_kernel_again(tiny_config):
    import jax
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    from jax.extend.core import Primitive

    from nestor.backend.remat import fused_attention_saveable

    # The name the policy matches is the one jax's cuDNN attention binds (a rename in jax fails here).
    assert fused_attention_saveable(cudnn_attention._dot_product_attention_fwd_p_wrapper)
    assert not fused_attention_saveable(jax.lax.exp_p)
    # A stand-in of that kernel (CPU has no cuDNN): a primitive of the same name whose outputs, the
    # context and its softmax statistics, are the residuals of a custom_vjp, as in jax's own.
    kernel = Primitive(cudnn_attention._dot_product_attention_fwd_p_wrapper.name)
    kernel.multiple_results = True
    kernel.def_abstract_eval(lambda x: (x, jax.core.ShapedArray(x.shape[:-1], x.dtype)))

    @jax.custom_vjp
    def attention(x):
        return kernel.bind(x)[0]

    def forward(x):
        context, statistics = kernel.bind(x)
        return context, (context, statistics)

    attention.defvjp(forward, lambda saved, gradient: (gradient * saved[0] + saved[1][..., None],))

    def forward_kernels(config) -> int:
        policy = resolve_backend(backend_request(config), "gpu").remat_policy()
        unit = jax.checkpoint(lambda x: jnp.sin(attention(x @ x)).sum(), policy=policy)
        return len(equations(jax.make_jaxpr(jax.grad(unit))(jnp.ones((4, 4))).jaxpr, kernel.name))

    assert forward_kernels(tiny_config("model.remat=dots")) == 1
    assert forward_kernels(tiny_config("model.remat=full")) == 2  # the backward pass runs it again
    named = "model.remat_names=[query_proj,attention_context]"
    assert forward_kernels(tiny_config("model.remat=minimal", named)) == 1
    assert forward_kernels(tiny_config("model.remat=minimal")) == 2


# Random routing is left out here: XLA:CPU compiles jax's threefry random bits to loops of their own.
UNROLLED = {"dense_fsdp4_tensor2": (dict(fsdp=4, tensor=2), ()),
            "moe_first_dense_expert2_data4": (dict(expert=2, data=4), ("moe.num_experts=4", "moe.every=1",
                                                                      "moe.first_dense_layers=2"))}


@pytest.mark.default_cpu_codegen  # counts loops in the compiled step
@pytest.mark.slow
@pytest.mark.parametrize("stack", UNROLLED)
def test_unrolled_stack_compiles_no_loop_where_the_scan_has_one(tiny_config, stack):
    # model.scan_layers=false writes the units (and an MoE model's first dense layers) out: no while loop, so
    # no [layers, ...] buffers of saved activations zero-filled before it (on an H100, moe-1b 31.2% -> 35.5%
    # MFU: docs/benchmarks.md).
    degrees, stack_overrides = UNROLLED[stack]

    def loops(*overrides):
        config = tiny_config("model.remat=dots", *stack_overrides, *overrides).replace(**mesh_overrides(**degrees))
        return compile_step(build_job(config)).as_text().count(" while(")

    assert loops() >= 1
    assert loops("model.scan_layers=false") == 0
