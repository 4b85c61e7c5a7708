"""`nestor plan`: the layout chosen for the user. Candidates over the target's devices (mesh degrees within
and across hosts, pipeline schedule and micro-batches, remat, gradient accumulation, sharded update) are
enumerated with the user's pins kept (`candidates`), rejected by the config's own rules and an analytic
bound on the state's bytes, compiled without running and judged against the device's memory (`search`),
and ranked by a cost model (`cost`) whose device figures and calibration constants, each with its source,
live in `devices` and `calibration.yaml`; `report` prints the table and writes the winner as a YAML overlay;
`measure` trains the top candidates for a few steps and re-ranks them by measured step time (--measure).

Orchestrator rooms it may import: root, config, specs, loader, job, loop (loop: the peak FLOP/s table,
the training loop).
"""
