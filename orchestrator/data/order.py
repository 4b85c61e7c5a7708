"""Which window of a packed corpus each row reads: the order every windowed source shares."""

from __future__ import annotations

import numpy as np

from nestor.orchestrator.errors import ConfigError


def windows_of(tokens: int, width: int, key: str) -> int:
    """Returns how many whole windows of `width` tokens `tokens` hold; raises ConfigError naming `key`
    when not one."""
    if tokens < width:
        raise ConfigError([(key, f"{tokens} tokens are fewer than one sequence of train.seq_len + 1 = {width}; "
                                 "add data")])
    return tokens // width


class WindowOrder:
    """Which window the row at a global position reads: a seeded permutation of the windows per epoch,
    so every epoch visits each window once. `seed` may be a tuple (one order per mixture source)."""

    def __init__(self, seed: int | tuple[int, ...], num_windows: int):
        self.seed = seed if isinstance(seed, tuple) else (seed,)
        self.num_windows = num_windows
        self._permutation: tuple[int, np.ndarray] | None = None  # (epoch, order): one epoch cached

    def __call__(self, position: int) -> int:
        """Returns the window index of global row position `position` (step * global_batch + row)."""
        epoch, within = divmod(position, self.num_windows)
        if self._permutation is None or self._permutation[0] != epoch:
            self._permutation = (epoch, np.random.default_rng((*self.seed, epoch)).permutation(self.num_windows))
        return int(self._permutation[1][within])
