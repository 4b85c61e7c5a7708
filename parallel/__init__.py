"""How arrays are laid out and moved: the device mesh, logical-axis rules,
HLO collective accounting and pipeline schedules. Knows nothing of models."""
