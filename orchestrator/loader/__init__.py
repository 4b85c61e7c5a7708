"""A run's config from files: presets, includes and KEY=VALUE overrides, `model.init_from`'s config.json,
prepared shards and tokenizers (`config`: `load`, and the Config whose `replace` validates), and the checks
of a whole config (`validation`, with the memory estimate of `memory_fit` and the keys a model leaves
unused, `idle_keys`).

Orchestrator rooms it may import: root, config, specs, data, hf.
"""
