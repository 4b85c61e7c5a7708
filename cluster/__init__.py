"""Getting processes onto hosts: in-process runs, Ray workers and
jax.distributed. Takes the function to run as an argument."""
