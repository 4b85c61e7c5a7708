"""What the orchestrator asks of a model, in one interface: `base.ModelSpec` (its loss is the task contract
of models.task; the spec answers the rest: how it is built, which checks its keys need, its analytic FLOPs,
decoding, Hugging Face mapping, how its pipelined stack's activations are laid out). `registry.spec_of`
returns a run's: nestor's decoder LM (`lm`) or a user's Flax NNX module (`user`), in the spirit of
torchtitan's TrainSpec.

Orchestrator rooms it may import: root, config.
"""
