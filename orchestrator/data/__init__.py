"""The run's input: its sources (synthetic tokens, text files, prepared token shards and their mixtures in
`tokens`; a model of the user's named arrays in `arrays`, the example datasets in `examples`), the order
steps read them in (`order`), the pipeline that turns a step into a sharded global batch (`batches`), the
tokenizer files that turn text into ids (`tokenizer`), and `nestor data prepare`, which writes token
shards (`prepare`, `shards`). Nothing is imported here, so that prepare's worker processes start without
JAX.

Orchestrator rooms it may import: root, config.
"""
