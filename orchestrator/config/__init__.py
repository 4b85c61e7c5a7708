"""The run config's pure schema: the typed, frozen sections and their keys with defaults, ranges, choices
and help (`schema`; `keys`: how a key declares them), the mesh degrees a config implies (`degrees`)
and the YAML reading every loader shares (`yaml_files`). The schema reads no file and imports neither JAX
nor the backend, so any process can hold a config (`degrees` uses parallel's rules, and so JAX); loading
one from files is the loader's.

Orchestrator rooms it may import: root.
"""
