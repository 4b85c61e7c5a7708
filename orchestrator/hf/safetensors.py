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
            header, data_start = _header(path)
            end = data_start
            for tensor, entry in header.items():
                if tensor == "__metadata__":
                    continue
                if entry.get("dtype") not in DTYPES:
                    raise ConfigError([("model.init_from", f"{path}: tensor {tensor} has dtype {entry.get('dtype')}, "
                                                           f"which nestor does not read")])
                start, stop = entry["data_offsets"]
                self.tensors[tensor] = Tensor(path, DTYPES[entry["dtype"]], tuple(entry["shape"]), data_start + start)
                end = max(end, data_start + stop)
            if os.path.getsize(path) < end:
                raise ConfigError([("model.init_from", f"{path} is truncated: {os.path.getsize(path)} bytes, its "
                                                       f"header places tensors up to byte {end}")])
        self.bytes_read = 0
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
