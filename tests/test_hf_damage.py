"""Damaged Hugging Face checkpoints (`model.init_from`): every damage to a safetensors header or a config.json
field is one config error naming the file and what is wrong, in `explain` as in `train`; non-finite values
name their tensor; zeros where no trained model has them are warned of."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from nestor.orchestrator.commands.cli import main
from tests.test_hf import copy_of

TINY_RUN = ("train.steps=1", "train.global_batch=8", "train.seq_len=16", "cluster.devices_per_host=8",
            "cluster.launcher=inprocess", "metrics.tensorboard=false", "data.source=synthetic")


def read_header(path: Path) -> tuple[dict, bytes]:
    """Returns (the JSON header, the data after it) of a safetensors file."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + size]), data[8 + size:]


def write_header(path: Path, header, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def edit_header(path: Path, edit) -> None:
    header, data = read_header(path)
    write_header(path, edit(header), data)


def entry_edit(tensor: str, **changes):
    return lambda header: {**header, tensor: {**header[tensor], **changes}}


def without(tensor: str, field: str):
    return lambda header: {**header, tensor: {k: v for k, v in header[tensor].items() if k != field}}


def aliased(tensor: str, onto: str):
    return lambda header: {**header, tensor: {**header[tensor], "data_offsets": header[onto]["data_offsets"]}}


def nan_in(path: Path, tensor: str) -> None:
    header, data = read_header(path)
    start = header[tensor]["data_offsets"][0] + 4 * 5
    data = data[:start] + np.float32(np.nan).tobytes() + data[start + 4:]
    write_header(path, header, data)


def zeros_from(path: Path, fraction: float) -> None:
    """Zeroes the data of `path` past `fraction` of it: a download preallocated to its full size."""
    header, data = read_header(path)
    keep = int(len(data) * fraction)
    write_header(path, header, data[:keep] + bytes(len(data) - keep))


WEIGHTS = "model.safetensors"
HEADER_DAMAGES = {  # name -> (damage to llama3's model.safetensors, what the error says)
    "lm_head's offsets on embed_tokens' bytes": (
        lambda p: edit_header(p, aliased("lm_head.weight", "model.embed_tokens.weight")), "overlap"),
    "an int32 label on float bytes": (
        lambda p: edit_header(p, entry_edit("lm_head.weight", dtype="I32")), "has dtype I32, not a float type"),
    "a bool label on a norm weight": (
        lambda p: edit_header(p, entry_edit("model.norm.weight", dtype="BOOL")), "of BOOL makes it"),
    "an unknown dtype": (lambda p: edit_header(p, entry_edit("model.norm.weight", dtype="F7")), "'F7'"),
    "a list-shaped header": (lambda p: write_header(p, list(read_header(p)[0].items()), read_header(p)[1]),
                             "its header is a JSON list, not a mapping of tensors"),
    "an entry without data_offsets": (lambda p: edit_header(p, without("model.norm.weight", "data_offsets")),
                                      "not a mapping of dtype, shape and data_offsets"),
    "an entry that is a string": (lambda p: edit_header(p, lambda h: {**h, "model.norm.weight": "F32"}),
                                  "not a mapping of dtype, shape and data_offsets"),
    "a shape that disagrees with its bytes": (
        lambda p: edit_header(p, entry_edit("model.norm.weight", shape=[32])), "its shape [32] of F32 makes it 128"),
    "offsets past the end": (lambda p: edit_header(p, entry_edit("model.norm.weight", data_offsets=[10 ** 9, 10 ** 9 + 256])),
                             "truncated"),
    "reversed offsets": (lambda p: edit_header(p, entry_edit("model.norm.weight", data_offsets=[256, 0])),
                         "not [start, stop] with start <= stop"),
    "a truncated file": (lambda p: p.write_bytes(p.read_bytes()[:-1000]), "truncated"),
    "an empty file": (lambda p: p.write_bytes(b""), "shorter than its 8-byte header length"),
    "a header of bad bytes": (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{[" + bytes(100)),
                              "not a readable safetensors file"),
    "a NaN in a weight": (lambda p: nan_in(p, "model.layers.1.mlp.up_proj.weight"),
                          "tensor model.layers.1.mlp.up_proj.weight holds 1 NaN or infinite value"),
}


VALUE_DAMAGES = ("a NaN in a weight",)  # found as training reads the values; explain reads headers only


def explain_error(source: Path, tmp_path: Path, capsys, *overrides: str) -> tuple[int, str]:
    code = main(["explain", str(run_yaml(tmp_path)), f"model.init_from={source}", f"run.dir={tmp_path / 'run'}",
                 *TINY_RUN, *overrides])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def run_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  seed: 0\n")
    return path


def to_bfloat16(path: Path) -> None:
    """Rewrites every float32 tensor of `path` in bfloat16, as most published checkpoints hold them."""
    import ml_dtypes

    header, data = read_header(path)
    out, parts, offset = {}, [], 0
    for name, entry in header.items():
        if name == "__metadata__":
            out[name] = entry
            continue
        start, stop = entry["data_offsets"]
        parts.append(np.frombuffer(data[start:stop], np.float32).astype(ml_dtypes.bfloat16).tobytes())
        out[name] = {"dtype": "BF16", "shape": entry["shape"], "data_offsets": [offset, offset + len(parts[-1])]}
        offset += len(parts[-1])
    write_header(path, out, b"".join(parts))


def test_a_bfloat16_checkpoint_is_read(tmp_path, capsys):
    source = copy_of("llama3", tmp_path)
    to_bfloat16(source / WEIGHTS)
    code, out = explain_error(source, tmp_path, capsys)
    assert code == 0 and "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("damage", HEADER_DAMAGES)
def test_a_damaged_safetensors_file_is_one_config_error_in_explain_and_train(damage, tmp_path, capsys):
    source = copy_of("llama3", tmp_path)
    do, said = HEADER_DAMAGES[damage]
    do(source / WEIGHTS)
    for command in ("train",) if damage in VALUE_DAMAGES else ("explain", "train"):
        code = main([command, str(run_yaml(tmp_path)), f"model.init_from={source}", f"run.dir={tmp_path / command}",
                     *TINY_RUN])
        captured = capsys.readouterr()
        out = captured.out + captured.err
        assert code == 2 and "Traceback" not in out, (command, out[-3000:])
        assert "model.init_from" in out and said in out and str(source / WEIGHTS) in out, (command, out)


CONFIG_DAMAGES = {  # field -> (value, what the error says); None removes the field
    "architectures": (5, "architectures: 5 is not a list of class names"),
    "num_attention_heads": (None, "num_attention_heads: is missing"),
    "hidden_size": (None, "hidden_size: is missing"),
    "vocab_size": (0, "vocab_size: 0 is not a positive integer"),
    "head_dim": ("16", "head_dim: '16' is not a positive integer"),
    "rms_norm_eps": (-1, "rms_norm_eps: -1 is not a positive number"),
    "tie_word_embeddings": ("no", "tie_word_embeddings: 'no' is not true or false"),
    "rope_theta": ("abc", "rope_theta: 'abc' is not a positive number"),
    "rope_parameters": ("llama3", "rope_parameters: 'llama3' is not a mapping"),
    "layer_types": ("full_attention", "layer_types: 'full_attention' is not a list of names"),
}


@pytest.mark.parametrize("field", CONFIG_DAMAGES)
def test_a_damaged_config_json_field_is_a_config_error_naming_the_field_and_file(field, tmp_path, capsys):
    source = copy_of("llama3", tmp_path)
    config = json.loads((source / "config.json").read_text())
    value, said = CONFIG_DAMAGES[field]
    if value is None:
        del config[field]
    else:
        config[field] = value
    if field == "rope_theta":
        config["rope_parameters"] = {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}
    (source / "config.json").write_text(json.dumps(config))
    code, out = explain_error(source, tmp_path, capsys)
    assert code == 2 and "Traceback" not in out, out[-3000:]
    assert f"{source / 'config.json'}: {said}" in out, out


def test_zero_heads_without_head_dim_and_a_nested_rope_theta_name_their_field(tmp_path, capsys):
    source = copy_of("qwen3", tmp_path)
    config = json.loads((source / "config.json").read_text())
    config.pop("head_dim", None)
    (source / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    code, out = explain_error(source, tmp_path, capsys)
    assert code == 2 and "num_attention_heads: 0 is not a positive integer" in out, out
    source = copy_of("llama3", tmp_path / "second")
    config = json.loads((source / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = "abc"
    (source / "config.json").write_text(json.dumps(config))
    code, out = explain_error(source, tmp_path, capsys)
    assert code == 2 and "rope_parameters.rope_theta: 'abc' is not a positive number" in out, out


def test_a_download_in_progress_warns_of_its_zero_norm_weights_by_name(tmp_path, capsys):
    source = copy_of("llama3", tmp_path)
    zeros_from(source / WEIGHTS, 0.07)  # 93% zeros: every tensor past the embedding
    code = main(["train", str(run_yaml(tmp_path)), f"model.init_from={source}", f"run.dir={tmp_path / 'run'}",
                 *TINY_RUN])
    out = capsys.readouterr()
    warned = [line for line in (out.out + out.err).splitlines() if "all zeros" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: {source / WEIGHTS}: tensors "), out  # one line a file
    assert "model.layers.0.input_layernorm.weight" in warned[0] and "and 2 more are all zeros" in warned[0], warned
    assert code == 0  # a warning: a checkpoint may hold a zero norm on purpose


def test_a_nan_first_loss_of_a_fresh_import_names_the_checkpoint_not_the_learning_rate(tmp_path, capsys):
    source = copy_of("llama3", tmp_path)
    header, data = read_header(source / WEIGHTS)
    start, stop = header["model.norm.weight"]["data_offsets"]
    huge = np.full((stop - start) // 4, 3e38, np.float32).tobytes()  # finite, but the logits overflow
    write_header(source / WEIGHTS, header, data[:start] + huge + data[stop:])
    code = main(["train", str(run_yaml(tmp_path)), f"model.init_from={source}", f"run.dir={tmp_path / 'run'}",
                 *TINY_RUN])
    out = capsys.readouterr()
    said = out.out + out.err
    assert code == 1 and "Traceback" not in said, said[-3000:]
    assert f"computed on the weights of {source} before any update" in said and "optimizer.lr" not in said, said


@pytest.mark.parametrize("index, says", [
    ('{"weight_map": ["model.safetensors"]}', "its weight_map is not a mapping of tensor names"),
    ('{"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}', "its weight_map is not a mapping"),
    ('{"weight_map": {"lm_head.weight": 5}}', "its weight_map is not a mapping"),
    ("[1, 2", "has no readable weight_map"),
])
def test_a_broken_index_is_one_config_error_in_explain(tmp_path, capsys, index, says):
    source = copy_of("llama3", tmp_path)
    (source / "model.safetensors.index.json").write_text(index)
    code, out = explain_error(source, tmp_path, capsys)
    assert code == 2 and "Traceback" not in out and says in out, out


def test_explain_names_a_missing_surplus_or_misshapen_tensor(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    source = copy_of("llama3", tmp_path)
    tensors = load_file(source / WEIGHTS)
    for name, changed, says in (
            ("missing", {k: v for k, v in tensors.items() if k != "model.norm.weight"}, "lacks tensor model.norm.weight"),
            ("surplus", {**tensors, "model.extra.weight": tensors["model.norm.weight"]},
             "has no place for: model.extra.weight"),
            ("misshapen", {**tensors, "model.norm.weight": tensors["model.norm.weight"][:32]},
             "tensor model.norm.weight is [32], its config.json makes it [64]")):
        save_file(changed, source / WEIGHTS)
        code, out = explain_error(source, tmp_path, capsys)
        assert code == 2 and "Traceback" not in out and says in out, (name, out)
