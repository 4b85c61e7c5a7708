"""bench/step.py compares like with like: its bare jax.jit step computes nestor's loss and update."""

import jax
import numpy as np

from bench.step import MESHES, bench_config, make_bare_step
from orchestrator.state import init_state
from orchestrator.train import build_job

SMALL = ("model.embed_dim=64", "model.mlp_dim=128", "model.num_heads=4", "model.num_kv_heads=2",
         "model.head_dim=16", "model.vocab_size=256", "model.dtype=float32", "train.seq_len=32")


def test_bare_step_matches_nestor_step_on_the_pipeline_mesh():
    config = bench_config(MESHES["pipeline2 x fsdp2 x tensor2"], *SMALL)
    job = build_job(config)
    tokens = job.data.batch(0)
    nestor_state, metrics = job.step_fn(init_state(config, job.layout), tokens)
    bare_step, shardings, batch = make_bare_step(config, job)
    bare_state, loss = bare_step(jax.device_put(init_state(config, job.layout), shardings),
                                 jax.device_put(tokens, batch))
    np.testing.assert_allclose(float(loss), float(metrics["loss"]), rtol=1e-5)
    # Adam's first update is about lr * sign(grad) = 3e-4 per weight; where a gradient is ~eps the
    # two summation orders may round it differently, so parameters agree to a small share of that.
    for got, want in zip(jax.tree.leaves(bare_state["params"]), jax.tree.leaves(nestor_state["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
