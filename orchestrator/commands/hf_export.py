"""`nestor export RUN_DIR --to hf OUT`: a run's checkpoint as a Hugging Face checkpoint that transformers,
vLLM and SGLang load: config.json, `model-0000i-of-0000n.safetensors` with their index, the generation
config and the tokenizer files; a LoRA run's adapters merged into the weights, or with `--adapters` alone
as a PEFT adapter directory.

Process 0 writes the files' headers and sizes them; then each process writes the tensor boxes its
devices hold (each parameter laid out over all devices along the dimension its tensors are outermost in,
so a box is whole rows of a tensor), and nothing is gathered onto one host.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nestor.models.lora import merged_tree

from nestor.orchestrator.checkpoint.reader import restore_state
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.batches import run_separator
from nestor.orchestrator.data.tokenizer import BYTES
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.hf import safetensors
from nestor.orchestrator.hf.architectures import ARCHITECTURES, CONFIG, to_hf
from nestor.orchestrator.hf.load import SIDE_FILES, SOURCE_DIR, box_of
from nestor.orchestrator.hf.peft import write_adapter
from nestor.orchestrator.hf.tensors import Entry, entries
from nestor.orchestrator.job.build import make_mesh
from nestor.orchestrator.job.processes import every_process_says, wait_for_every_process
from nestor.orchestrator.specs.lm import lm_config
from nestor.orchestrator.specs.registry import spec_of
from nestor.orchestrator.job.state import state_layout
from nestor.parallel.rules import resolve_rules

SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
DOCUMENT_SOURCES = ("text", "tokens")  # the data sources whose documents a separator ends
# the files beside a tokenizer that transformers reads with it (its special tokens, its chat template)
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclasses.dataclass(frozen=True)
class Written:
    step: int
    files: int
    tensors: int
    dtype: str
    notes: tuple[str, ...] = ()  # one line each, what a user of the export must know

    @property
    def step_text(self) -> str:
        return f"checkpoint {self.step}"


def file_plan(tensors: list[tuple[str, tuple[int, ...]]], dtype: str, max_bytes: float) -> list[list[int]]:
    """Returns the tensors' indices grouped into files of at most `max_bytes` each (a larger tensor alone)."""
    files, size = [[]], 0
    itemsize = safetensors.DTYPES[dtype].itemsize
    for index, (_, shape) in enumerate(tensors):
        nbytes = math.prod(shape) * itemsize
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(index)
        size += nbytes
    return files


def export_sharding(entry: Entry, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """Returns the sharding a parameter is written from: over every device along its first stack dimension,
    else along the dimension of its tensors' first rows, where the device count divides it; else replicated
    (written by one device)."""
    devices = mesh.devices.size
    outer = len(entry.stack) + entry.perm.index(0)
    for dim in ((0,) if entry.stack else ()) + (outer,):
        if shape[dim] % devices == 0:
            spec = [None] * len(shape)
            spec[dim] = "export"
            return NamedSharding(mesh, PartitionSpec(*spec))
    return NamedSharding(mesh, PartitionSpec())


def special_tokens(config: Config, hf_config: dict) -> tuple[dict, tuple[str, ...]]:
    """Returns (the bos/eos ids config.json and generation_config.json get, notes): ids that match how the run
    separated its documents (`run_separator`), and a note where that cannot be reproduced from the export.

    Byte-level runs opened and ended documents with the separator alone, and ship no tokenizer: bos and eos
    become it. A tokenizer's run keeps the source's eos and adds the separator when it is another id (a
    chat model's end of turn, then its end of text). Synthetic or array data has no documents: nothing changes."""
    if config.data.source not in DOCUMENT_SOURCES:
        return {}, ()
    try:
        separator = run_separator(config)
    except ConfigError as error:  # the run's data has moved: the source's ids stay
        return {}, (f"bos/eos kept as the source's: the run's separator is unknown ({error.problems[0][1]})",)
    if config.data.tokenizer in (None, BYTES):
        return {"bos_token_id": separator, "eos_token_id": separator}, (
            f"no tokenizer exported: the run trained on bytes (token id = UTF-8 byte, documents opened and ended "
            f"by id {separator}, written as bos/eos); transformers needs its own byte-level encoding",)
    eos = hf_config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    return {"eos_token_id": ids[0] if ids == [separator] else ids + [separator] * (separator not in ids)}, ()


def _side_files(config: Config, out: Path, hf_config: dict) -> None:
    """Writes config.json, the generation config and the tokenizer files beside the tensors (process 0)."""
    (out / CONFIG).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    kept = Path(config.run.dir) / SOURCE_DIR
    for name in SIDE_FILES:
        if name != CONFIG and (kept / name).is_file():
            shutil.copyfile(kept / name, out / name)
    tokenizer = config.data.tokenizer
    if tokenizer and tokenizer != BYTES:  # the run's tokenizer, and the files beside it that describe it
        directory = Path(tokenizer).parent
        for name in (Path(tokenizer).name, *TOKENIZER_FILES):
            if not (out / name).is_file() and (directory / name).is_file():
                shutil.copyfile(directory / name, out / name)
    tokens = {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config}
    generation = out / "generation_config.json"
    before = json.loads(generation.read_text()) if generation.is_file() else {"_from_model_config": True}
    generation.write_text(json.dumps({**before, **tokens}, indent=2) + "\n")


def _out_problem(out: Path) -> str | None:
    """Creates directory `out` where it is missing; returns why export cannot write into it (a file, a
    directory that holds files, a place this process cannot create or write a file in), or None."""
    if out.is_dir() and any(out.iterdir()):
        return f"{out} holds files; export writes into a new or empty directory"
    if (out.exists() or out.is_symlink()) and not out.is_dir():
        return f"{out} is a file; export writes a directory: name a new or empty one"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        return f"cannot write into {out}: {error.strerror or error}"
    return None


def export(config: Config, out: Path, step: int | None = None, dtype: str = "float32",
           max_shard_gb: float = 5.0, adapters: bool = False) -> Written:
    """Writes checkpoint `step` (default: the newest) of the run `config` describes to `out` as a Hugging Face
    checkpoint in `dtype`, a LoRA run's adapters merged into its weights, or with `adapters` as a PEFT
    adapter directory (orchestrator.hf.peft); returns what was written. Raises ConfigError for a model no
    supported architecture computes, an `out` it cannot write into (`_out_problem`), a run without that checkpoint, or
    `adapters` of a run without LoRA."""
    if adapters and not config.lora.rank:
        raise ConfigError([("--adapters", f"{config.run.dir} trained no adapters (lora.rank is 0); export the "
                                          "model without --adapters")])
    if not spec_of(config).hugging_face:
        raise ConfigError([("model.class", f"export writes nestor's LM; {config.model.class_} has no Hugging Face "
                                           "architecture")])
    # Process 0 writes the files and checks `out`: another process's look could see its probe file (a file
    # system without anonymous temporary files) and refuse alone, leaving the others at a barrier.
    problem = every_process_says("export target", (_out_problem(out) or "") if jax.process_index() == 0 else "")[0]
    if problem:
        raise ConfigError([("--out", problem)])
    saved = Path(config.run.dir) / SOURCE_DIR / CONFIG
    base = json.loads(saved.read_text()) if saved.is_file() else None
    keys = config.to_dict()
    hf_config = to_hf(keys["model"], keys["moe"], base)
    ids, notes = special_tokens(config, hf_config)
    hf_config.update(ids)
    for field in ("dtype", "torch_dtype"):
        if field in hf_config or (field == "dtype" and "torch_dtype" not in hf_config):
            hf_config[field] = dtype
    model_entries = entries(lm_config(config), ARCHITECTURES[hf_config["architectures"][0]])
    mesh = make_mesh(config)
    layout = state_layout(config, mesh, resolve_rules(config.mesh.rules))
    try:
        step, state = restore_state(config, layout, step)
    except FileNotFoundError as error:
        raise ConfigError([("RUN_DIR", str(error))]) from None
    params = state["params"]
    del state
    if adapters:
        trained = jax.tree.map(np.asarray, multihost_utils.process_allgather(layout.trained_part(params), tiled=True))
        base_name = Path(config.model.init_from).name if config.model.init_from else ""
        count = write_adapter(config, model_entries, trained, out, base_name)
        wait_for_every_process("adapter written")
        return Written(step, 1, count, "float32", ("a PEFT LoRA adapter: load it on its base with "
                                                   "peft.PeftModel.from_pretrained(base, DIR)",))
    if layout.trained is not None:  # the adapters' update merged into the weights they adapt
        scale = config.lora.alpha / config.lora.rank
        params = jax.jit(lambda params: merged_tree(params, scale))(params)

    name = SAFETENSORS_DTYPES[dtype]
    tensors = [(tensor, entry.hf_shape) for entry in model_entries for _, tensor in entry.names()]
    plan = file_plan(tensors, name, max_shard_gb * 1e9)
    file_names = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    where: dict[str, safetensors.Tensor] = {}
    for file_name, members in zip(file_names, plan):
        layout_of = {tensors[i][0]: (name, tensors[i][1]) for i in members}
        head, offsets = safetensors.header_bytes(layout_of, {"format": "pt"})
        for tensor, (_, shape) in layout_of.items():
            where[tensor] = safetensors.Tensor(out / file_name, safetensors.DTYPES[name], shape, len(head) + offsets[tensor])
        if jax.process_index() == 0:
            out.mkdir(parents=True, exist_ok=True)
            safetensors.create(out / file_name, layout_of, {"format": "pt"})
    wait_for_every_process("export files created")

    export_mesh = Mesh(np.asarray(jax.devices()), ("export",))
    for entry in model_entries:
        leaf = params
        for key in entry.path:
            leaf = leaf[int(key)] if isinstance(leaf, (list, tuple)) else leaf[key if key in leaf else int(key)]
        spread = jax.device_put(leaf, export_sharding(entry, leaf.shape, export_mesh))
        for shard in spread.addressable_shards:
            if shard.replica_id:
                continue
            box = box_of(shard.index, leaf.shape)
            stack, per_layer = box[:len(entry.stack)], box[len(entry.stack):]
            data = np.asarray(shard.data)
            hf_box, _ = entry.hf_box(per_layer, exact=True)
            for index in np.ndindex(*(stop - start for start, stop in stack)):
                tensor = where[entry.name(*(start + i for (start, _), i in zip(stack, index)))]
                values = entry.to_hf(data[index]).astype(tensor.dtype)
                safetensors.write_box(tensor.file, tensor, hf_box, values)
        del spread
    wait_for_every_process("export tensors written")
    if jax.process_index() == 0:
        total = sum(math.prod(shape) * safetensors.DTYPES[name].itemsize for _, shape in tensors)
        weight_map = {tensor: file_names[f] for f, members in enumerate(plan) for tensor in (tensors[i][0] for i in members)}
        (out / safetensors.INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                         "weight_map": weight_map}, indent=2) + "\n")
        _side_files(config, out, hf_config)
    return Written(step, len(plan), len(tensors), dtype, notes)
