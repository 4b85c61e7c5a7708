"""Getting processes onto hosts: reaching a Ray cluster (`connect`), the driver of a run's Ray workers
(`driver`) and each worker (`worker`), joining jax.distributed (`rendezvous`), Ray jobs (`jobs`), the
embedded head (`head`), signals (`interrupts`), simulated CPU devices (`cpu_devices`) and cluster manifests
(`manifests/`). Takes the function to run as an argument; never imports orchestrator."""
