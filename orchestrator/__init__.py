"""The training job: config -> state -> step -> loop, data, checkpoints,
metrics and the `nestor` CLI. The only package that imports the others."""
