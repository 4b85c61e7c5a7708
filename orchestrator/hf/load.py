"""`model.init_from`: a fresh run's parameters read from a Hugging Face checkpoint into their shardings.

Every parameter is built by `jax.make_array_from_callback`: each process reads, for each distinct box its
devices hold, the slices of the tensors that make it up (orchestrator.hf.safetensors), so no host holds
the whole model, on any mesh. The checkpoint's tensors are checked against its config.json first: a
missing, surplus or misshapen tensor is a ConfigError naming it.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import jax
import numpy as np

from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.hf.architectures import ARCHITECTURES, KEY, architecture, read
from nestor.orchestrator.hf.safetensors import FLOATS, NAMES, Box, Reader
from nestor.orchestrator.hf.tensors import IGNORED_SUFFIXES, Entry, entries
from nestor.orchestrator.specs.lm import lm_config

# files of a checkpoint directory a run keeps in run.dir/hf/ for export and sampling
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")
SOURCE_DIR = "hf"


def checkpoint_entries(config: Config) -> list[Entry]:
    """Returns the entries (orchestrator.hf.tensors) of the run's LM, its experts named as its checkpoint's."""
    directory = Path(config.model.init_from)
    return entries(lm_config(config), ARCHITECTURES[architecture(read(directory), directory)])


def check_tensors(reader: Reader, model_entries: list[Entry], tied: bool) -> None:
    """Raises ConfigError listing the tensors the checkpoint lacks, holds beyond the model, or holds in
    another shape than its config.json implies."""
    expected = {name: entry.hf_shape for entry in model_entries for _, name in entry.names()}
    problems = []
    for name, shape in expected.items():
        tensor = reader.tensors.get(name)
        if tensor is None:
            problems.append((KEY, f"{reader.directory} lacks tensor {name} {list(shape)}"))
        elif tensor.shape != shape:
            problems.append((KEY, f"{reader.directory}: tensor {name} is {list(tensor.shape)}, its config.json "
                                  f"makes it {list(shape)}"))
        elif tensor.dtype not in FLOATS:
            problems.append((KEY, f"{tensor.file}: tensor {name} has dtype {NAMES[tensor.dtype]}, not a float "
                                  "type: the weights of a model are floats (a dtype label written wrong would read "
                                  "its bytes as other numbers)"))
    surplus = sorted(name for name in reader.tensors if name not in expected and not name.endswith(IGNORED_SUFFIXES)
                     and not (tied and name == "lm_head.weight"))
    if surplus:
        shown = ", ".join(surplus[:5]) + (f" and {len(surplus) - 5} more" if len(surplus) > 5 else "")
        problems.append((KEY, f"{reader.directory} holds tensors the model of its config.json has no place for: "
                              f"{shown}"))
    if problems:
        raise ConfigError(problems[:10])


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """Returns the box [start, stop) per dimension of a device's `index` into an array of `shape`."""
    return tuple(s.indices(size)[:2] for s, size in zip(index, shape))


# tensors for which zeros everywhere cannot be right: a norm's weight zeroes its layer, an embedding every token
NEVER_ZERO = ("norm.weight", "embed_tokens.weight")


def _checked_values(reader: Reader, name: str, values: np.ndarray) -> np.ndarray:
    """Returns `values` (a box of tensor `name`) once finite; raises ConfigError naming the tensor and its file
    when one is NaN or infinite. A norm weight or embedding that is zeros (a file still being downloaded,
    preallocated to its size) is noted in `reader.zeros`."""
    if not np.isfinite(values).all():
        bad = int(values.size - np.isfinite(values).sum())
        raise ConfigError([(KEY, f"{reader.tensors[name].file}: tensor {name} holds {bad} NaN or infinite "
                                 f"value{'s' if bad > 1 else ''}: the checkpoint is damaged")])
    if values.size and name.endswith(NEVER_ZERO) and not values.any():
        reader.zeros.add(name)
    return values


def _warn_of_zeros(reader: Reader, log) -> None:
    """Says in one `log` line per file which norm weights and embeddings read as zeros."""
    by_file: dict[Path, list[str]] = {}
    for name in sorted(reader.zeros):
        by_file.setdefault(reader.tensors[name].file, []).append(name)
    for file, names in by_file.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        log(f"warning: {file}: tensor{'s' if len(names) > 1 else ''} {shown} {'are' if len(names) > 1 else 'is'} "
            "all zeros, which no trained model holds (a file still being written or downloaded?)")


def read_box(reader: Reader, entry: Entry, box: Box) -> np.ndarray:
    """Returns the float32 values of `box` of nestor's parameter `entry`, read from its tensors' slices, each
    checked (`_checked_values`)."""
    stack, per_layer = box[:len(entry.stack)], box[len(entry.stack):]
    hf_box, _ = entry.hf_box(per_layer, exact=False)
    blocks = []
    for index in np.ndindex(*(stop - start for start, stop in stack)):
        name = entry.name(*(start + i for (start, _), i in zip(stack, index)))
        values = entry.to_nestor(reader.read(name, hf_box), per_layer).astype(np.float32)
        blocks.append(_checked_values(reader, name, values))
    shape = [stop - start for start, stop in box]
    return np.stack(blocks).reshape(shape) if stack else blocks[0]


def checked_reader(config: Config) -> tuple[Reader, list[Entry]]:
    """Returns (a reader of `model.init_from`, the run's entries) once every header and tensor is checked
    against config.json (`safetensors.tensors_of`, `check_tensors`); raises ConfigError naming what is not."""
    reader = Reader(Path(config.model.init_from))
    model_entries = checkpoint_entries(config)
    try:
        check_tensors(reader, model_entries, config.model.tie_embeddings)
    except ConfigError:
        reader.close()
        raise
    return reader, model_entries


def load_params(config: Config, abstract_params: dict, log=print) -> tuple[dict, int]:
    """Returns (the parameters of `config.model.init_from` laid out as `abstract_params` (a tree of sharded
    jax.ShapeDtypeStruct), the tensor bytes this process read). Raises ConfigError naming the tensor and file
    of a damaged checkpoint (`checked_reader`, a NaN or infinite value)."""
    reader, model_entries = checked_reader(config)
    by_path = {entry.path: entry for entry in model_entries}

    def load(path, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        entry = by_path[tuple(str(getattr(key, "key", key)) for key in path)]
        read: dict[Box, np.ndarray] = {}  # devices holding the same box share one read

        def box_values(index: tuple[slice, ...]) -> np.ndarray:
            box = box_of(index, leaf.shape)
            if box not in read:
                read[box] = read_box(reader, entry, box)
            return read[box]

        return jax.make_array_from_callback(leaf.shape, leaf.sharding, box_values)

    try:
        params = jax.tree_util.tree_map_with_path(load, abstract_params)
    finally:
        reader.close()
    _warn_of_zeros(reader, log)
    return params, reader.bytes_read


def keep_source_files(config: Config) -> None:
    """Copies the checkpoint's config, generation config and tokenizer files into run.dir/hf/ (process 0),
    where `nestor export` and `nestor sample` find them after the source has moved."""
    if jax.process_index():
        return
    target = Path(config.run.dir) / SOURCE_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        source = Path(config.model.init_from) / name
        if source.is_file():
            shutil.copyfile(source, target / name)


SAMPLED_BYTES = 1 << 16  # of each file's tensor data, at its start and its end


def fingerprint(config: Config) -> str:
    """Returns a fingerprint of the base a LoRA run adapts: of `model.init_from`'s config.json and of each
    safetensors file its header (every tensor's name, dtype, shape and place), size and first and last
    SAMPLED_BYTES of data (hashing every byte of a large model would take minutes); `run.seed` without one."""
    if not config.model.init_from:
        return f"run.seed={config.run.seed}"
    directory = Path(config.model.init_from)
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for path in sorted(directory.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as file:
            header = int.from_bytes(file.read(8), "little")
            digest.update(f"{path.name}:{size}".encode() + file.read(header + SAMPLED_BYTES))
            file.seek(max(size - SAMPLED_BYTES, 8 + header))
            digest.update(file.read(SAMPLED_BYTES))
    return digest.hexdigest()[:16]
