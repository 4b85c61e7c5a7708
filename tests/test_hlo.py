"""Collective and FLOP accounting on HLO text."""

import jax
import jax.numpy as jnp
import pytest

from nestor.orchestrator.job.compiled import cost_flops
from nestor.parallel.hlo import (collectives, dot_operand_dtypes, estimated_flops, float_normalization_flops,
                                 flops_per_run)

_ELEMENT = "f32[1,2,40,128]{3,2,1,0}"


def _module(operands: int) -> str:
    shapes = ", ".join(("/*index=5*/" if i == 5 else "") + _ELEMENT for i in range(operands))
    args = ", ".join(f"%p{i}" for i in range(operands))
    return f"ENTRY %main () -> f32[] {{\n  %a = ({shapes}) all-to-all({args}), channel_id=1\n}}\n"


def test_tuple_collectives_of_any_width_are_counted_with_all_their_bytes():
    for operands in (2, 8):
        assert collectives(_module(operands))["all-to-all"] == {"count": 1, "bytes": operands * 2 * 40 * 128 * 4}


@pytest.mark.parametrize("groups, counted", [("{{0},{1},{2},{3}}", 0), ("[4,1]<=[4]", 0), ("{{0,1},{2,3}}", 1),
                                              ("[2,2]<=[4]", 1)])
def test_a_collective_within_groups_of_one_device_moves_nothing_and_is_not_counted(groups, counted):
    module = f"ENTRY %main () -> f32[] {{\n  %a = f32[8]{{0}} all-reduce(%p), replica_groups={groups}, to_apply=%add\n}}\n"
    assert collectives(module)["all-reduce"] == {"count": counted, "bytes": counted * 32}


def _nested_scans(unroll: bool):
    """Returns a jitted f(x [8, 32], w [32, 32]): 3 outer x 4 inner iterations of tanh(x @ w), then a sum."""

    def inner(x, w):
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w) + 1.0, None), x, None, length=4, unroll=unroll)[0]

    def f(x, w):
        y = jax.lax.scan(lambda h, _: (inner(h, w) * 0.5, None), x, None, length=3, unroll=unroll)[0]
        return jnp.sum(y * y)

    return jax.jit(f)


def _compiled_scans(unroll: bool):
    return _nested_scans(unroll).lower(jnp.ones((8, 32)), jnp.ones((32, 32))).compile()


def _compiled_convolutions():
    """Returns the compiled gradients of a strided, padded, dilated, grouped 2-D convolution."""

    def f(x, kernel):  # x [batch, features, height, width], kernel [out, in / groups, 3, 3]
        y = jax.lax.conv_general_dilated(x, kernel, (2, 1), ((1, 2), (0, 1)), rhs_dilation=(1, 2),
                                         feature_group_count=2)
        return jnp.sum(jnp.tanh(y))

    return jax.jit(jax.grad(f, argnums=(0, 1))).lower(jnp.ones((2, 8, 17, 16)), jnp.ones((8, 4, 3, 3))).compile()


PROGRAMS = {"scans": lambda: _compiled_scans(False), "unrolled": lambda: _compiled_scans(True),
            "convolutions": _compiled_convolutions}


@pytest.mark.parametrize("program", PROGRAMS.values(), ids=PROGRAMS.keys())
def test_hlo_flop_estimate_equals_xla_cost_analysis_of_the_same_program(program):
    compiled = program()
    assert estimated_flops(compiled.as_text(), loop_iterations=False) == pytest.approx(cost_flops(compiled), rel=1e-5)


def test_flops_per_run_counts_each_nested_loop_body_once_per_iteration():
    rolled, unrolled = _compiled_scans(False), _compiled_scans(True)
    assert rolled.as_text().count(" while(") == 2 and " while(" not in unrolled.as_text()
    dots = 3 * 4 * 2 * 8 * 32 * 32  # 12 runs of an [8, 32] x [32, 32] matmul
    assert cost_flops(rolled) < dots / 6 < dots < cost_flops(unrolled)  # XLA alone counts each body once
    # Only the rolled program's loop counters and conditions (a few dozen FLOPs) are extra.
    assert flops_per_run(rolled.as_text(), cost_flops(rolled)) == pytest.approx(cost_flops(unrolled), rel=1e-3)


def test_dot_operand_dtypes_read_fused_computations_parameters():
    text = ("%fused (param_0: bf16[4,8], param_1: f32[8,2]) -> f32[4,2] {\n"
            "  %param_0 = bf16[4,8]{1,0} parameter(0)\n"
            "  %param_1 = f32[8,2]{1,0} parameter(1)\n"
            "  %convert = f32[4,8]{1,0} convert(%param_0)\n"
            "  ROOT %dot.1 = f32[4,2]{1,0} dot(%convert, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
            "}\n\n"
            "ENTRY %main (a: bf16[4,8], b: bf16[8,2], c: f32[8,2]) -> f32[4,2] {\n"
            "  %a = bf16[4,8]{1,0} parameter(0)\n"
            "  %b = bf16[8,2]{1,0} parameter(1)\n"
            "  %c = f32[8,2]{1,0} parameter(2)\n"
            "  %dot.2 = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
            "  ROOT %fusion = f32[4,2]{1,0} fusion(%a, %c), kind=kCustom, calls=%fused\n"
            "}\n")
    assert sorted(dot_operand_dtypes(text)) == [("bf16", "bf16"), ("f32", "f32")]


def test_the_converts_a_compile_adds_to_run_16_bit_floats_in_float32_are_counted_apart():
    def step(weights, x):  # bfloat16 matmul and tanh; the cast of the weights is the program's own
        return jnp.tanh(x @ weights.astype(jnp.bfloat16)).astype(jnp.float32).sum()

    weights, x = jnp.ones((64, 32), jnp.float32), jnp.ones((16, 64), jnp.bfloat16)
    widened = jax.jit(step).lower(weights, x).compile().as_text()
    plain = jax.jit(lambda w, x: jnp.tanh(x @ w).sum()).lower(weights, x.astype(jnp.float32)).compile().as_text()
    # this CPU widens the dot's operands and the tanh's, and narrows their results: each counted once per element
    assert float_normalization_flops(widened) >= 16 * 64 + 16 * 32
    assert float_normalization_flops(widened) < estimated_flops(widened)
    assert float_normalization_flops(plain) == 0  # float32 throughout: nothing to widen
