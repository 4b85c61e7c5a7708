"""Chat data packed into rows: whole conversations, each its own document, and a loss that is the mean over the
answer tokens of the global batch however rows are packed, accumulated, pipelined or split over devices."""

import jax
import numpy as np
import pytest
from flax import nnx

from nestor.models import task
from nestor.orchestrator.data.batches import document_ids, token_fields
from nestor.orchestrator.data.packing import pack
from nestor.orchestrator.job.build import build_job
from nestor.orchestrator.job.eval_loss import Evaluator
from nestor.orchestrator.job.state import init_state
from nestor.orchestrator.job.step import _accumulated_grads, constrain_batch, make_grad_fn
from nestor.parallel.rules import activation_constrainer
from tests.helpers import mesh_overrides
from tests.test_chat import REFERENCE, prepared, records
from tests.test_separator import END_OF_TEXT

SEQ_LEN = 256
CONVERSATIONS = [(np.asarray(c["input_ids"]), np.asarray(c["assistant_masks"], np.float32))
                 for c in REFERENCE["conversations"]]


def chat_config(tiny_config, *overrides, **dotted):
    return tiny_config("model.vocab_size=512", f"train.seq_len={SEQ_LEN}", "train.global_batch=8",
                       "model.remat=none", *overrides, **{**mesh_overrides(), "cluster.devices_per_host": 1, **dotted})


def test_pack_keeps_documents_whole_and_truncates_only_longer_ones():
    lengths = np.array([5, 3, 9, 4, 2, 7])
    rows, truncated = pack(lengths, 10, 0)
    assert sorted(np.concatenate(rows).tolist()) == list(range(6)) and truncated == 0
    assert all(1 + lengths[row].sum() <= 10 for row in rows)  # each row opens with one separator
    rows, truncated = pack(np.array([3, 12, 4]), 10, 0)
    assert truncated == 1 and [12] in [lengths_of.tolist() for lengths_of in (np.array([3, 12, 4])[r] for r in rows)]


def test_rows_hold_whole_conversations_each_its_own_document(tiny_config, tmp_path):
    prepared(records("messages") * 2, tmp_path / "chat")
    config = chat_config(tiny_config, "data.source=tokens", f"data.paths=[{tmp_path / 'chat'}]")
    job = build_job(config)
    source = job.data.source
    assert source.weighted and source.truncated == 0
    rows = len(source.sources[0].packed)
    assert rows < 12  # 12 conversations of 35 to 119 tokens, several to a row of 257
    found = []
    for position in range(rows):  # one epoch: every row once
        step, row = divmod(position, 8)
        batch = {name: np.asarray(value)[row] for name, value in job.data.batch(step).items()}
        tokens, weights = batch["tokens"], batch[task.LOSS_WEIGHTS]
        segments = document_ids(tokens, END_OF_TEXT)
        np.testing.assert_array_equal(batch["segment_ids"], segments[:-1])
        assert tokens[0] == END_OF_TEXT
        for segment in np.unique(segments):  # a separator, then a whole conversation (or nothing: padding)
            places = np.flatnonzero(segments == segment)[1:]
            if len(places):
                found.append((tokens[places].tolist(), weights[places - 1].tolist()))
    assert sorted(found) == sorted((ids.tolist(), mask.tolist()) for ids, mask in CONVERSATIONS * 2)
    short = chat_config(tiny_config, "data.source=tokens", f"data.paths=[{tmp_path / 'chat'}]", "train.seq_len=64")
    assert build_job(short).data.source.truncated == 10  # those of over 64 tokens (their separator too)


def loss_and_grads(config, *batches: dict) -> list[tuple[float, dict]]:
    """Returns the step's (loss, gradients) of each batch on `config`'s mesh, with its grad_accum and schedule
    (one compile for all)."""
    job = build_job(config, with_data=False)
    params = init_state(config, job.layout)["params"]
    grad_fn = make_grad_fn(config, job.layout, job.mesh, job.rules)
    constrain = activation_constrainer(job.mesh, job.rules)
    fields = token_fields(config, True, True)

    @jax.jit
    def step(params, batch):
        return _accumulated_grads(grad_fn, params, task.normalized_weights(batch), jax.random.key(0),
                                  config.train.grad_accum, lambda micro: constrain_batch(micro, fields, constrain))

    results = []
    for batch in batches:
        grads, metrics = step(params, {name: jax.device_put(batch[name], field.sharding(job.mesh, job.rules))
                                       for name, field in fields.items()})
        results.append((float(metrics["loss"]), jax.tree.map(np.asarray, grads)))
    return results


def rows_of(documents: list[list[int]], rows: int) -> dict:
    """Returns a batch of `rows` rows of width SEQ_LEN + 1, row i holding the conversations documents[i] packed
    after one separator (the rest separators of weight 0)."""
    tokens = np.full((rows, SEQ_LEN + 1), END_OF_TEXT, np.int32)
    weights = np.zeros((rows, SEQ_LEN + 1), np.float32)
    for row, members in enumerate(documents):
        position = 1
        for index in members:
            ids, mask = CONVERSATIONS[index]
            tokens[row, position:position + len(ids)] = ids
            weights[row, position:position + len(ids)] = mask
            position += len(ids) + 1
    return {"tokens": tokens, "segment_ids": document_ids(tokens[:, :-1], END_OF_TEXT),
            task.LOSS_WEIGHTS: weights[:, 1:]}


def weighted_mean_of_reference(config, batch: dict) -> float:
    """Returns sum(weight x cross-entropy) / sum(weight) over the batch, from the model's logits."""
    job = build_job(config, with_data=False)
    model = nnx.merge(job.layout.graphdef, init_state(config, job.layout)["params"])
    logits, _ = model(batch["tokens"][:, :-1], segment_ids=batch["segment_ids"], train=False)
    log_probs = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    losses = -np.take_along_axis(np.asarray(log_probs), batch["tokens"][:, 1:, None], axis=-1)[..., 0]
    weights = batch[task.LOSS_WEIGHTS]
    return float((losses * weights).sum() / weights.sum())


def assert_same(first: tuple[float, dict], second: tuple[float, dict], rtol: float) -> None:
    np.testing.assert_allclose(first[0], second[0], rtol=rtol)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(a).max()),
                 first[1], second[1])


def test_packed_and_unpacked_conversations_give_the_same_loss_and_gradients(tiny_config):
    unpacked = rows_of([[i] for i in range(6)], 8)  # one conversation a row, two rows of padding
    packed = rows_of([[0, 1, 4], [2, 5], [3]], 8)  # three rows, five empty
    config = chat_config(tiny_config)
    one, other = loss_and_grads(config, unpacked, packed)
    np.testing.assert_allclose(one[0], weighted_mean_of_reference(config, unpacked), rtol=1e-6)
    assert_same(other, one, rtol=1e-6)


@pytest.mark.parametrize("overrides", [
    {"train.grad_accum": 2, "cluster.devices_per_host": 2, "mesh.data": 2},
    pytest.param({"mesh.pipeline": 2, "pipeline.microbatches": 2, "pipeline.schedule": "1f1b",
                  "cluster.devices_per_host": 2}, marks=pytest.mark.slow),
    pytest.param({"mesh.pipeline": 2, "pipeline.microbatches": 2, "train.grad_accum": 2, "cluster.devices_per_host": 4,
                  "mesh.data": 2}, marks=pytest.mark.slow),  # GPipe
])
def test_accumulation_pipelines_and_devices_weigh_every_target_token_alike(tiny_config, overrides):
    """Rows of very different answer counts (a whole micro-batch of padding among them): the token-weighted
    mean of the global batch, not a mean of micro-batch means."""
    batch = rows_of([[0, 1, 4], [], [2], [], [3, 5], [], [], []], 8)
    [single] = loss_and_grads(chat_config(tiny_config), batch)
    [split] = loss_and_grads(chat_config(tiny_config, **overrides), batch)
    assert_same(split, single, rtol=1e-6)


def test_eval_on_held_out_conversations_is_the_mean_over_all_their_answer_tokens(tiny_config, tmp_path):
    prepared(records("messages") * 3, tmp_path / "chat", eval_fraction=0.5)
    config = chat_config(tiny_config, "data.source=tokens", f"data.paths=[{tmp_path / 'chat'}]", "eval.steps=2",
                         **{"train.global_batch": 2})
    job = build_job(config, with_data=False)
    evaluator = Evaluator(config, job.layout, job.mesh, job.rules)
    batches = [{name: np.asarray(value) for name, value in evaluator.data.batch(index).items()} for index in range(2)]
    assert batches[0][task.LOSS_WEIGHTS].sum() != batches[1][task.LOSS_WEIGHTS].sum()  # unequal answer counts
    both = {name: np.concatenate([batch[name] for batch in batches]) for name in batches[0]}
    got = float(evaluator(init_state(config, job.layout))["eval_loss"])
    want = weighted_mean_of_reference(config, both)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    per_batch = np.mean([weighted_mean_of_reference(config, batch) for batch in batches])
    assert abs(per_batch - want) > 1e-4 * want  # what a mean of the batches' means would have said
