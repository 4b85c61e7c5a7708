"""Evaluation commands and sampling: decoding with a KV cache (`sampling`), and `nestor eval` / `nestor
sample` / `nestor logits` on run.dir's newest checkpoint (`commands`); the held-out loss they and training
compute is job.eval_loss.

Orchestrator rooms it may import: root, config, specs, data, hf, loader, job, checkpoint.
"""
