"""Hugging Face checkpoints in and out: `model.init_from` (a directory of config.json and safetensors) starts
a run from those weights, `nestor export --to hf` writes a run's parameters back in that form."""
