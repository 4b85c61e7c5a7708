"""Hugging Face checkpoints in: `model.init_from` (a directory of config.json and safetensors) starts a run
from those weights: config.json as nestor's keys (`architectures`), which tensor holds each parameter
(`tensors`), safetensors read by slices (`safetensors`) and the parameters loaded onto the mesh (`load`).
Writing a run back in that form is a command (commands.hf_export).

Orchestrator rooms it may import: root, config, specs.
"""
