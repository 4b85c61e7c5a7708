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
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

from nestor.models import axes
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.order import WindowOrder
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.user_code import UserCodeError, import_object, user_frames


def _open(path: Path, key: str) -> dict[str, np.ndarray]:
    """Returns the named arrays of one path: an .npz file's, or a directory's .npy files (memory-mapped).
    Raises ConfigError naming `key` and the file that does not read as arrays of numbers (garbage, cut
    short, pickled objects)."""
    if path.is_dir():
        files = sorted(path.glob("*.npy"))
        if not files:
            raise ConfigError([(key, f"{path} holds no .npy file; give .npz files or directories of .npy files")])
        return {file.stem: _loaded(file, key, lambda file=file: np.load(file, mmap_mode="r")) for file in files}
    if path.suffix != ".npz" or not path.is_file():
        raise ConfigError([(key, f"{path} is not an .npz file or a directory of .npy files")])

    def read() -> dict[str, np.ndarray]:
        with np.load(path) as archive:
            return {name: archive[name] for name in archive.files}

    return _loaded(path, key, read)


def _loaded(path: Path, key: str, read):
    """Returns `read()`, the arrays of file `path`; raises ConfigError naming `key` and the file where numpy
    cannot read it (a pickled object array is refused: loading one would run code)."""
    try:
        return read()
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as error:
        raise ConfigError([(key, f"{path} does not read as numpy arrays ({type(error).__name__}: "
                                 f"{str(error)[:200]}); write it with numpy.save or numpy.savez")]) from None


# numpy kind "V": jax's bfloat16 and float8 types (ml_dtypes), numbers all the same
_ML_FLOATS = {np.dtype(getattr(ml_dtypes, name)) for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")}


def _field_problem(where: str, name: str, array: np.ndarray) -> str | None:
    """Returns what makes field `name` of `where` no field of examples (a 0-d value, objects, strings), or None."""
    if array.ndim == 0:
        return f"field {name} of {where} is a single value {array.shape}; a field holds one row per example"
    if array.dtype.kind not in "biuf" and array.dtype not in _ML_FLOATS:
        return (f"field {name} of {where} holds {array.dtype} values; a field holds numbers (bool, int, float) "
                "in rows of one shape")
    return None


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
        first = parts[0][1]
        for where, arrays in parts:
            if sorted(arrays) != names:
                raise ConfigError([(key, f"{where} holds the fields {sorted(arrays)}, {parts[0][0]} holds {names}; "
                                         "every part must hold the same fields")])
            for name, array in arrays.items():
                if problem := _field_problem(where, name, array):
                    raise ConfigError([(key, problem)])
                if (array.shape[1:], array.dtype) != (first[name].shape[1:], first[name].dtype):
                    raise ConfigError([(key, f"field {name} of {where} has rows of {array.shape[1:]} {array.dtype}, "
                                             f"{parts[0][0]}'s of {first[name].shape[1:]} {first[name].dtype}; "
                                             "every part's rows of a field have one shape and dtype")])
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
            call = f"{config.data.factory}(split={split!r}, **{dict(config.data.args)})"
            try:
                arrays = factory(split=split, **dict(config.data.args))
            except TypeError as error:
                if not user_frames(error):  # the call itself: arguments the factory does not take
                    raise ConfigError([("data.args", f"{call} cannot be called: {error}")]) from None
                raise UserCodeError("data.factory", call, error) from None
            except Exception as error:  # noqa: BLE001 - the user's code raised: shown with its own frames
                raise UserCodeError("data.factory", call, error) from None
            if not isinstance(arrays, dict) or not arrays:
                raise ConfigError([("data.factory", f"{config.data.factory} returned {type(arrays).__name__}; it "
                                                    "must return a dict of named arrays, rows first")])
            _LOADED[origin] = {str(name): _as_array(value, f"{call}[{name!r}]") for name, value in arrays.items()}
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


def _as_array(value, what: str) -> np.ndarray:
    """Returns a factory's field `value` as an array; raises ConfigError (data.factory) for rows of different
    shapes, which make no array."""
    try:
        return np.asarray(value)
    except ValueError as error:
        raise ConfigError([("data.factory", f"{what} makes no array ({str(error)[:200]}): its rows differ in "
                                            "shape")]) from None


def field_axes(ndim: int) -> tuple[str | None, ...]:
    """Returns the logical axes of a field of `ndim` dimensions: its rows split like any batch, the rest whole."""
    return (axes.BATCH,) + (None,) * (ndim - 1)
