"""Getting processes onto hosts: Ray workers (`launcher`), joining jax.distributed
(`rendezvous`), Ray jobs (`jobs`) and cluster manifests (`manifests/`).
Takes the function to run as an argument; never imports orchestrator."""
