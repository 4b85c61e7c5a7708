"""`nestor eval` and `nestor sample`: run.dir's newest checkpoint restored onto the current mesh, then
evaluated on the eval batches or decoded from a prompt."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from nestor.models import axes
from nestor.orchestrator.checkpoint import restore_state
from nestor.orchestrator.config import Config, ConfigError
from nestor.orchestrator.data.shards import DOCUMENT_SEPARATOR
from nestor.orchestrator.evaluation.loss import Evaluator
from nestor.orchestrator.evaluation.sampling import batch_rows, make_generate, sampling_graphdef
from nestor.orchestrator.job import make_mesh
from nestor.orchestrator.model_class import LM, is_builtin_lm
from nestor.orchestrator.state import StateLayout, state_layout
from nestor.orchestrator.step import backend_for
from nestor.orchestrator.tokenizer import fitting_tokenizer
from nestor.parallel.rules import Rules, partition_spec, resolve_rules


@dataclasses.dataclass
class Restored:
    """A checkpoint's train state on the current mesh, and what it was laid out by."""

    mesh: Mesh
    rules: Rules
    layout: StateLayout
    step: int
    state: dict


def restore_newest(config: Config, devices: list[jax.Device] | None = None) -> Restored:
    """Returns run.dir's newest checkpoint restored onto the mesh of `config` on `devices` (default: the
    run's devices). Raises ConfigError naming run.dir when there is no checkpoint, and as `Checkpointer.restore`."""
    mesh = make_mesh(config, devices)
    rules = resolve_rules(config.mesh.rules)
    layout = state_layout(config, mesh, rules)
    try:
        step, state = restore_state(config, layout)
    except FileNotFoundError as error:
        raise ConfigError([("run.dir", f"{error}; train first (nestor train) or point run.dir at a run")]) from None
    return Restored(mesh, rules, layout, step, state)


def evaluate_checkpoint(config: Config, devices: list[jax.Device] | None = None) -> dict[str, float]:
    """Returns {step, eval_loss, eval_perplexity, eval_<metric>...} of run.dir's newest checkpoint on the eval
    batches.
    Raises ConfigError as `restore_newest` and `eval_source` do."""
    restored = restore_newest(config, devices)
    evaluator = Evaluator(config, restored.layout, restored.mesh, restored.rules)
    values = evaluator(restored.state)
    return {"step": restored.step, **{name: float(value) for name, value in values.items()}}


def sample_checkpoint(config: Config, prompt: str, max_tokens: int, temperature: float = 0.0, top_k: int = 0,
                      seed: int = 0, devices: list[jax.Device] | None = None) -> str:
    """Returns `prompt` followed by up to `max_tokens` tokens decoded from run.dir's newest checkpoint, as
    text of `data.tokenizer` (or bytes), cut at the end of the document (token 0).

    The prompt opens a document (a separator before it) unless the data is synthetic. It is decoded in
    as many identical rows as devices split the batch; the first row is returned. Raises ConfigError
    (key `--prompt`) for an empty prompt, (`--top-k`) for a top_k past the vocabulary, and as `restore_newest` and `fitting_tokenizer` do.
    """
    if not is_builtin_lm(config):
        raise ConfigError([("model.class", f"nestor sample decodes nestor's language model (model.class: {LM}); "
                                           f"{config.model.class_} has no decoding")])
    tokenizer = fitting_tokenizer(config.data.tokenizer, config.model.vocab_size)
    ids = [int(i) for i in tokenizer.encode(prompt)]
    documents = config.data.source != "synthetic"
    if documents:
        ids = [DOCUMENT_SEPARATOR, *ids]
    if not ids:
        raise ConfigError([("--prompt", "is empty; give at least one token of text")])
    if top_k > config.model.vocab_size:
        raise ConfigError([("--top-k", f"{top_k} is more than model.vocab_size={config.model.vocab_size}")])
    restored = restore_newest(config, devices)
    rows = batch_rows(restored.mesh, restored.rules)
    prompts = jax.device_put(np.tile(np.asarray(ids, np.int32), (rows, 1)),
                             NamedSharding(restored.mesh, partition_spec((axes.BATCH, axes.LENGTH), restored.rules)))
    model_ops = backend_for(config, restored.mesh).compiled_here().ops()
    generate = make_generate(sampling_graphdef(config), restored.mesh, restored.rules, model_ops, max_tokens,
                             temperature, top_k)
    tokens = np.asarray(generate(restored.state["params"], prompts, jax.random.key(seed),
                                   expert_bias=restored.state.get("expert_bias")))[0]
    ends = np.flatnonzero(tokens == DOCUMENT_SEPARATOR) if documents else []
    kept = tokens[:ends[0]] if len(ends) else tokens
    return prompt + tokenizer.decode(kept.tolist())
