"""The run config's schema: one typed, frozen dataclass per section, every key with its default, range,
choices and help (`config_keys.key`), built from plain data (`from_dict`) and back (`Config.to_dict`).
Pure: no file is read and neither jax nor the backend is imported, so that any module can read a config's
type; loading (base.yaml, presets, the run YAML, overrides, checkpoints' configs) and the checks across keys
are `orchestrator.loader.config`'s. The choices below are those of the rooms that act on them, held equal to theirs
by tests/test_config.py."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from nestor.models import remat_names
from nestor.orchestrator.config import keys as config_keys
from nestor.orchestrator.config.keys import FIELD_NAMES, YAML_NAMES, Key, hints, key
from nestor.orchestrator.errors import ConfigError

# steps whose median loss is a saved state's loss (orchestrator.loop.health), named in health_factor's help
HEALTH_WINDOW = 20

ATTENTION_CHOICES = ("auto", "xla", "cudnn")  # model.attention (backend)
GROUPED_MATMUL_CHOICES = ("auto", "xla", "mosaic_gpu")  # moe.grouped_matmul (backend)
EXCHANGE_CHOICES = ("all_gather", "ragged_all_to_all")  # moe.exchange besides auto (backend.EXCHANGE_CHOICES)
REMAT_CHOICES = ("auto", "none", "full", "dots", "minimal", "offload")  # model.remat (backend.remat.CHOICES)
CONTEXT_STRATEGIES = ("all_gather", "ring")  # model.context_attention (parallel.context.STRATEGIES)
MESH_AXES = ("pipeline", "data", "fsdp", "context", "expert", "tensor")  # parallel.rules.MESH_AXES


_POSITIVE = dict(minimum=1)
_DEGREE = dict(minimum=1, also=(-1,))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    dir: str = key("runs/default", "run directory: config.yaml, checkpoints/, tb/, metrics.jsonl (relative: to "
                   "where nestor runs); one run at a time (run.dir/nestor.lock)")
    seed: int = key(0, "seeds parameters, data order and routing noise", minimum=0, maximum=2**32 - 1)
    compile_cache: str | None = key("~/.cache/nestor/xla", "persistent XLA compilation cache: a rerun or resume "
                                    "loads the step (a deviceless compile: its figures); null = off")
    hang_timeout_s: float | None = key(None, "seconds a step, save or restore may take on any process before the "
                                       "run stops as hung, stacks in run.dir/hangs/; null = 20 x the median step, "
                                       "at least 600; 0 = never", minimum=0)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    class_: str = key("lm", "the model: lm (nestor's decoder LM, the keys below) or a Flax NNX module's import path "
                      "module:Name, resolved in the directory nestor runs in (docs/models.md)")
    args: dict = key({}, "model.class module:Name: keyword arguments of Name (or of its config dataclass)")
    preset: str | None = key(None, "configs/models/<preset>.yaml, applied before the keys below")
    init_from: str | None = key(None, "a Hugging Face checkpoint directory (config.json, *.safetensors) a fresh run "
                                "starts from: the keys below and moe.* come from its config.json (docs/finetune.md)")
    vocab_size: int = key(256, "byte-level by default", **_POSITIVE)
    embed_dim: int = key(64, "width of the residual stream", **_POSITIVE)
    num_layers: int = key(2, "transformer blocks", **_POSITIVE)
    num_heads: int = key(4, "query heads", **_POSITIVE)
    num_kv_heads: int = key(2, "key/value heads (grouped-query attention); divides num_heads", **_POSITIVE)
    head_dim: int = key(16, "width of one attention head; even (RoPE)", **_POSITIVE)
    mlp_dim: int = key(128, "hidden width of the SwiGLU feed-forward", **_POSITIVE)
    tie_embeddings: bool = key(False, "unembed with the transposed token embedding")
    rope_theta: float = key(10000.0, "RoPE base frequency", above=0)
    rope_scaling: dict | None = key(None, "RoPE frequency scaling {type: llama3, factor, low_freq_factor, "
                                    "high_freq_factor, original_max_position_embeddings} (Llama 3.1); null = none")
    qkv_bias: bool = key(False, "biases on the query, key and value projections (Qwen2)")
    out_bias: bool = key(False, "a bias on the attention's output projection")
    qk_norm: bool = key(False, "RMSNorm over each query and key head before RoPE (Qwen3)")
    norm_eps: float = key(1e-6, "RMSNorm epsilon", minimum=0)
    init_std: float = key(0.02, "stddev of the normal initialiser", above=0)
    dtype: str = key("float32", "activations and matmuls: float32 | bfloat16 | float16 (GPUs only); params stay "
                     "float32", choices=("float32", "bfloat16", "float16"))
    matmul_precision: str = key("bfloat16", "weight matmuls (attention projections, MLP, experts): bfloat16 (in "
                                "model.dtype) | fp8 (float8 e4m3 forward, e5m2 gradients, current per-tensor "
                                "scaling; model.dtype bfloat16; GPUs of compute capability 8.9+, emulated on CPU)",
                                choices=("bfloat16", "fp8"))
    attention: str = key("auto", "jax.nn.dot_product_attention: auto (cudnn on GPU in bf16/fp16, else xla; bf16 on "
                         "CPU from float32 sums) | xla | cudnn", choices=ATTENTION_CHOICES)
    remat: str = key("auto", "per stacked unit, scanned or pipelined: auto (the backend's for the target: dots on "
                     "GPU/TPU, full on CPU) | none | full | dots | minimal | offload (CPU: = minimal)",
                     choices=REMAT_CHOICES)
    remat_names: tuple[str, ...] = key((), "minimal/offload: activations to keep (models/remat_names.py); empty = "
                                       "the policy's default set", choices=remat_names.ALL)
    context_attention: str = key("all_gather", "attention over a row split by mesh.context: all_gather (keys and "
                                 "values gathered per layer) | ring (passed around the ring by collective permutes, "
                                 "each block computed while the next arrives)", choices=CONTEXT_STRATEGIES)
    context_balance: bool = key(True, "mesh.context: each device holds an early and a late chunk of a row, so the "
                                "causal mask gives every device the same attention work; false = contiguous "
                                "chunks (train.seq_len divides by 2 x mesh.context either way)")
    scan_layers: bool = key(True, "train and evaluate the layer stack as a lax.scan (compile time independent of "
                            "depth); false unrolls it (faster on GPU, other temporaries, compile time grows with "
                            "depth); a pipeline's stages and generation keep their loops")

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = key(100, "optimizer steps", **_POSITIVE)
    global_batch: int = key(16, "sequences per step, over all devices", **_POSITIVE)
    seq_len: int = key(64, "tokens per sequence", **_POSITIVE)
    grad_accum: int = key(1, "micro-batches accumulated into one optimizer step", **_POSITIVE)
    log_every: int = key(1, "write metrics every N steps", **_POSITIVE)
    objective: str = key("lm", "what the step minimises: lm (the model's loss: next-token, weighted on chat data) | "
                         "dpo (DPO on preference pairs prepared by nestor data prepare: dpo.beta; the reference is "
                         "the base with lora.rank, else a frozen copy of the start)", choices=("lm", "dpo"))


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = key(3e-3, "peak learning rate", above=0)
    warmup_steps: int = key(10, "linear warmup from 0; at most decay_steps (when null, cut at train.steps)",
                            minimum=0)
    decay_steps: int | None = key(None, "cosine decay ends here, then lr stays at lr * min_lr_ratio; null = "
                                  "train.steps", **_POSITIVE)
    min_lr_ratio: float = key(0.1, "cosine decays to lr * min_lr_ratio at decay_steps", minimum=0, maximum=1)
    b1: float = key(0.9, "Adam decay of the first moment", minimum=0, below=1)
    b2: float = key(0.95, "Adam decay of the second moment", minimum=0, below=1)
    eps: float = key(1e-8, "Adam denominator epsilon", above=0)
    weight_decay: float = key(0.1, "AdamW decoupled decay (not applied to norm scales)", minimum=0)
    clip_norm: float = key(1.0, "global gradient-norm clip; 0 disables", minimum=0)
    shard_update: bool = key(False, "ZeRO stage 1: every parameter's Adam moments and update are split further "
                             "over the mesh axes the batch is split on (data, fsdp, expert), each device updating "
                             "its share, then the new parameters are gathered; false = every device updates all "
                             "it holds")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = key("synthetic", "synthetic | text | tokens (shards of `nestor data prepare`) | arrays (named "
                      "arrays, for a model.class of your own) | python (data.factory's arrays)",
                      choices=("synthetic", "text", "tokens", "arrays", "python"))
    paths: tuple[str, ...] = key((), "text: globs of text files (no NUL bytes); empty = the Python standard "
                                 "library's sources; tokens: prepared directories; arrays: .npz files or "
                                 "directories of .npy files")
    mixture: tuple[dict, ...] = key((), "tokens: [{paths: [dirs], weight: w > 0}, ...] each row drawn from one "
                                    "entry by weight; empty = data.paths")
    tokenizer: str | None = key(None, "text: path to a tokenizers JSON or SentencePiece model; null = bytes")
    document_mask: bool = key(True, "text, tokens: no token attends across a document separator "
                              "(data.separator); synthetic: no-op")
    separator: int | str = key("eos", "the token id that ends each document, or eos: the tokenizer's end of text "
                               "(bytes: 0); tokens: the one the shards were prepared with", minimum=0, also=("eos",))
    factory: str | None = key(None, "python: module:function(split, **data.args) returning a dict of named arrays, "
                              "rows first, for split train or eval (docs/models.md)")
    args: dict = key({}, "python: keyword arguments of data.factory")


EVAL_SOURCES = ("heldout", "synthetic", "text", "tokens", "arrays")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = key(0, "evaluate after every N-th step and the last; 0 = never (nestor eval still works)",
                     minimum=0)
    steps: int = key(4, "eval batches of train.global_batch rows, the same ones every time",
                     **_POSITIVE)
    source: str = key("heldout", "heldout (the eval split of the data.paths / data.mixture shards) | synthetic | "
                      "text | tokens | arrays (eval.paths)", choices=EVAL_SOURCES)
    paths: tuple[str, ...] = key((), "text: globs of text files; tokens: prepared directories, their train split; "
                                 "arrays: .npz files or directories of .npy files")


@dataclasses.dataclass(frozen=True)
class DcnConfig:
    pipeline: int = key(1, "pipeline stages across slices", **_POSITIVE)
    data: int = key(1, "data-parallel replicas across slices", **_POSITIVE)
    fsdp: int = key(1, "fully-sharded data parallelism across slices", **_POSITIVE)
    context: int = key(1, "context parallelism across slices", **_POSITIVE)
    expert: int = key(1, "expert parallelism across slices", **_POSITIVE)
    tensor: int = key(1, "tensor parallelism across slices", **_POSITIVE)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    pipeline: int = key(1, "pipeline stages", **_DEGREE)
    data: int = key(-1, "data-parallel replicas", **_DEGREE)
    fsdp: int = key(1, "fully-sharded data parallelism: parameters split, gathered per layer", **_DEGREE)
    context: int = key(1, "context parallelism: a sequence's positions split (model.context_attention)", **_DEGREE)
    expert: int = key(1, "expert parallelism: MoE experts split over it (it also splits the batch)", **_DEGREE)
    tensor: int = key(1, "tensor parallelism: heads and MLP width split, innermost", **_DEGREE)
    dcn: DcnConfig = DcnConfig()
    rules: dict = key({}, "logical axis -> mesh axes overrides, e.g. {embed: null, mlp: [tensor, fsdp]}")

    def ici_shape(self) -> dict[str, int]:
        """Returns the per-slice degrees by axis name, -1 still unresolved."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def dcn_shape(self) -> dict[str, int]:
        """Returns the across-slice degrees by axis name."""
        return {axis: getattr(self.dcn, axis) for axis in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    microbatches: int = key(1, "micro-batches per pipelined step (GPipe M); with repeats > 1, circular needs M >= "
                            "mesh.pipeline, interleaved_1f1b a multiple of it", **_POSITIVE)
    schedule: str = key("gpipe", "gpipe (M+S-1 iterations) | circular (R*M+S-1, bubble (S-1)/(R*M+S-1)) | 1f1b "
                        "(backward in the loop: M+2S-2 ticks, at most 2S-1 micro-batches in flight) | "
                        "interleaved_1f1b (1f1b over R layer groups per stage: R*M+(R+1)S-2 ticks of 1/R stage, "
                        "bubble (S-1)/(R*M+S-1), at most (R+1)S-1 in flight) | zero_bubble (1f1b with the "
                        "weight-gradient pass deferred s ticks on stage s: M ticks run one, 2S-1-s in flight)",
                        choices=("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble"))
    repeats: int = key(1, "circular, interleaved_1f1b: non-adjacent layer groups per stage (R); "
                       "num_layers % (S*R) == 0", **_POSITIVE)
    stack: str = key("blocks", "the model's stack (models.stack) a pipeline splits into stages; nestor's LM: blocks")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int = key(0, "0 = dense model", minimum=0)
    every: int = key(0, "an MoE feed-forward every k-th layer (divides model.num_layers); 0 = dense", minimum=0)
    top_k: int = key(2, "experts per token; at most num_experts", **_POSITIVE)
    capacity_factor: float = key(1.25, "training capacity factor; 0 = dropless (no token dropped, in training or eval: "
                                 "grouped matmuls over tokens sorted by expert)", minimum=0)
    eval_capacity_factor: float = key(2.0, "capacity factor outside training (unused when dropless)", above=0)
    group_size: int = key(0, "tokens per routing group (divides the tokens per device); 0 = one per sequence, "
                          "or with mesh.context and capacity the largest divisor of a device's chunk (chosen, said)",
                          minimum=0)
    second_expert_policy: str = key("all", "all | random (GShard's random routing of the 2nd expert; pipeline "
                                    "micro-batches share one draw)", choices=("all", "random"))
    dispatch: str = key("sort", "sort (tokens placed in expert slots by index) | einsum (GShard's one-hot einsums, "
                        "the reference)",
                        choices=("einsum", "sort"))
    exchange: str = key("auto", "how dropless tokens reach other devices' experts: auto (ragged_all_to_all on GPU "
                        "and TPU, all_gather on CPU) | all_gather (all-gather + reduce-scatter, every backend) | "
                        "ragged_all_to_all (only routed rows move; GPU, TPU)",
                        choices=("auto", *EXCHANGE_CHOICES))
    grouped_matmul: str = key("auto", "dropless layers' grouped matmuls: auto (mosaic_gpu on Hopper GPUs in "
                              "bf16/fp16 where each device's embed and expert width are multiples of 128, else xla) "
                              "| xla (jax.lax.ragged_dot; XLA:GPU multiplies every row by every expert) | mosaic_gpu "
                              "(jax's Pallas grouped-GEMM kernels, Hopper only)", choices=GROUPED_MATMUL_CHOICES)
    router: str = key("softmax", "softmax | sigmoid (DeepSeek-V3: per-expert sigmoid scores, gates renormalised over "
                      "the top k)", choices=("softmax", "sigmoid"))
    normalize_gates: bool = key(True, "top_k > 1: the chosen experts' gates renormalised to sum to one (GShard, "
                                "Mixtral); false keeps the router's probabilities (Qwen3-MoE's norm_topk_prob: false)")
    expert_mlp_dim: int = key(0, "hidden width of each routed expert (fine-grained experts); 0 = model.mlp_dim",
                              minimum=0)
    shared_experts: int = key(0, "always-on experts added to the routed output (DeepSeekMoE), each expert_mlp_dim "
                              "wide", minimum=0)
    first_dense_layers: int = key(0, "the first layers stay dense (DeepSeek-V3); moe.every counts the layers after "
                                  "them", minimum=0)
    bias_update_rate: float = key(0.0, "auxiliary-loss-free balancing (arXiv 2408.15664): each step a per-expert "
                                  "bias added to the router scores for the choice only moves this much against "
                                  "the expert's excess load; 0 = off", minimum=0)
    aux_loss_weight: float = key(0.01, "GShard load-balancing loss weight", minimum=0)
    z_loss_weight: float = key(0.001, "ST-MoE router z-loss weight", minimum=0)


@dataclasses.dataclass(frozen=True)
class LoraSection:
    rank: int = key(0, "LoRA adapters of this rank on lora.targets, the rest of the model frozen (no optimizer "
                    "state); 0 = full fine-tuning (docs/finetune.md)", minimum=0)
    alpha: float = key(16.0, "the adapters' update is scaled by alpha / rank", above=0)
    targets: tuple[str, ...] = key(("query", "key", "value", "out", "gate", "up", "down"),
                                   "the adapted weights: query key value out (attention), gate up down (MLP, "
                                   "shared experts), expert_gate expert_up expert_down (routed experts); peft's "
                                   "q_proj ... down_proj too; a model.class of your own: parameter paths "
                                   "(blocks/mlp/w1, globs)")
    dropout: float = key(0.0, "dropout on the adapters' inputs in training", minimum=0, below=1)
    init_from: str | None = key(None, "a PEFT LoRA adapter directory (adapter_config.json, "
                                "adapter_model.safetensors) to start from; its rank, alpha and targets replace "
                                "the keys above")


@dataclasses.dataclass(frozen=True)
class DpoSection:
    beta: float = key(0.1, "train.objective=dpo: how far the policy may move from the reference (DPO's beta)",
                      above=0)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = key(0, "save every N steps (0 = only at the end and on SIGTERM)", minimum=0)
    keep: int = key(3, "newest checkpoints kept", minimum=1, maximum=10_000)
    health_factor: float = key(2.0, f"a state whose loss (median of the last {HEALTH_WINDOW} steps) or parameter "
                               "norm is over this factor x the run's best loss and that state's norm blew up: "
                               "training stops before saving it; 0 = finite is enough", minimum=1, also=(0,))
    # `async` is a Python keyword, so the field is `async_save`; the YAML key stays `async`.
    async_save: bool = key(True, "save in the background while training continues")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    tensorboard: bool = key(True, "write TensorBoard events to run.dir/tb")
    image_every: int = key(100, "expert-load heatmap every N steps (MoE only); 0 = never", minimum=0)
    peak_tflops: float | None = key(None, "per-device peak for MFU; null = look up the device kind", above=0)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    start_step: int = key(0, "first traced step, numbered as in metrics.jsonl (1 = the first); 0 = no trace",
                          minimum=0)
    steps: int = key(3, "steps traced from start_step on", **_POSITIVE)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    launcher: str = key("ray", "ray (an embedded local cluster unless cluster.address) | inprocess",
                        choices=("ray", "inprocess"))
    address: str | None = key(None, "Ray cluster address; null = start an embedded local cluster")
    hosts: int = key(1, "JAX processes (one per host)", **_POSITIVE)
    devices_per_host: int = key(8, "devices each process uses; on CPU, the number simulated; -1 = all", **_DEGREE)
    accelerator: str = key("cpu", "cpu | gpu | tpu", choices=("cpu", "gpu", "tpu"))
    max_failures: int = key(3, "failed worker groups in a row with no new checkpoint between them that are "
                            "restarted before the run fails; -1 = no limit", minimum=-1)
    min_hosts: int | None = key(None, "fewest hosts a restarted worker group may continue on (a smaller mesh, the "
                                "same global batch); null = cluster.hosts", **_POSITIVE)
    restart_timeout_s: float = key(300.0, "seconds a restart waits for every host before it continues on fewer "
                                   "(cluster.min_hosts)", above=0)
    init_timeout_s: float = key(120.0, "seconds to wait for every process to join jax.distributed", above=0)
    tpu_topology: str | None = key(None, "tpu: slice topology per host group, e.g. 2x2x2 (v4/v5p) or 4x4 (v5e)")
    tpu_type: str | None = key(None, "tpu: Ray accelerator type, e.g. TPU-V4, TPU-V5LITEPOD, TPU-V5P")
    dashboard: bool = key(True, "embedded cluster: serve Ray's dashboard and state API on 127.0.0.1")
    keep_head_s: float = key(600.0, "embedded cluster: keep its Ray head up this many seconds after the command, for "
                             "the next command on this machine to reuse (`nestor stop-head` ends it now); 0 = start "
                             "and stop a cluster of the command's own", minimum=0)
    worker_logs: bool = key(False, "true: stream every worker's raw output (Ray-prefixed) too, for debugging")
    device_kind: str | None = key(None, "the memory checks of explain and train: a device in its table (h100, h200, "
                                  "b200, a100-40gb, a100-80gb, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e); null = the "
                                  "accelerators present (CPU: the host's RAM over its devices); also the target the "
                                  "backend's choices are made for, and explain compiles for with the target's own "
                                  "compiler where nestor[gpu-compile] or nestor[tpu-compile] is installed (h100, h200, "
                                  "b200, a100-80gb, tpu-v5e, tpu-v5p, tpu-v6e)")
    device_memory_gb: float | None = key(None, "the memory checks of explain and train: GiB per device, overrides "
                                         "the table", above=0)
    compile_check: bool = key(True, "train under Ray: before any worker starts, compile the step for "
                              "cluster.device_kind with the target's own compiler where nestor[gpu-compile] or "
                              "nestor[tpu-compile] is installed here, and refuse a step that does not fit the device's "
                              "memory; false = the train state alone is checked")


@dataclasses.dataclass(frozen=True)
class Config:
    """A run's keys, section by section (the loader's `orchestrator.loader.config.Config` adds `replace`)."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    mesh: MeshConfig = MeshConfig()
    pipeline: PipelineConfig = PipelineConfig()
    moe: MoEConfig = MoEConfig()
    lora: LoraSection = LoraSection()
    dpo: DpoSection = DpoSection()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    profile: ProfileConfig = ProfileConfig()
    cluster: ClusterConfig = ClusterConfig()
    # not a key: a line for each value validation chose where the run left a key unset (loader.validation)
    chosen: typing.ClassVar[tuple[str, ...]] = ()

    @property
    def moe_layers(self) -> int:
        """Returns the number of MoE layers: the last of every `moe.every` after the first dense layers."""
        if not (self.moe.num_experts and self.moe.every):
            return 0
        return (self.model.num_layers - self.moe.first_dense_layers) // self.moe.every

    @property
    def dropless_moe(self) -> bool:
        """True for an MoE model whose layers drop no token (`moe.capacity_factor=0`): grouped matmuls."""
        return bool(self.moe.num_experts and self.moe.every) and self.moe.capacity_factor == 0

    def to_dict(self) -> dict[str, Any]:
        """Returns the config as plain YAML-able data, keys as users write them."""
        return _to_plain(self)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {
            YAML_NAMES.get(f.name, f.name): _to_plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
        }
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([(key, f"'{part}' is a value, not a section")])
        node = child
    node[parts[-1]] = value




def key_table(cls: type | None = None, prefix: str = "") -> tuple[tuple[str, Any, Any, Key], ...]:
    """Returns (dotted path, type hint, default, Key) for every key of `cls` (default: Config), in base.yaml's
    order."""
    return config_keys.key_table(cls or Config, prefix)


# keys that were removed, and what to write instead of a value
REMOVED_KEYS = {"pipeline.remat": "was removed; write model.remat (none | full | dots | minimal | offload), which "
                                  "applies to every layer stack, scanned or pipelined"}


def from_dict(tree: dict, cls: type[Config] = Config) -> Config:
    """Returns a `cls` built from nested plain data; unknown keys and wrong types raise."""
    problems: list[tuple[str, str]] = []
    config = _build(cls, tree, "", problems)
    if problems:
        raise ConfigError(problems)
    return config


def _build(cls: type, tree: Any, prefix: str, problems: list) -> Any:
    if not isinstance(tree, dict):
        problems.append((prefix.rstrip(".") or "<root>", "must be a mapping"))
        return cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    field_hints = hints(cls)
    values = {}
    for key, raw in tree.items():
        name = FIELD_NAMES.get(key, key)
        path = prefix + str(key)
        if path in REMOVED_KEYS:  # null, as the resolved config.yaml of an older run holds it, asks for nothing
            if raw is not None:
                problems.append((path, REMOVED_KEYS[path]))
            continue
        if name not in fields:
            problems.append((path, f"unknown key; known keys: {', '.join(sorted(YAML_NAMES.get(n, n) for n in fields))}"))
            continue
        hint = field_hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw, path + ".", problems)
        else:
            coerced, error = _coerce(raw, hint)
            if error:
                problems.append((path, error))
            else:
                values[name] = coerced
    return cls(**values)


def _coerce(value: Any, hint: Any) -> tuple[Any, str | None]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None, None
        inner = [a for a in args if a is not type(None)]
        for hint in inner[:-1]:  # the first type the value is (int | str: an id, or a name)
            coerced, error = _coerce(value, hint)
            if error is None:
                return coerced, None
        return _coerce(value, inner[-1])
    if hint is bool:
        return (value, None) if isinstance(value, bool) else (None, f"expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        return None, f"expected an integer, got {value!r}"
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 2**1023 else math.inf
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number, None
        return None, f"expected a finite number, got {value!r}"
    if hint is str:  # an empty string would be a path to the working directory, or a silent "unset"
        if value == "":
            return None, "expected a non-empty string (null unsets a key that may be unset)"
        return (value, None) if isinstance(value, str) else (None, f"expected a string, got {value!r}")
    if origin is tuple and args[0] is dict:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, dict) for v in value):
            return None, f"expected a list of mappings, got {value!r}"
        return tuple(dict(v) for v in value), None
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            return None, f"expected a list of non-empty strings, got {value!r}"
        return tuple(value), None
    if hint is dict or origin is dict:
        return (dict(value), None) if isinstance(value, dict) else (None, f"expected a mapping, got {value!r}")
    return value, None
