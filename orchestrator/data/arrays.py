"""Named arrays as a data source, for any model (models.task).

`data.source: arrays`: `data.paths` names `.npz` files or directories of `.npy` files (one per field, opened
memory-mapped), all fields of all paths with the same names and the same number of rows; the paths' rows
are concatenated in the order given. `data.source: python`: `data.factory` (module:function) returns the
arrays of a split itself (called once per process and split, the arrays then held in memory). Row r of
step s reads the example a seeded permutation of the examples puts at position s x global_batch + r, a new
permutation every epoch (orchestrator.data.order): a pure function of (run.seed, s, r), so any mesh and
host count see the same batches, and each process reads only its rows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from nestor.models import axes
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.order import WindowOrder
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.user_code import import_object


def _open(path: Path, key: str) -> dict[str, np.ndarray]:
    """Returns the named arrays of one path: an .npz file's, or a directory's .npy files (memory-mapped)."""
    if path.is_dir():
        files = sorted(path.glob("*.npy"))
        if not files:
            raise ConfigError([(key, f"{path} holds no .npy file; give .npz files or directories of .npy files")])
        return {file.stem: np.load(file, mmap_mode="r") for file in files}
    if path.suffix != ".npz" or not path.is_file():
        raise ConfigError([(key, f"{path} is not an .npz file or a directory of .npy files")])
    with np.load(path) as archive:
        return {name: archive[name] for name in archive.files}


# The arrays a process has loaded, by where from (an .npz file and its mtime, a factory call): a job asks for
# its batches' fields and then its rows, so each file is read and each factory runs once.
_LOADED: dict[str, dict[str, np.ndarray]] = {}


class ArraySource:
    """The rows of named arrays read by (seed, step, row); `rows(step, rows)` -> {field: [len(rows), ...]}.

    `parts` are (where from, {field: array}) in order, their rows concatenated; `origin` names them for the
    fingerprint; `key` is the config key errors name.
    """

    def __init__(self, config: Config, parts: list[tuple[str, dict[str, np.ndarray]]], key: str, origin: str):
        names = sorted(parts[0][1])
        for where, arrays in parts:
            if sorted(arrays) != names:
                raise ConfigError([(key, f"{where} holds the fields {sorted(arrays)}, {parts[0][0]} holds {names}; "
                                         "every part must hold the same fields")])
            lengths = {name: len(array) for name, array in arrays.items()}
            if len(set(lengths.values())) != 1 or 0 in lengths.values():
                raise ConfigError([(key, f"the fields of {where} have no rows or different numbers of rows: "
                                         f"{lengths}")])
        self.arrays = {name: [arrays[name] for _, arrays in parts] for name in names}
        self.starts = np.cumsum([0] + [len(arrays[names[0]]) for _, arrays in parts])
        self.num_rows = int(self.starts[-1])
        self.num_tokens = None
        self.global_batch = config.train.global_batch
        self.order = WindowOrder(config.run.seed, self.num_rows)
        listing = "\n".join([origin] + [f"{where}:{name}:{arrays[name].shape}:{arrays[name].dtype}"
                                         for where, arrays in parts for name in names])
        self.fingerprint = "arrays:" + hashlib.sha256(listing.encode()).hexdigest()[:16]

    @classmethod
    def from_paths(cls, config: Config, paths: tuple[str, ...], key: str = "data.paths") -> ArraySource:
        """Returns the source of `.npz` files and directories of `.npy` files (`data.source: arrays`)."""
        if not paths:
            raise ConfigError([(key, "data.source=arrays needs .npz files or directories of .npy files")])
        parts = []
        for p in paths:
            path = Path(p).expanduser()
            loaded = f"path:{path.resolve()}:{path.stat().st_mtime_ns if path.exists() else None}"
            if loaded not in _LOADED:
                _LOADED[loaded] = _open(path, key)
            parts.append((p, _LOADED[loaded]))
        return cls(config, parts, key, "paths")

    @classmethod
    def from_factory(cls, config: Config, split: str) -> ArraySource:
        """Returns the source of `data.factory(split=split, **data.args)`: a dict of named arrays, rows first
        (`data.source: python`); `split` is "train", or "eval" for the held-out rows (eval.source: heldout)."""
        origin = f"factory:{config.data.factory}:{sorted(dict(config.data.args).items())}:{split}"
        if origin not in _LOADED:
            factory = import_object(config.data.factory or "", "data.factory", "mypackage.data:images")
            try:
                arrays = factory(split=split, **dict(config.data.args))
            except TypeError as error:
                raise ConfigError([("data.args", f"{config.data.factory}(split={split!r}, **"
                                                 f"{dict(config.data.args)}) cannot be called: {error}")]) from None
            if not isinstance(arrays, dict) or not arrays:
                raise ConfigError([("data.factory", f"{config.data.factory} returned {type(arrays).__name__}; it "
                                                    "must return a dict of named arrays, rows first")])
            _LOADED[origin] = {str(name): np.asarray(value) for name, value in arrays.items()}
        arrays = _LOADED[origin]
        return cls(config, [(f"{config.data.factory}(split={split!r})", arrays)], "data.factory", origin)

    def example_shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Returns each field's shape past the rows and its dtype."""
        return {name: (parts[0].shape[1:], parts[0].dtype) for name, parts in self.arrays.items()}

    def _example(self, index: int) -> tuple[int, int]:
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        return part, index - int(self.starts[part])

    def rows(self, step: int, rows: range) -> dict[str, np.ndarray]:
        """Returns the fields of `rows` of global batch `step`, each [len(rows), ...]."""
        examples = [self._example(self.order(step * self.global_batch + row)) for row in rows]
        return {name: np.stack([parts[part][index] for part, index in examples])
                for name, parts in self.arrays.items()}


def field_axes(ndim: int) -> tuple[str | None, ...]:
    """Returns the logical axes of a field of `ndim` dimensions: its rows split like any batch, the rest whole."""
    return (axes.BATCH,) + (None,) * (ndim - 1)
