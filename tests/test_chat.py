"""Chat and instruction data: `nestor data prepare` renders conversations with the checkpoint's chat template
into tokens and loss weights equal, token for token, to what transformers computed (reference_chat.json)."""

import json

import numpy as np
import pytest

from nestor.orchestrator.data.chat import ChatEncoder, template_text
from nestor.orchestrator.data.prepare import Options, prepare
from nestor.orchestrator.data.shards import TokenStream
from nestor.orchestrator.errors import ConfigError
from tests.test_separator import CHAT, END_OF_TEXT

REFERENCE = json.loads((CHAT / "reference_chat.json").read_text())
TOKENIZER = str(CHAT / "tokenizer.json")


def records(form: str) -> list[dict]:
    """The reference conversations (6) or prompt-completion pairs (3) as JSONL records."""
    if form == "messages":
        return [{"messages": c["messages"]} for c in REFERENCE["conversations"]]
    return [{"prompt": p["prompt"], "completion": p["completion"]} for p in REFERENCE["prompt_completion"]]


def expected(form: str) -> list[tuple[list[int], list[int]]]:
    if form == "messages":
        return [(c["input_ids"], c["assistant_masks"]) for c in REFERENCE["conversations"]]
    return [(p["input_ids"], p["completion_mask"]) for p in REFERENCE["prompt_completion"]]


def prepared(records_: list[dict], out, **options) -> TokenStream:
    (out.parent / f"{out.name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records_))
    prepare([str(out.parent / f"{out.name}.jsonl")], Options(tokenizer=TOKENIZER, out=out, **options),
            log=lambda line: None)
    return TokenStream([out], "train", "data.paths")


@pytest.mark.parametrize("form", ["messages", "prompt_completion"])
def test_prepared_weights_equal_transformers_masks_token_for_token(form, tmp_path):
    stream = prepared(records(form), tmp_path / form)
    assert stream.weighted and stream.separator == END_OF_TEXT
    starts = stream.document_starts()
    assert len(starts) - 1 == len(expected(form)) == {"messages": 6, "prompt_completion": 3}[form]
    for (ids, mask), start, stop in zip(expected(form), starts[:-1], starts[1:]):
        tokens, weights = stream.read(int(start), int(stop)), stream.read_weights(int(start), int(stop))
        np.testing.assert_array_equal(tokens, ids + [END_OF_TEXT])  # the "!" (id 0) inside stays text
        np.testing.assert_array_equal(weights, mask + [0])  # the separator is not trained
    metadata = json.loads((tmp_path / form / "metadata.json").read_text())
    assert metadata["loss_weights"] and metadata["end_of_turn"] == 414
    assert (tmp_path / form / "chat_template.jinja").read_text() == REFERENCE["chat_template"]


def test_plain_prompt_completion_trains_the_completion_and_its_end_of_text(tmp_path):
    stream = prepared([{"prompt": "Hello there!", "completion": " Hi!"}], tmp_path / "plain")
    tokens, weights = stream.read(0, stream.num_tokens), stream.read_weights(0, stream.num_tokens)
    np.testing.assert_array_equal(tokens, [291, 265, 353, 0, 220, 39, 72, 0, END_OF_TEXT])
    np.testing.assert_array_equal(weights, [0, 0, 0, 0, 1, 1, 1, 1, 1])


def test_a_named_template_renders_assistant_turns_for_a_tokenizer_without_one(tmp_path):
    encoder = ChatEncoder("bytes", template_text("bytes", "chatml"))
    encoded = encoder({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    text = bytes(encoded.ids.astype(np.uint8)).decode()
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    trained = bytes(encoded.ids[encoded.weights == 1].astype(np.uint8)).decode()
    assert trained == "yo<|im_end|>"
    with pytest.raises(ConfigError, match="--chat-template: the tokenizer bytes has no chat template"):
        template_text("bytes", None)


def test_a_line_that_is_not_chat_data_is_an_error_naming_it(tmp_path):
    lines = records("messages")[:1] + [{"text": "plain"}]
    with pytest.raises(ConfigError, match="SOURCE: a line of .* is not chat data"):
        prepared(lines, tmp_path / "mixed")


def test_a_chat_prompt_is_what_transformers_renders_with_the_generation_prompt():
    """`nestor sample --chat` decodes after these ids and stops at the end of turn (<|eot_id|>) or of text."""
    encoder = ChatEncoder(TOKENIZER, template_text(TOKENIZER, None))
    for pair in REFERENCE["prompt_completion"]:
        assert encoder.prompt(pair["prompt"]) == pair["prompt_ids"]
    assert encoder.end_of_turn() == 414
