"""`nestor data prepare`: JSONL and Parquet round-trip through the tokenizer; an interrupted prepare resumes
to identical shards; inputs that do not fit are errors naming the option."""

import json
import random

import numpy as np
import pytest

from nestor.orchestrator.data import prepare as prepare_module
from nestor.orchestrator.data.prepare import Options, held_out_by_hash, prepare
from nestor.orchestrator.data.shards import LEGACY_SEPARATOR as DOCUMENT_SEPARATOR, METADATA, documents_of
from nestor.orchestrator.errors import ConfigError

WORDS = "the cat sat on a mat while dogs ran far away into the quiet night and came home".split()


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 400))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A 2.4 MB JSONL file and a 1.2 MB Parquet file of word salad, and a word-level tokenizers JSON."""
    import pyarrow as pa
    import pyarrow.parquet as parquet
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("corpus")
    jsonl, table = texts(2000, 0), texts(1000, 1)
    with (directory / "a.jsonl").open("w") as f:
        for i, text in enumerate(jsonl):
            f.write(json.dumps({"id": i, "body": text}) + "\n")
    parquet.write_table(pa.table({"body": table}), directory / "b.parquet", row_group_size=150)
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(WORDS, trainers.WordLevelTrainer(special_tokens=["[SEP]", "[UNK]"]))
    tokenizer.save(str(directory / "words.json"))
    return directory, jsonl + table, tokenizer


def options(corpus, out, **changes) -> Options:
    directory = corpus[0]
    return Options(**{"tokenizer": str(directory / "words.json"), "out": out, "eval_fraction": 0.1,
                      "text_field": "body", "parquet_column": "body", "shard_mb": 0.5, **changes})


def sources(corpus) -> list[str]:
    return [str(corpus[0] / "a.jsonl"), str(corpus[0] / "b.parquet")]


def split_documents(out, split: str) -> list[np.ndarray]:
    """Returns every document of `split` in order, read back through the document indexes."""
    metadata = json.loads((out / METADATA).read_text())
    found = []
    for shard in metadata["splits"][split]["shards"]:
        tokens = np.fromfile(out / f"{shard['name']}.tokens", metadata["dtype"])
        starts = documents_of(out, shard["name"])
        assert len(starts) == shard["documents"] + 1 and starts[-1] == len(tokens) == shard["tokens"]
        assert np.all(tokens[starts[1:] - 1] == DOCUMENT_SEPARATOR)  # every document ends with the separator
        found += [tokens[start:stop - 1] for start, stop in zip(starts[:-1], starts[1:])]
    return found


@pytest.mark.slow
def test_jsonl_and_parquet_round_trip_through_the_tokenizer(corpus, tmp_path):
    metadata = prepare(sources(corpus), options(corpus, tmp_path / "out", workers=2), log=lambda line: None)
    _, documents, tokenizer = corpus
    assert metadata["tokenizer"]["vocab_size"] == tokenizer.get_vocab_size() and metadata["dtype"] == "uint16"
    held_out = [held_out_by_hash(text, 0.1) for text in documents]
    for split, wanted in (("train", [not h for h in held_out]), ("eval", held_out)):
        expected = [tokenizer.encode(text).ids for text, keep in zip(documents, wanted) if keep]
        found = split_documents(tmp_path / "out", split)
        assert len(found) == len(expected) == metadata["splits"][split]["documents"]
        assert all(np.array_equal(f, e) for f, e in zip(found, expected))
        assert metadata["splits"][split]["tokens"] == sum(len(e) + 1 for e in expected)
    assert abs(sum(held_out) / len(documents) - 0.1) < 0.02
    assert len(metadata["splits"]["train"]["shards"]) >= 4  # the JSONL cut at lines, the row groups grouped


def shard_files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".tokens", ".documents", ".json")}


def test_an_interrupted_prepare_resumes_to_identical_shards(corpus, tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    prepare(sources(corpus), options(corpus, reference), log=lambda line: None)

    out = tmp_path / "interrupted"
    finished = []
    real = prepare_module.prepare_unit

    def interrupted_after_two(index, unit, opts):
        if len(finished) == 2:
            (out / "train-00002.tokens.tmp").write_bytes(b"half a shard")  # cut off mid-write
            raise KeyboardInterrupt
        finished.append(real(index, unit, opts))
        return finished[-1]

    monkeypatch.setattr(prepare_module, "prepare_unit", interrupted_after_two)
    with pytest.raises(KeyboardInterrupt):
        prepare(sources(corpus), options(corpus, out), log=lambda line: None)
    monkeypatch.undo()
    assert not (out / METADATA).exists()
    kept = {name: (out / name).stat().st_mtime_ns for name in ("train-00000.tokens", "eval-00001.documents")}

    said = []
    prepare(sources(corpus), options(corpus, out), log=said.append)
    assert said[0].startswith("resuming: 2 of ")
    assert shard_files(out) == shard_files(reference)
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept  # finished shards were not redone

    with pytest.raises(ConfigError, match="--out: .* holds a prepare of other eval_fraction"):
        prepare(sources(corpus), options(corpus, out, eval_fraction=0.2), log=lambda line: None)


@pytest.mark.parametrize("change, key", [
    (dict(text_field="text"), "--text-field"), (dict(parquet_column="text"), "--parquet-column"),
    (dict(tokenizer="absent.json"), "--tokenizer")])
def test_inputs_that_do_not_fit_are_errors_naming_the_option(corpus, tmp_path, change, key):
    files = sources(corpus)[1:] if key == "--parquet-column" else sources(corpus)[:1]
    with pytest.raises(ConfigError) as caught:
        prepare(files, options(corpus, tmp_path / "out", **change), log=lambda line: None)
    assert caught.value.problems[0][0] == key
    with pytest.raises(ConfigError, match="SOURCE: .*none.jsonl names no file"):
        prepare([str(tmp_path / "none.jsonl")], options(corpus, tmp_path / "out"), log=lambda line: None)


def test_the_printed_hint_is_a_train_command_that_loads(corpus, tmp_path, monkeypatch, capsys):
    # It printed the overrides with "(or more)" after them, which a shell refuses once pasted, and the
    # tokenizer's own vocabulary (19 ids here), which the quickstart's tensor2 mesh cannot split; then a
    # model.vocab_size, which conflicts with a checkpoint's (model.init_from).
    import shlex

    from nestor.orchestrator.commands.cli import main
    from nestor.orchestrator.loader.config import load
    from tests.settings import ROOT

    monkeypatch.chdir(tmp_path)
    assert main(["data", "prepare", *sources(corpus), "--tokenizer", str(corpus[0] / "words.json"),
                 "--out", "runs/words", "--text-field", "body", "--parquet-column", "body"]) == 0
    printed = capsys.readouterr().out.splitlines()
    [hint] = [line for line in printed if line.startswith("train on it: ")]
    nestor, train, config, *overrides = shlex.split(hint.removeprefix("train on it: "))
    assert (nestor, train, config) == ("nestor", "train", "CONFIG")
    loaded = load(ROOT / "configs/quickstart.yaml", overrides)  # the user's config in place of CONFIG
    ids = json.loads((tmp_path / "runs" / "words" / METADATA).read_text())["tokenizer"]["vocab_size"]
    assert loaded.data.paths == (str(tmp_path / "runs" / "words"),) and loaded.model.vocab_size == 256  # base's
    assert printed[-1] == f"(model.vocab_size: the run grows it to hold the tokenizer's {ids} ids, rounded up to 128 " \
                          "(a multiple of 128, so that any mesh splits it), unless its config or its model.init_from " \
                          "checkpoint sets it)"
    checkpoint = ROOT.parent / "shared" / "fixtures" / "hf" / "llama3"  # its config.json: vocab_size 512
    assert load(ROOT / "configs/finetune.yaml", [*overrides, f"model.init_from={checkpoint}"]).model.vocab_size == 512


def test_an_eval_source_leaves_no_empty_shard_in_either_split(corpus, tmp_path):
    # Each unit wrote a shard per split, so a held-out file's units left empty train shards, listed and
    # counted ("2 shards" for one), and the training files' units empty eval shards.
    out = tmp_path / "prepared"
    metadata = prepare([sources(corpus)[0]], options(corpus, out, eval_fraction=0.0), [sources(corpus)[1]],
                       log=lambda line: None)
    for split in ("train", "eval"):
        shards = metadata["splits"][split]["shards"]
        assert shards and all(shard["documents"] and shard["tokens"] for shard in shards)
    listed = {shard["name"] for split in ("train", "eval") for shard in metadata["splits"][split]["shards"]}
    assert {path.stem for path in out.glob("*.tokens")} == listed
    assert len(split_documents(out, "eval")) == 1000 and len(split_documents(out, "train")) == 2000


def test_binary_inputs_are_skipped_and_listed_and_a_late_nul_is_an_error(tmp_path, monkeypatch, capsys):
    from nestor.orchestrator.commands.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "src" / "__pycache__").mkdir(parents=True)
    (tmp_path / "src" / "a.py").write_text("print('hello')\n" * 50)
    (tmp_path / "src" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\x00\x01binary" * 10)
    assert main(["data", "prepare", "src", "--tokenizer", "bytes", "--out", "out"]) == 0
    printed = capsys.readouterr().out
    assert "skipped 1 binary input(s) (a NUL byte; not text): src/__pycache__/a.cpython-311.pyc" in printed
    assert json.loads((tmp_path / "out" / METADATA).read_text())["splits"]["train"]["documents"] == 1
    (tmp_path / "src" / "late.txt").write_bytes(b"x" * 10_000 + b"\x00")  # past the probe
    assert main(["data", "prepare", "src", "--tokenizer", "bytes", "--out", "out2"]) == 2
    assert "src/late.txt is not text: a NUL byte at offset 10000" in capsys.readouterr().err


@pytest.mark.slow
def test_training_and_sampling_on_prepared_shards_use_their_tokenizer(corpus, tmp_path, monkeypatch, capsys):
    """Shards prepared with a word-level tokenizer: no data.tokenizer key, and the run's config.yaml, its
    vocabulary and `nestor sample` take that tokenizer; naming another is refused."""
    import yaml

    from nestor.orchestrator.commands.cli import main

    monkeypatch.chdir(tmp_path)
    tokenizer = str(corpus[0] / "words.json")
    assert main(["data", "prepare", str(corpus[0] / "a.jsonl"), "--tokenizer", tokenizer, "--out", "words",
                 "--text-field", "body", "--eval-fraction", "0.1"]) == 0
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "run": {"dir": "run"}, "model": {"preset": "tiny", "vocab_size": 128},
        "data": {"source": "tokens", "paths": ["words"]},
        "train": {"steps": 2, "seq_len": 16, "global_batch": 8},
        "cluster": {"launcher": "inprocess", "devices_per_host": 8}}))  # the suite's 8 devices
    assert main(["train", "run.yaml"]) == 0
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]["tokenizer"] == tokenizer
    capsys.readouterr()
    assert main(["sample", "run.yaml", "--prompt", "the cat", "--max-tokens", "4"]) == 0
    sampled = capsys.readouterr().out.strip().splitlines()[-1]
    assert sampled.startswith("the cat") and set(sampled.split()) <= set(WORDS) | {"[UNK]", "[SEP]"}, sampled
    assert main(["train", "run.yaml", "data.tokenizer=bytes", "run.dir=other"]) == 2
    assert "data.tokenizer" in capsys.readouterr().err
