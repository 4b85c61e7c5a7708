"""Flax NNX models. Math only: dimensions carry logical axis names
(models.axes); how they map to devices is decided elsewhere."""
