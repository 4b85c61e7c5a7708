"""MoE cost from XLA's cost analysis (compile-only): routing + dispatch + combine against the expert
FFNs for sort and dropless dispatch, and a dropless step against a dense model with the same active
parameters. Grouped matmuls are counted as GPU and TPU run them (bench.moe.useful_ragged_dot)."""

import pytest

from bench.moe import _config, moe_overrides, routing_flop_share, useful_ragged_dot
from nestor.orchestrator.job.compiled import compile_step, step_flops
from nestor.orchestrator.job.build import build_job

EXPERT_COUNTS = (8, 32, 128)


@pytest.mark.parametrize("dispatch", ["sort", "dropless"])
def test_routing_dispatch_and_combine_cost_at_most_a_tenth_of_the_expert_ffns(dispatch):
    # the bench's model (embed 128, experts 256 wide, top-2), 8 sequences of 128 tokens
    shares = {experts: routing_flop_share(_config(*moe_overrides(experts, 2, dispatch), "train.global_batch=8"))
              for experts in EXPERT_COUNTS}
    assert all(0.0 < share <= 0.10 for share in shares.values()), shares
    assert shares[8] < shares[128]  # the router matmul grows with the expert count


@pytest.mark.slow
def test_a_dropless_step_costs_at_most_1_1_times_a_dense_model_with_the_same_active_parameters(tiny_config):
    one_device = ("cluster.devices_per_host=1", "mesh.data=1", "train.seq_len=128")
    # 8 experts of half the dense width, top-2 in every layer: each token's active FFN is the dense one
    dropless = tiny_config(*one_device, "moe.num_experts=8", "moe.every=1", "moe.top_k=2", "moe.expert_mlp_dim=64",
                           "moe.capacity_factor=0")
    dense = tiny_config(*one_device)
    with useful_ragged_dot():
        flops = {name: step_flops(compile_step(build_job(config, with_data=False)))
                 for name, config in (("dropless", dropless), ("dense", dense))}
    assert 1.0 < flops["dropless"] / flops["dense"] <= 1.10, flops
