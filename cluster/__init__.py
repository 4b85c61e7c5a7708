"""Getting processes onto hosts: Ray workers (`launcher`), joining jax.distributed
(`rendezvous`), Ray jobs (`jobs`), simulated CPU devices (`cpu_devices`) and cluster
manifests (`manifests/`).
Takes the function to run as an argument; never imports orchestrator."""
