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


def test_sample_chat_answers_up_to_the_end_of_turn_and_a_prompt_runs_to_the_end_of_text(tmp_path):
    """A template whose assistant turns end with "!" (id 0), and a checkpoint whose logits are all 0, so that
    greedy decoding says "!" (id 0) every time: `--chat` answers nothing (the turn ends at once, the shards'
    template read back), `--prompt` continues past it to --max-tokens, as plain text ends only at the separator."""
    from nestor.orchestrator.checkpoint.owner import Checkpointer
    from nestor.orchestrator.evaluation.commands import chat_checkpoint, sample_checkpoint
    from nestor.orchestrator.job.build import build_job
    from nestor.orchestrator.job.state import init_state
    from nestor.orchestrator.loader.config import load

    template = tmp_path / "exclaim.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
                        "{{ m['content'] }}!{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    assert ChatEncoder(TOKENIZER, template.read_text()).end_of_turn() == 0
    prepared(records("messages"), tmp_path / "chat", chat_template=str(template))
    config = load(None, [f"model.init_from={CHAT}", f"run.dir={tmp_path / 'run'}", "data.source=tokens",
                         f"data.paths=[{tmp_path / 'chat'}]", "cluster.devices_per_host=1"])
    layout = build_job(config, with_data=False).layout
    state = init_state(config, layout)
    state["params"]["final_norm"]["scale"] = state["params"]["final_norm"]["scale"] * 0  # every logit 0: id 0
    saver = Checkpointer(config, layout, log=lambda *_: None)
    saver.save(0, state, {"next_step": 0}, force=True)
    saver.close()
    assert chat_checkpoint(config, "Hello there", max_tokens=4) == ""
    assert sample_checkpoint(config, "Hello", max_tokens=4) == "Hello!!!!"
