"""The run's input: sources (synthetic, text files, prepared token shards and their mixtures) and the
pipeline that turns a step into a sharded global batch (`pipeline`), and `nestor data prepare`, which
writes token shards (`prepare`, `shards`). Nothing is imported here, so that prepare's worker
processes start without JAX."""
