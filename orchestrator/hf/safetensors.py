"""The safetensors format read and written by byte range, so that a process touches only its slices.

A file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
byte range in the data that follows, then the tensors row-major. `Reader` reads any box of a tensor
with one `os.pread` per contiguous run (counting the bytes it reads); `write_layout` writes the headers
of a sharded checkpoint and sizes its files, into which each process writes its own boxes (`write_box`).
Hugging Face's `safetensors` package reads the files written here (tests/test_hf.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from nestor.orchestrator.errors import ConfigError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
FLOATS = {DTYPES[name] for name in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")}  # what weights are
INDEX = "model.safetensors.index.json"
Box = tuple[tuple[int, int], ...]  # per dimension [start, stop)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one tensor lies: its file, dtype, shape and the absolute byte offset of its first element."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


def runs(shape: tuple[int, ...], box: Box, itemsize: int) -> Iterator[tuple[int, int]]:
    """Yields (byte offset from the tensor's start, byte length) of the contiguous runs of a row-major
    tensor of `shape` that make up `box`, in row-major order."""
    partial = [dim for dim, (start, stop) in enumerate(box) if (start, stop) != (0, shape[dim])]
    last = partial[-1] if partial else 0
    strides = [math.prod(shape[dim + 1:]) for dim in range(len(shape))]
    if not shape:
        yield 0, itemsize
        return
    length = (box[last][1] - box[last][0]) * strides[last] * itemsize
    if length == 0:
        return
    outer = [range(start, stop) for start, stop in box[:last]]
    for index in np.ndindex(*(len(r) for r in outer)) if outer else [()]:
        element = sum((outer[dim][i]) * strides[dim] for dim, i in enumerate(index)) + box[last][0] * strides[last]
        yield element * itemsize, length


def _header(path: Path) -> tuple[dict, int]:
    """Returns (the JSON header, the byte offset where the data starts) of a safetensors file."""
    try:
        with open(path, "rb") as file:
            size_bytes = file.read(8)
            if len(size_bytes) < 8:
                raise ValueError("shorter than its 8-byte header length")
            (size,) = struct.unpack("<Q", size_bytes)
            if size > os.path.getsize(path) - 8:
                raise ValueError(f"its header claims {size} bytes, past the end of the file")
            return json.loads(file.read(size)), 8 + size
    except (OSError, ValueError) as error:
        raise ConfigError([("model.init_from", f"{path} is not a readable safetensors file: {error}")]) from None


def _problem(path: Path, message: str) -> ConfigError:
    return ConfigError([("model.init_from", f"{path}: {message}")])


def _checked_entry(path: Path, tensor: str, entry: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """Returns (dtype, shape, start, stop) of one header entry; raises ConfigError naming the tensor and the
    file when it is no mapping, lacks a field, or holds an unknown dtype or a byte range other than its
    shape's."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise _problem(path, f"tensor {tensor}'s header entry is not a mapping of dtype, shape and data_offsets "
                             f"({str(entry)[:100]})")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise _problem(path, f"tensor {tensor} has dtype {dtype!r}, which nestor does not read")
    if not (isinstance(shape, list) and all(type(size) is int and size >= 0 for size in shape)):
        raise _problem(path, f"tensor {tensor} has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _problem(path, f"tensor {tensor} has data_offsets {offsets!r}, not [start, stop] with start <= stop")
    start, stop = offsets
    if stop - start != math.prod(shape) * DTYPES[dtype].itemsize:
        raise _problem(path, f"tensor {tensor} spans {stop - start} bytes, its shape {shape} of {dtype} makes it "
                             f"{math.prod(shape) * DTYPES[dtype].itemsize}")
    return DTYPES[dtype], tuple(shape), start, stop


def tensors_of(path: Path) -> dict[str, Tensor]:
    """Returns where each tensor of safetensors file `path` lies, once its header is checked: each entry
    whole (`_checked_entry`), and the tensors' bytes inside the file without overlapping. Raises ConfigError
    naming the file and the tensor otherwise."""
    header, data_start = _header(path)
    if not isinstance(header, dict):
        raise _problem(path, f"its header is a JSON {type(header).__name__}, not a mapping of tensors")
    size = os.path.getsize(path)
    spans = []
    for tensor, entry in header.items():
        if tensor != "__metadata__":
            spans.append((*_checked_entry(path, tensor, entry), tensor))
    tensors, end, before = {}, 0, None
    for dtype, shape, start, stop, tensor in sorted(spans, key=lambda span: span[2:4]):
        if start < end:
            raise _problem(path, f"tensors {before} and {tensor} overlap (bytes {start}..{end} of its data)")
        if data_start + stop > size:
            raise _problem(path, f"truncated: {size} bytes, its header places tensor {tensor} up to byte "
                                 f"{data_start + stop}")
        tensors[tensor] = Tensor(path, dtype, shape, data_start + start)
        end, before = max(end, stop), tensor
    return tensors


class Reader:
    """The tensors of a directory's safetensors files (sharded with `model.safetensors.index.json`, or not),
    read by box; `bytes_read` counts the tensor bytes this reader has read."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise ConfigError([("model.init_from", f"{index} has no readable weight_map: {error}")]) from None
            if not (isinstance(weight_map, dict) and all(isinstance(name, str) and name and "/" not in name
                                                         for name in weight_map.values())):
                raise ConfigError([("model.init_from", f"{index}: its weight_map is not a mapping of tensor names "
                                                       "to file names in its directory")])
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(path.name for path in directory.glob("*.safetensors"))
        if not files:
            raise ConfigError([("model.init_from", f"{directory} holds no *.safetensors file")])
        self.tensors: dict[str, Tensor] = {}
        for name in files:
            path = directory / name
            if not path.is_file():
                raise ConfigError([("model.init_from", f"{path} is missing ({INDEX} lists it)")])
            self.tensors |= tensors_of(path)
        self.bytes_read = 0
        self.zeros: set[str] = set()  # tensors read as zeros that should not be (orchestrator.hf.load)
        self._files: dict[Path, int] = {}

    def read(self, name: str, box: Box | None = None) -> np.ndarray:
        """Returns the `box` of tensor `name` (default: all of it) in its stored dtype."""
        tensor = self.tensors[name]
        box = box or tuple((0, size) for size in tensor.shape)
        fd = self._files.get(tensor.file)
        if fd is None:
            fd = self._files[tensor.file] = os.open(tensor.file, os.O_RDONLY)
        parts = []
        for offset, length in runs(tensor.shape, box, tensor.dtype.itemsize):
            data = os.pread(fd, length, tensor.offset + offset)
            if len(data) != length:
                raise ConfigError([("model.init_from", f"{tensor.file} ended inside tensor {name}")])
            parts.append(data)
            self.bytes_read += length
        return np.frombuffer(b"".join(parts), tensor.dtype).reshape([stop - start for start, stop in box])

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files = {}


def header_bytes(tensors: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, dict]:
    """Returns (the file's first bytes: length and JSON header padded to 8 bytes, {name: data offset}) for
    `tensors` {name: (dtype name, shape)} stored in that order."""
    entries, offsets, position = {"__metadata__": metadata}, {}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * DTYPES[dtype].itemsize
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + size]}
        offsets[name] = position
        position += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header, offsets


def create(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> None:
    """Writes the header of a safetensors file for `tensors` and sizes the file for their data (zeros),
    which `write_box` fills."""
    head, _ = header_bytes(tensors, metadata)
    data = sum(math.prod(shape) * DTYPES[dtype].itemsize for dtype, shape in tensors.values())
    with open(path, "wb") as file:
        file.write(head)
        file.truncate(len(head) + data)


def write_box(path: Path, tensor: Tensor, box: Box, values: np.ndarray) -> int:
    """Writes `values` (the `box` of the tensor, in its dtype) into its place in the file; returns the bytes
    written."""
    data = np.ascontiguousarray(values, tensor.dtype).reshape(-1).view(np.uint8)
    written = 0
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset, length in runs(tensor.shape, box, tensor.dtype.itemsize):
            os.pwrite(fd, data[written:written + length].tobytes(), tensor.offset + offset)
            written += length
    finally:
        os.close(fd)
    return written
