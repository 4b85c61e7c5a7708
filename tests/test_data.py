"""Data: the same global batches on any mesh and host count; the text source reads the real files."""

import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from nestor.orchestrator.data.batches import DataPipeline, TextSource
from nestor.orchestrator.data.separator import BYTES_SEPARATOR as DOCUMENT_SEPARATOR
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import make_mesh
from nestor.parallel.rules import resolve_rules
from tests.helpers import mesh_overrides


def pipeline(config) -> DataPipeline:
    mesh = make_mesh(config)
    return DataPipeline(config, mesh, resolve_rules(config.mesh.rules))


@pytest.mark.parametrize("source", ["synthetic", "text"])
def test_global_batches_do_not_depend_on_mesh_or_host_count(tiny_config, source):
    one = tiny_config(f"data.source={source}").replace(**mesh_overrides(data=8))
    other = tiny_config(f"data.source={source}", "cluster.devices_per_host=4").replace(
        **mesh_overrides(fsdp=2, tensor=2))
    a, b = pipeline(one), pipeline(other)
    for step in (0, 3, 1000):
        batch = np.asarray(a.batch(step)["tokens"])
        np.testing.assert_array_equal(np.asarray(b.batch(step)["tokens"]), batch)  # 4 devices, fsdp2 x tensor2
        for hosts in (1, 2, 4, 8):  # each simulated host builds only its rows
            share = 16 // hosts  # rows are addressed by index alone, so any split into hosts assembles the same batch
            assembled = np.concatenate([b.source.rows(step, range(p * share, (p + 1) * share)) for p in range(hosts)])
            np.testing.assert_array_equal(assembled, batch)
        assert batch.shape == (16, 33) and batch.dtype == np.int32
    assert not np.array_equal(np.asarray(a.batch(1)["tokens"]), np.asarray(a.batch(2)["tokens"]))


def test_text_rows_are_real_bytes_of_the_sorted_stdlib_sources(tiny_config):
    source = TextSource(tiny_config("data.source=text"))
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    assert source.files == stdlib
    corpus = b"".join(f.read_bytes() + bytes([DOCUMENT_SEPARATOR]) for f in stdlib)
    assert int(source.starts[-1]) == len(corpus)
    rows = source.rows(7, range(16))
    for row in range(16):
        window = source.window_index(7, row)
        expected = np.frombuffer(corpus[window * 33:(window + 1) * 33], np.uint8)
        np.testing.assert_array_equal(rows[row], expected)
    # One epoch visits every window once: the order is a permutation.
    order = [source.window_index(step, row) for step in range(source.order.num_windows // 16) for row in range(16)]
    assert len(set(order)) == len(order)


def test_iterator_state_round_trips_and_text_order_depends_on_seed(tiny_config):
    a = pipeline(tiny_config("data.source=text"))
    a.batch(0), a.batch(1)
    b = pipeline(tiny_config("data.source=text"))
    b.restore(a.state(), log=pytest.fail)
    assert b.next_step == 2
    reseeded = pipeline(tiny_config("data.source=text", "run.seed=1"))
    assert not np.array_equal(np.asarray(a.batch(2)["tokens"]), np.asarray(reseeded.batch(2)["tokens"]))


def test_missing_text_or_tokenizer_is_a_config_error(tiny_config, tmp_path):
    with pytest.raises(ConfigError, match="data.paths"):
        TextSource(tiny_config("data.source=text", f"data.paths=[{tmp_path}/*.none]"))
    with pytest.raises(ConfigError, match="data.tokenizer"):
        TextSource(tiny_config("data.source=text", f"data.tokenizer={tmp_path}/absent.json"))


def test_a_tokenizer_that_does_not_parse_and_a_binary_data_file_are_config_errors(tiny_config, tmp_path):
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "truncated.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vo')
    (tmp_path / "doc.txt").write_text("text " * 100)
    for name in ("empty.json", "truncated.json"):
        with pytest.raises(ConfigError, match=f"data.tokenizer: .*{name} does not load as a tokenizers JSON"):
            TextSource(tiny_config("data.source=text", f"data.paths=['{tmp_path}/*.txt']",
                                   f"data.tokenizer={tmp_path / name}"))
    (tmp_path / "program.txt").write_bytes(Path(sys.executable).read_bytes()[:20000])
    with pytest.raises(ConfigError, match=r"data.paths: .*program.txt is not text \(a NUL byte at offset \d+"):
        TextSource(tiny_config("data.source=text", f"data.paths=['{tmp_path}/*.txt']"))
    (tmp_path / "program.txt").unlink()
    (tmp_path / "late.txt").write_bytes(b"text " * 2**22 + b"\0")  # 20 MiB of text first (issue 41: trained on it)
    with pytest.raises(ConfigError, match=r"data.paths: .*late.txt is not text \(a NUL byte at offset 20971520;"):
        TextSource(tiny_config("data.source=text", f"data.paths=['{tmp_path}/*.txt']"))


def test_a_tokenizers_json_file_tokenizes_the_text_source(tiny_config, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    documents = ["the cat sat on the mat " * 40, "a dog sat on a log " * 40]
    for i, text in enumerate(documents):
        (tmp_path / f"doc{i}.txt").write_text(text)
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(documents, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))

    config = tiny_config("data.source=text", f"data.paths=['{tmp_path}/*.txt']", f"data.tokenizer={path}")
    source = TextSource(config)
    corpus = np.concatenate([np.append(tokenizer.encode(text).ids, DOCUMENT_SEPARATOR) for text in documents])
    assert int(source.starts[-1]) == len(corpus) == 2 + sum(len(t.split()) for t in documents)
    rows = source.rows(0, range(4))
    for row in range(4):
        window = source.window_index(0, row)
        np.testing.assert_array_equal(rows[row], corpus[window * 33:(window + 1) * 33])

    with pytest.raises(ConfigError) as caught:
        TextSource(config.replace(**{"model.vocab_size": 4}))
    assert caught.value.problems[0][0] == "model.vocab_size"
