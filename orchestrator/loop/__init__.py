"""Training, watched: the loop (`train`), the state's health and blow-ups (`health`), the hang watchdog
(`hang`), signals (`signals`), goodput (`goodput`), metrics, MFU and TensorBoard (`metrics`, `peak_flops`),
the profiler (`profiler`), what a run prints (`console`) and its JSON-lines files read back (`records`).

Orchestrator rooms it may import: root, config, specs, data, hf, loader, job, checkpoint.
"""
