"""data.separator: the tokenizer's end of text separates documents (not id 0, which is `!` for Llama 3), shards
record theirs, and shards of before it still read with id 0."""

import json
import shutil

import numpy as np
import pytest

from nestor.orchestrator.data.batches import DataPipeline, run_separator
from nestor.orchestrator.data.prepare import Options, prepare
from nestor.orchestrator.data.separator import end_of_text, resolve_separator
from nestor.orchestrator.data.shards import METADATA, TokenStream
from nestor.orchestrator.data.tokenizer import open_tokenizer
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.build import make_mesh
from nestor.parallel.rules import resolve_rules
from tests.settings import ROOT
from tests.helpers import prepared_stdlib

CHAT = ROOT.parent / "shared" / "fixtures" / "hf" / "llama3-chat"
END_OF_TEXT = 411  # <|end_of_text|>, tokenizer_config.json's eos_token
EXCLAMATION = 0  # `!`, as in Llama 3


def test_eos_is_the_tokenizers_end_of_text_and_bytes_keep_zero(tmp_path):
    assert end_of_text(str(CHAT / "tokenizer.json")) == END_OF_TEXT
    assert open_tokenizer(str(CHAT / "tokenizer.json")).encode("!") == [EXCLAMATION]
    assert end_of_text("bytes") == end_of_text(None) == 0
    assert resolve_separator(7, str(CHAT / "tokenizer.json")) == 7
    alone = tmp_path / "alone"  # a tokenizer trained for the run, no checkpoint files beside it: id 0
    alone.mkdir()
    shutil.copy(CHAT / "tokenizer.json", alone)
    assert end_of_text(str(alone / "tokenizer.json")) == 0
    (alone / "config.json").write_text("{}")  # a checkpoint's files that name no end of text: say so
    with pytest.raises(ConfigError, match="data.separator: no end-of-text token"):
        end_of_text(str(alone / "tokenizer.json"))
    (alone / "generation_config.json").write_text(json.dumps({"eos_token_id": [414, 411]}))
    assert end_of_text(str(alone / "tokenizer.json")) == 414
    with pytest.raises(ConfigError, match="data.separator: must be a token id or eos"):
        resolve_separator("end", None)


def test_a_document_with_exclamation_marks_stays_one_document(tiny_config, tmp_path):
    """Prepared with llama3-chat's tokenizer, "Hello there!" ends no document: the segment ids change only
    after the end-of-text token the shards were written with."""
    texts = ["Hello there! Answer briefly!", "The mesh has axes! Why?"] * 8
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    metadata = prepare([str(tmp_path / "docs.jsonl")], Options(tokenizer=str(CHAT / "tokenizer.json"),
                                                                out=tmp_path / "shards"), log=lambda line: None)
    assert metadata["separator"] == END_OF_TEXT
    config = tiny_config("data.source=tokens", f"data.paths=[{tmp_path / 'shards'}]", "train.seq_len=32",
                         "train.global_batch=8")
    assert run_separator(config) == END_OF_TEXT
    pipeline = DataPipeline(config, make_mesh(config), resolve_rules(config.mesh.rules))
    assert pipeline.source.separator == END_OF_TEXT
    batch = pipeline.batch(0)
    tokens, segments = np.asarray(batch["tokens"])[:, :-1], np.asarray(batch["segment_ids"])
    assert np.any(tokens == EXCLAMATION)
    opened = np.diff(segments, axis=1) != 0  # a new segment opens exactly where the end of text is
    np.testing.assert_array_equal(opened, tokens[:, 1:] == END_OF_TEXT)
    with pytest.raises(ConfigError, match="data.separator: 0, but .* was prepared with separator 411"):
        DataPipeline(config.replace(**{"data.separator": 0}), make_mesh(config), resolve_rules(config.mesh.rules))


def test_shards_of_before_the_separator_read_with_id_zero(tiny_config, tmp_path):
    directory = prepared_stdlib(tmp_path / "old", "[k]e*.py")
    metadata = json.loads((directory / METADATA).read_text())
    assert metadata["separator"] == 0
    del metadata["separator"]  # as nestor wrote metadata.json before data.separator
    (directory / METADATA).write_text(json.dumps(metadata))
    stream = TokenStream([directory], "train", "data.paths")
    assert stream.separator == 0 and not stream.weighted
    config = tiny_config("data.source=tokens", f"data.paths=[{directory}]")
    assert run_separator(config) == 0
    batch = DataPipeline(config, make_mesh(config), resolve_rules(config.mesh.rules)).batch(0)
    tokens = np.asarray(batch["tokens"])[:, :-1]
    np.testing.assert_array_equal(np.asarray(batch["segment_ids"]), np.cumsum(tokens == 0, axis=1))


@pytest.mark.parametrize("tokenizer", ["llama3-chat", "bytes"])
def test_an_export_names_the_ids_training_separated_documents_with(tokenizer, tmp_path, capsys):
    """llama3-chat's run exports its tokenizer, chat template and eos [end of turn, end of text]; a bytes run
    exports bos = eos = 0 and says in one line that it ships no tokenizer."""
    from nestor.orchestrator.commands.hf_export import export
    from nestor.orchestrator.hf.load import keep_source_files
    from nestor.orchestrator.loader.config import load
    from tests.test_hf import saved_at_step_0

    source = CHAT if tokenizer == "llama3-chat" else CHAT.parent / "llama3"
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "Hello there!"}) + "\n")
    prepare([str(tmp_path / "docs.jsonl")], Options(tokenizer=str(CHAT / "tokenizer.json") if tokenizer != "bytes"
                                                    else "bytes", out=tmp_path / "shards"), log=lambda line: None)
    config = load(None, [f"model.init_from={source}", f"run.dir={tmp_path / 'run'}", "data.source=tokens",
                         f"data.paths=[{tmp_path / 'shards'}]", "cluster.devices_per_host=1"])
    saved_at_step_0(config)
    keep_source_files(config)
    written = export(config, tmp_path / "out")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    if tokenizer == "bytes":
        assert (hf["bos_token_id"], hf["eos_token_id"]) == (0, 0) == (generation["bos_token_id"],
                                                                      generation["eos_token_id"])
        assert len(written.notes) == 1 and "no tokenizer exported" in written.notes[0]
        assert not (tmp_path / "out" / "tokenizer.json").exists()
    else:
        assert hf["bos_token_id"] == 410 and hf["eos_token_id"] == generation["eos_token_id"] == [414, END_OF_TEXT]
        assert written.notes == ()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            assert (tmp_path / "out" / name).read_bytes() == (CHAT / name).read_bytes()
