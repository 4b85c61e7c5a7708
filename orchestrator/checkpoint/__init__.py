"""A run's checkpoints: their directories on disk (`files`), the checksums of their files (`manifest`),
reading one step without changing anything (`reader`: `CheckpointReader`, `restore_state`), the run's own
saves and restores (`owner`: `Checkpointer`) and the lock that keeps one run per run.dir (`run_lock`).

Orchestrator rooms it may import: root, config, hf, job (hf: the fingerprint of a LoRA run's base).
"""
