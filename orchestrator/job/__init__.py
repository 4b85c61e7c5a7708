"""What a run builds from its config and runs on every process: the mesh and data (`build`), the sharded
train state and its layout (`state`), the optimizer (`optimizer`), the train step (`step`, with the
wiring of MoE and context parallelism into it: `moe_wiring`, `context_wiring`), what the step compiled
without running says of its memory and FLOPs (`compiled`), the held-out loss (`eval_loss`) and this
process's JAX and its agreement with its peers (`processes`).

Orchestrator rooms it may import: root, config, specs, data, hf, loader.
"""
