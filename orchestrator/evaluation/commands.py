"""`nestor eval`, `nestor sample` and `nestor logits`: run.dir's newest checkpoint restored onto the current
mesh (for logits, or a fresh run's `model.init_from`), then evaluated on the eval batches, decoded from a
prompt, or run forward on given tokens."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from nestor.models import axes, stack, task
from nestor.orchestrator.checkpoint.reader import restore_state
from nestor.orchestrator.checkpoint.files import checkpoint_dir, finalized_steps
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.data.batches import run_chat_template, run_separator
from nestor.orchestrator.data.chat import ChatEncoder
from nestor.orchestrator.job.context_wiring import whole_rows
from nestor.orchestrator.errors import ConfigError
from nestor.orchestrator.job.eval_loss import Evaluator
from nestor.orchestrator.evaluation.sampling import batch_rows, make_generate, sampling_graphdef
from nestor.orchestrator.job.build import make_mesh
from nestor.orchestrator.specs.lm import LM
from nestor.orchestrator.specs.registry import spec_of
from nestor.orchestrator.job.state import StateLayout, initial_params, state_layout
from nestor.orchestrator.job.step import backend_for, model_context, stack_runners
from nestor.orchestrator.data.tokenizer import fitting_tokenizer
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
    run's devices). Raises ConfigError naming run.dir when there is no checkpoint, and as
    `checkpoint.reader.restore_state`."""
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
    text of `data.tokenizer` (or bytes), cut at the end of the document (the run's separator, `run_separator`).

    The prompt opens a document (a separator before it) unless the data is synthetic. It is decoded in
    as many identical rows as devices split the batch; the first row is returned. Raises ConfigError
    (key `--prompt`) for an empty prompt, (`--top-k`) for a top_k past the vocabulary, and as `restore_newest` and `fitting_tokenizer` do.
    """
    tokenizer = fitting_tokenizer(config.data.tokenizer, config.model.vocab_size)
    ids = [int(i) for i in tokenizer.encode(prompt)]
    documents = config.data.source != "synthetic"
    separator = run_separator(config) if documents else None
    if not documents and not ids:
        raise ConfigError([("--prompt", "is empty; give at least one token of text")])
    kept = _decoded(config, [separator, *ids] if documents else ids, {separator}, max_tokens, temperature, top_k,
                    seed, devices)
    kept = kept[kept < tokenizer.vocab_size]  # ids of the padded vocabulary past the tokenizer's decode to nothing
    # decoded with the prompt, so that the tokenizer places the space between them (a word-level or
    # SentencePiece decoder), then printed after the prompt as the user wrote it
    before, whole = tokenizer.decode(ids), tokenizer.decode(ids + kept.tolist())
    return prompt + (whole[len(before):] if whole.startswith(before) else tokenizer.decode(kept.tolist()))


def chat_checkpoint(config: Config, message: str, max_tokens: int, temperature: float = 0.0, top_k: int = 0,
                    seed: int = 0, devices: list[jax.Device] | None = None) -> str:
    """Returns the answer of run.dir's newest checkpoint to the user's `message`: rendered with the run's chat
    template (`run_chat_template`) and its generation prompt, decoded up to `max_tokens` tokens or the end of
    the turn (or of the text). Raises ConfigError (--chat) for an empty message or a run without a template,
    and as `sample_checkpoint` does."""
    if not message:
        raise ConfigError([("--chat", "is empty; give a message")])
    encoder = ChatEncoder(config.data.tokenizer, run_chat_template(config))
    stops = {run_separator(config), encoder.end_of_turn()} - {None}
    kept = _decoded(config, encoder.prompt([{"role": "user", "content": message}]), stops, max_tokens, temperature,
                    top_k, seed, devices)
    tokenizer = fitting_tokenizer(config.data.tokenizer, config.model.vocab_size)
    return tokenizer.decode(kept[kept < tokenizer.vocab_size].tolist())


def _decoded(config: Config, ids: list[int], stops: set[int], max_tokens: int, temperature: float, top_k: int,
             seed: int, devices: list[jax.Device] | None) -> np.ndarray:
    """Returns the tokens run.dir's newest checkpoint decodes after the prompt `ids`, up to `max_tokens` and before
    the first of `stops`. Raises ConfigError as `sample_checkpoint` says."""
    if not spec_of(config).decodes:
        raise ConfigError([("model.class", f"nestor sample decodes nestor's language model (model.class: {LM}); "
                                           f"{config.model.class_} has no decoding")])
    if top_k > config.model.vocab_size:
        raise ConfigError([("--top-k", f"{top_k} is more than model.vocab_size={config.model.vocab_size}")])
    restored = restore_newest(config, devices)
    rules = whole_rows(restored.rules)
    rows = batch_rows(restored.mesh, rules)
    prompts = jax.device_put(np.tile(np.asarray(ids, np.int32), (rows, 1)),
                             NamedSharding(restored.mesh, partition_spec((axes.BATCH, axes.LENGTH), rules)))
    model_ops = backend_for(config, restored.mesh).compiled_here().ops()
    generate = make_generate(sampling_graphdef(config), restored.mesh, rules, model_ops, max_tokens,
                             temperature, top_k)
    tokens = np.asarray(generate(restored.state["params"], prompts, jax.random.key(seed),
                                 expert_bias=restored.state.get("expert_bias")))[0]
    ends = np.flatnonzero(np.isin(tokens, list(stops)))
    return tokens[:ends[0]] if len(ends) else tokens


def _parameters(config: Config, mesh: Mesh, rules: Rules) -> tuple[StateLayout, dict, dict | None, str]:
    """Returns (layout, params, expert_bias or None, where they came from): run.dir's newest checkpoint, else
    `model.init_from`'s weights. Raises ConfigError naming run.dir when there is neither."""
    layout = state_layout(config, mesh, rules)
    if finalized_steps(checkpoint_dir(config.run.dir)):
        step, state = restore_state(config, layout)
        return layout, state["params"], state.get("expert_bias"), f"checkpoint {step}"
    if not config.model.init_from:
        raise ConfigError([("run.dir", f"{config.run.dir} holds no checkpoint and model.init_from is unset: "
                                       "train first, or name a Hugging Face checkpoint")])
    params = initial_params(config, layout)
    bias = layout.abstract.get("expert_bias")
    if bias is not None:
        bias = jax.tree.map(lambda leaf: jax.numpy.zeros(leaf.shape, leaf.dtype, device=leaf.sharding), bias)
    return layout, params, bias, config.model.init_from


def logits_of(config: Config, tokens: np.ndarray, devices: list[jax.Device] | None = None) -> tuple[np.ndarray, str]:
    """Returns (float32 logits [rows, length, vocab] of int `tokens` [rows, length], where the weights came
    from): the model's forward pass in evaluation (no dropped token where MoE is dropless), on the config's
    mesh, of run.dir's newest checkpoint or else `model.init_from`. Rows are padded to what the mesh and
    the pipeline's micro-batches split, then cut. Raises ConfigError (--tokens) for tokens that are not
    [rows, length] ids of the vocabulary, and as `_parameters`."""
    if not spec_of(config).decodes:
        raise ConfigError([("model.class", f"nestor logits runs nestor's language model (model.class: {LM})")])
    tokens = np.asarray(tokens)
    vocab = config.model.vocab_size
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer) or tokens.size == 0:
        raise ConfigError([("--tokens", f"expected integer ids [rows, length], got {tokens.dtype} {list(tokens.shape)}")])
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ConfigError([("--tokens", f"ids {tokens.min()}..{tokens.max()} are outside model.vocab_size={vocab}")])
    mesh = make_mesh(config, devices)
    rules = whole_rows(resolve_rules(config.mesh.rules))  # prompts of any length
    layout, params, bias, source = _parameters(config, mesh, rules)
    backend = backend_for(config, mesh)
    context, runners = model_context(backend, mesh, rules), stack_runners(config, mesh, rules, backend)
    multiple = batch_rows(mesh, rules) * (config.pipeline.microbatches if mesh.shape["pipeline"] > 1 else 1)
    rows = tokens.shape[0]
    padded = np.concatenate([tokens, np.repeat(tokens[-1:], -rows % multiple, axis=0)]).astype(np.int32)

    def forward(params: dict, expert_bias: dict | None, tokens: jax.Array) -> jax.Array:
        model = nnx.merge(layout.graphdef, expert_bias or {}, params)
        with context(), stack.runners(runners), task.step_info(False, None):
            return model(tokens, train=False)[0]

    token_sharding = NamedSharding(mesh, partition_spec((axes.BATCH, axes.LENGTH), rules))
    run = jax.jit(forward, in_shardings=(layout.shardings["params"], layout.shardings.get("expert_bias"),
                                         token_sharding),
                  out_shardings=NamedSharding(mesh, partition_spec((axes.BATCH, axes.LENGTH, None), rules)))
    logits = run(params, bias, jax.make_array_from_callback(padded.shape, token_sharding, lambda index: padded[index]))
    if jax.process_count() > 1:
        logits = multihost_utils.process_allgather(logits, tiled=True)
    return np.asarray(logits, np.float32)[:rows], source
