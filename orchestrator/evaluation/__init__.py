"""Evaluation and sampling: held-out loss on fixed batches (`loss`), decoding with a KV cache (`sampling`),
and the `nestor eval` / `nestor sample` commands on run.dir's newest checkpoint (`commands`)."""
