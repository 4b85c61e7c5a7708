"""The `nestor` CLI (`cli`) and what its commands run beyond training and evaluation: `explain`
(`explain`; `plan` is the planning room's), `export --to hf` (`hf_export`), the checks before a launch (`launch_checks`, `preflight`)
and the Ray driver of a run (`ray_driver`).

Orchestrator rooms it may import: root, config, specs, data, hf, loader, job, checkpoint, loop, evaluation,
planning.
"""
