"""data.source=tokens: windows of the prepared stream, each row read once by the process that holds it,
mixtures that keep their weights, the same training on any mesh, and config errors naming the key."""

import json
import re
import shutil

import numpy as np
import pytest

from nestor.orchestrator.data.batches import DataPipeline, make_source
from nestor.orchestrator.data.shards import METADATA, TokenStream
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import make_mesh
from nestor.orchestrator.loop.metrics import tensorboard_tag
from nestor.parallel.rules import resolve_rules
from tests.settings import ROOT
from tests.helpers import ONE_DEVICE, assert_same_training, mesh_overrides, prepared_stdlib, run_fresh


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two prepared directories of standard library sources (bytes): [a-c]*.py and [d-f]*.py."""
    root = tmp_path_factory.mktemp("shards")
    return prepared_stdlib(root / "abc", "[a-c]*.py"), prepared_stdlib(root / "def", "[d-f]*.py")


def stream_of(directory, split="train") -> np.ndarray:
    metadata = json.loads((directory / METADATA).read_text())
    return np.concatenate([np.fromfile(directory / f"{s['name']}.tokens", metadata["dtype"])
                           for s in metadata["splits"][split]["shards"]]).astype(np.int32)


def test_rows_are_windows_of_the_prepared_stream_and_each_is_read_once(tiny_config, shards):
    config = tiny_config("data.source=tokens", f"data.paths=[{shards[0]}]", "cluster.devices_per_host=4",
                         **mesh_overrides(fsdp=2, tensor=2))
    pipeline = DataPipeline(config, make_mesh(config), resolve_rules(config.mesh.rules))
    source, stream = pipeline.source, stream_of(shards[0])
    batch = np.asarray(pipeline.batch(5)["tokens"])
    width = config.train.seq_len + 1
    for row in range(16):
        window = source.sources[0].order(5 * 16 + row)
        np.testing.assert_array_equal(batch[row], stream[window * width:(window + 1) * width])
    reader = source.sources[0].stream
    assert reader.windows_read == 16  # 4 devices, rows replicated over tensor2: still each row read once
    for hosts in (2, 4, 8):  # a process reads only its rows, and any split assembles the same batch
        before = reader.windows_read
        share = 16 // hosts
        assembled = np.concatenate([source.rows(5, range(p * share, (p + 1) * share)) for p in range(hosts)])
        assert reader.windows_read - before == 16 and reader.tokens_read - before * width == 16 * width
        np.testing.assert_array_equal(assembled, batch)
    evaluation = make_source(config, split="eval")
    assert evaluation.sources[0].stream.num_tokens == len(stream_of(shards[0], "eval")) > 0


def test_host_splits_assemble_the_same_batches_across_epochs(tiny_config, tmp_path):
    """93 windows, 16 rows a step: steps 5, 11 and 17 straddle an epoch. Two and four hosts, each with
    its own source read in its own order, assemble the sharded batch of one process at every step, and
    every epoch reads each window once, in a new order."""
    small = prepared_stdlib(tmp_path / "small", "[ks]e[yc]*.py")  # keyword.py, secrets.py: 3,091 tokens
    config = tiny_config("data.source=tokens", f"data.paths=[{small}]", "cluster.devices_per_host=8",
                         **mesh_overrides(data=2, fsdp=2, tensor=2))
    pipeline = DataPipeline(config, make_mesh(config), resolve_rules(config.mesh.rules))
    order, stream, width = pipeline.source.sources[0].order, stream_of(small), config.train.seq_len + 1
    assert order.num_windows == 93
    for hosts in (2, 4):
        sources, share = [make_source(config) for _ in range(hosts)], 16 // hosts
        for step in range(18):  # 288 rows: three epochs and a bit
            parts = {p: sources[p].rows(step, range(p * share, (p + 1) * share)) for p in reversed(range(hosts))}
            np.testing.assert_array_equal(np.concatenate([parts[p] for p in range(hosts)]),
                                          np.asarray(pipeline.batch(step)["tokens"]), err_msg=f"{hosts} hosts, step {step}")
    epochs = [[order(epoch * 93 + within) for within in range(93)] for epoch in range(3)]
    assert all(sorted(windows) == list(range(93)) for windows in epochs) and epochs[0] != epochs[1] != epochs[2]
    rows = np.asarray(pipeline.batch(5)["tokens"])  # positions 80..95: rows 13.. open epoch 1
    for row, window in ((12, epochs[0][92]), (13, epochs[1][0]), (15, epochs[1][2])):
        np.testing.assert_array_equal(rows[row], stream[window * width:(window + 1) * width])


def test_mixture_shares_are_within_2_percent_of_the_weights_and_follow_the_seed(tiny_config, shards):
    mixture = f"data.mixture=[{{paths: {shards[0]}, weight: 3}}, {{paths: [{shards[1]}], weight: 1.5}}, " \
              f"{{paths: [{shards[0]}, {shards[1]}], weight: 0.5}}]"
    source = make_source(tiny_config("data.source=tokens", mixture))
    shares = np.array([list(source.shares(step).values()) for step in range(200)]).mean(axis=0)
    np.testing.assert_allclose(shares, [0.6, 0.3, 0.1], atol=0.02)
    again = make_source(tiny_config("data.source=tokens", mixture))
    reseeded = make_source(tiny_config("data.source=tokens", mixture, "run.seed=1"))
    for step in (0, 7, 199):
        np.testing.assert_array_equal(again.rows(step, range(16)), source.rows(step, range(16)))
        assert not np.array_equal(reseeded.rows(step, range(16)), source.rows(step, range(16)))


def test_bad_shards_and_mixtures_are_config_errors_naming_the_key(tiny_config, shards, tmp_path, corpus_tokenizer):
    def problem(*overrides):
        with pytest.raises(ConfigError) as caught:
            make_source(tiny_config("data.source=tokens", *overrides))
        return caught.value.problems[0]

    assert problem(f"data.paths=[{shards[0]}]", f"data.tokenizer={corpus_tokenizer}")[0] == "data.tokenizer"
    other = prepared_stdlib(tmp_path / "words", "[a-b]*.py", tokenizer=str(corpus_tokenizer))
    assert problem(f"data.paths=[{shards[0]}, {other}]")[0] == "data.paths"
    assert problem(f"data.paths=[{shards[0]}]", "model.vocab_size=200")[0] == "model.vocab_size"
    assert problem(f"data.paths=[{tmp_path / 'absent'}]")[0] == "data.paths"
    broken = shutil.copytree(shards[1], tmp_path / "broken")
    next(broken.glob("train-*.tokens")).unlink()
    key, message = problem(f"data.mixture=[{{paths: {shards[0]}, weight: 1}}, {{paths: {broken}, weight: 1}}]")
    assert key == "data.mixture[1].paths" and "is missing" in message
    assert problem(f"data.mixture=[{{paths: {shards[0]}, weight: 0}}]") == (
        "data.mixture[0].weight", "must be a number > 0, got 0")
    assert problem(f"data.mixture=[{{paths: {shards[0]}, weight: -1}}]")[0] == "data.mixture[0].weight"
    assert problem(f"data.mixture=[{{paths: {shards[0]}}}]")[0] == "data.mixture[0].weight"
    assert problem()[0] == "data.paths"
    with pytest.raises(ConfigError, match="data.mixture: mixes prepared token shards"):
        tiny_config(f"data.mixture=[{{paths: {shards[0]}, weight: 1}}]")


@pytest.fixture
def corpus_tokenizer(tmp_path):
    """A word-level tokenizers JSON (its fingerprint differs from bytes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["def class import return"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tokenizer.save(str(tmp_path / "words.json"))
    return tmp_path / "words.json"


@pytest.mark.slow
def test_training_on_a_mixture_matches_one_device_and_its_tags_are_documented(tiny_config, shards):
    mixture = f"data.mixture=[{{paths: {shards[0]}, weight: 2}}, {{paths: {shards[1]}, weight: 1}}]"
    config = tiny_config("data.source=tokens", mixture, "train.steps=3")
    reference = run_fresh(config.replace(**ONE_DEVICE))
    sharded = run_fresh(config.replace(**mesh_overrides(data=2, fsdp=2, tensor=2)))
    assert_same_training(sharded, reference)
    shares = [[record[f"data_share_{i}"] for i in range(2)] for record in reference.history]
    assert len(shares) == 3 and all(sum(row) == pytest.approx(1.0) for row in shares)
    data_names = {key for record in reference.history for key in record if key.startswith("data_")}
    assert data_names == {"data_share_0", "data_share_1"}
    docs = (ROOT / "docs/monitoring.md").read_text()
    for name in data_names | {tensorboard_tag(name) for name in data_names}:  # the tags the writer files them under
        assert f"`{re.sub(r'_[0-9]+$', '_<i>', name)}`" in docs, name


def test_mixture_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    from nestor.orchestrator.loader.config import load

    monkeypatch.chdir(tmp_path)
    config = load(None, ["data.source=tokens", "data.mixture=[{paths: shards/a, weight: 1}, {paths: [/b, c], weight: 2}]"])
    assert [entry["paths"] for entry in config.data.mixture] == [[str(tmp_path / "shards/a")], ["/b", str(tmp_path / "c")]]


def _damaged(shards, tmp_path) -> dict[str, tuple[str, str]]:
    """Returns copies of a prepared directory, each damaged as issue 41 found them, by name: (the file the error
    must name, what it must say)."""
    def copy(name):
        return shutil.copytree(shards[0], tmp_path / name)

    def train_shard(directory, suffix):
        return directory / f"{json.loads((directory / METADATA).read_text())['splits']['train']['shards'][0]['name']}{suffix}"

    cases = {}
    for name, text, says in (("garbage", "{not json", "is not JSON"), ("list", "[1, 2]", "is format 'list'")):
        (copy(name) / METADATA).write_text(text)
        cases[name] = (str(tmp_path / name / METADATA), says)
    metadata = json.loads((shards[0] / METADATA).read_text())
    (copy("no_splits") / METADATA).write_text(json.dumps({k: v for k, v in metadata.items() if k != "splits"}))
    cases["no_splits"] = (str(tmp_path / "no_splits" / METADATA), "lists no train split of shards")
    tokens = train_shard(copy("past_vocabulary"), ".tokens")
    ids = np.fromfile(tokens, np.uint16)
    ids[100] = 300  # bytes: 256 ids
    ids.tofile(tokens)
    cases["past_vocabulary"] = (str(tokens), "holds token id 300, outside its tokenizer's 256 ids")
    tokens = train_shard(copy("random_bytes"), ".tokens")
    tokens.write_bytes(np.random.default_rng(0).bytes(tokens.stat().st_size))
    cases["random_bytes"] = (tokens.name, "does not index the documents")  # caught at open, before any read
    index = train_shard(copy("truncated_index"), ".documents")
    index.write_bytes(index.read_bytes()[:-8])
    cases["truncated_index"] = (str(index), "not the")
    index = train_shard(copy("shifted_index"), ".documents")
    starts = np.fromfile(index, np.int64)
    starts[1:-1] += 1  # the right size, but every document ends one token late
    starts.tofile(index)
    cases["shifted_index"] = (str(index), "does not index the documents")
    return cases


def test_damaged_directories_are_config_errors_naming_the_file(shards, tmp_path):
    """Issue 41: metadata.json that is not JSON, a list or without splits was a traceback; ids past the
    vocabulary or random bytes trained to NaN at step 1; a truncated .documents trained silently. A corpus may
    be terabytes: opening reads the index and one token per document, and ids are checked as read."""
    for name, (file, says) in _damaged(shards, tmp_path).items():
        with pytest.raises(ConfigError) as caught:
            stream = TokenStream([tmp_path / name], "train", "data.paths")  # opened, checked without reading ids
            stream.read(0, stream.num_tokens)  # ids are checked as they are read: no batch past the vocabulary
        [(key, message)] = caught.value.problems
        assert key == "data.paths" and file in message and says in message, (name, message)
