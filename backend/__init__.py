"""The backend: every choice that depends on the platform, made once, in one place.

`resolve_backend(request, platform, device_kind)` reads the target a run (or an
`explain`) is meant for: `cluster.accelerator` when it names one, else the
platform of `cluster.device_kind`, else the devices present. The request
(`BackendRequest`) is what the orchestrator reads for it from the run config and
the model: the backend never sees the config. From the target, the dtype and the
request's `auto` choices it decides the remat policy, the ops the
model's layers call (models.ops: matmuls, attention, SwiGLU, grouped matmuls),
the expert exchange of dropless MoE layers and the pipeline's loop. Nothing
else in nestor reads the platform: models and pipelines take the ops and
strategies they are given.

Where the program is compiled on other devices than the target's (`nestor
explain` on a CPU for an H100), the report names the target's choices, and
the compile substitutes the plain op for a kernel the compiling devices cannot
lower (`Backend.compiled_here`, listed in `substitutions`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

from nestor.backend import fp8, remat
from nestor.backend.mosaic_gpu import grouped_matmul_op, kernel_problem
from nestor.backend.xla_cpu import ops_from_float32_sums
from nestor.models import ops as model_ops
from nestor.parallel.experts import ALL_GATHER, RAGGED_ALL_TO_ALL
from nestor.parallel.pipeline import BUFFERED, PER_STAGE_SKIPPING, PipelineLoop

ACCELERATORS = ("gpu", "tpu")
ATTENTION_CHOICES = ("auto", "xla", "cudnn")  # model.attention
GROUPED_MATMUL_CHOICES = ("auto", "xla", "mosaic_gpu")  # moe.grouped_matmul
EXCHANGE_CHOICES = {"all_gather": ALL_GATHER, "ragged_all_to_all": RAGGED_ALL_TO_ALL}  # moe.exchange (and auto)
_LOW_PRECISION = ("bfloat16", "float16")
# Backend.for_flop_count's grouped matmuls: every one counted as a grouped GEMM, or those the kernels tile
COUNTED_AS_GROUPED_GEMM = "counted as grouped GEMMs"
COUNTED_WHERE_KERNELS_TILE = "counted as grouped GEMMs where the kernels tile"
GROUPED_MATMUL_NAMES = {"none": "none (no dropless layer)", "xla": "jax.lax.ragged_dot", "mosaic_gpu": "Mosaic GPU kernels",
                        "mosaic_gpu_or_xla": "Mosaic GPU kernels where they tile, else jax.lax.ragged_dot",
                        COUNTED_AS_GROUPED_GEMM: "rows times one group's weights (FLOPs of grouped GEMMs)",
                        COUNTED_WHERE_KERNELS_TILE: "rows times one group's weights where the kernels tile, else "
                                                    "jax.lax.ragged_dot"}
_HOPPER_WORDS = ("h100", "h200", "h800", "gh200")  # NVIDIA Hopper (compute capability 9.x) device kinds


@dataclasses.dataclass(frozen=True)
class BackendRequest:
    """What a run asks of the backend: its target and the choices of its config keys, named as the keys,
    and whether its model may hold dropless MoE layers (the orchestrator asks the model)."""

    accelerator: str                  # cluster.accelerator: cpu (the devices present decide) | gpu | tpu
    device_kind: str | None           # cluster.device_kind: the target's device when named
    dtype: str                        # model.dtype
    remat: str                        # model.remat
    remat_names: tuple[str, ...]      # model.remat_names
    attention: str                    # model.attention
    matmul_precision: str             # model.matmul_precision
    context_attention: str            # model.context_attention
    context_balance: bool             # model.context_balance
    grouped_matmul: str               # moe.grouped_matmul
    exchange: str                     # moe.exchange
    dropless_layers: bool             # the model may hold dropless MoE layers


class BackendError(ValueError):
    """A config asks for something its target cannot run: `key` is the config key to change."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


def grouped_gemm_flops(rows, weights, group_sizes):
    """Returns rows [M, K] times the first group's weights [K, N]: the FLOPs of a grouped GEMM (each row
    multiplied once, forward and backward), for a program compiled only to be counted; the values are
    not the grouped product's."""
    del group_sizes
    return rows @ weights[0]


def grouped_gemm_flops_where_kernels_tile(rows, weights, group_sizes):
    """Returns `grouped_gemm_flops` where the Mosaic GPU kernels take the shapes, else ragged_dot (what
    `mosaic_gpu_or_xla` runs there): for a program compiled only to be counted."""
    if kernel_problem(rows, weights) is None:
        return grouped_gemm_flops(rows, weights, group_sizes)
    return model_ops.ragged_dot(rows, weights, group_sizes)


def platform_family(platform: str) -> str:
    """Returns `cpu`, `gpu` or `tpu` for a jax platform name (cuda and rocm are GPUs)."""
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def target_of(request: BackendRequest, platform: str) -> str:
    """Returns the platform family a run is meant for: `cluster.accelerator` when it names one, else that
    of a named `cluster.device_kind` (`tpu...`: tpu, any other: gpu), else that of `platform`, the devices'."""
    if request.accelerator != "cpu":
        return request.accelerator
    if request.device_kind:
        return "tpu" if request.device_kind.lower().startswith("tpu") else "gpu"
    return platform_family(platform)


def is_hopper(device_kind: str | None, compute_capability: str | None = None) -> bool:
    """True for an NVIDIA Hopper GPU: compute capability 9.x when known, else a Hopper name in `device_kind`."""
    if compute_capability:
        return str(compute_capability).split(".")[0] == "9"
    return bool(_words(device_kind) & set(_HOPPER_WORDS))


def _words(device_kind: str | None) -> set[str]:
    """Returns the lower-case words of a device kind ("NVIDIA H100 80GB HBM3": nvidia, h100, 80gb, hbm3)."""
    return set(re.split(r"[\s_-]+", (device_kind or "").lower()))


def entry_named(device_kind: str | None, table) -> str | None:
    """Returns the entry of `table` ((words, entry) pairs) whose words are all words of `device_kind` (as a
    user writes it, "a100-80gb", or as jax reports it, "NVIDIA A100-SXM4-80GB"), the one with most words
    winning, or None."""
    words = _words(device_kind)
    matches = [(len(needed), entry) for needed, entry in table if set(needed) <= words]
    return max(matches)[1] if matches else None


@dataclasses.dataclass(frozen=True)
class Backend:
    """The platform-dependent choices of one run, for its `target` (cpu | gpu | tpu); `platform` is the
    family of the devices the program is compiled on."""

    target: str
    platform: str
    device_kind: str | None
    remat: str             # remat.POLICIES
    remat_names: tuple[str, ...]
    attention: str         # xla | cudnn | float32 sums
    float32_sums: bool     # weight matmuls and SwiGLU from float32 sums (bfloat16 on XLA:CPU)
    grouped_matmul: str    # mosaic_gpu.IMPLEMENTATIONS
    exchange: str          # ALL_GATHER | RAGGED_ALL_TO_ALL
    pipeline_loop: PipelineLoop
    matmul_precision: str = "bfloat16"  # bfloat16 | fp8 (backend.fp8)
    context_attention: str = "all_gather"  # parallel.context.STRATEGIES, where mesh.context splits rows
    context_balance: bool = True  # parallel.context.SequenceLayout.balanced
    substitutions: tuple[str, ...] = ()  # what `compiled_here` changed, for reports
    deviceless: bool = False  # compiled for a target's topology without its devices (backend.targets)

    def ops(self) -> model_ops.Ops:
        """Returns the ops the model's layers get (install with models.ops.installed)."""
        base = ops_from_float32_sums() if self.float32_sums else model_ops.PLAIN
        names = dict(base.names)
        attention = base.attention
        if self.attention in ("xla", "cudnn"):
            attention = functools.partial(model_ops.dot_product_attention, implementation=self.attention)
            names["attention"] = f"jax.nn.dot_product_attention ({self.attention})"
        names["grouped_matmul"] = GROUPED_MATMUL_NAMES[self.grouped_matmul]
        counting = {COUNTED_AS_GROUPED_GEMM: grouped_gemm_flops,
                    COUNTED_WHERE_KERNELS_TILE: grouped_gemm_flops_where_kernels_tile, "none": model_ops.ragged_dot}
        grouped = counting.get(self.grouped_matmul) or grouped_matmul_op(self.grouped_matmul)
        chosen = dataclasses.replace(base, attention=attention, grouped_matmul=grouped, names=names)
        if self.matmul_precision != "fp8":
            return chosen
        # grouped matmuls in float8 where jax.lax.ragged_dot runs them; the Mosaic GPU kernels stay bfloat16
        return fp8.ops_in_fp8(chosen, grouped=self.grouped_matmul == "xla")

    def remat_policy(self) -> Any:
        """Returns the `jax.checkpoint` policy of the stacked units (None: keep everything)."""
        return remat.policy(self.remat, self.remat_names)

    def compiled_here(self) -> Backend:
        """Returns this backend with each kernel the compiling devices (`platform`) cannot lower replaced by
        the plain op of the same math, each replacement named in `substitutions`."""
        if self.platform == self.target and not self.deviceless:
            return self
        from nestor.backend.targets import cudnn_installed  # it imports BackendError from here

        changes: dict[str, Any] = {}
        notes = []
        # cuDNN's attention asks the library for its version as it lowers: without a GPU, from cuDNN's wheel
        if self.attention == "cudnn" and (self.platform != "gpu" or self.deviceless and not cudnn_installed()):
            changes["attention"] = "xla"
            notes.append("attention: cudnn compiled as xla" + (" (cuDNN is not installed: nvidia-cudnn-cu12)"
                                                               if self.platform == "gpu" else ""))
        if self.grouped_matmul in ("mosaic_gpu", "mosaic_gpu_or_xla") and self.platform != "gpu":
            changes["grouped_matmul"] = "xla"
            notes.append("grouped matmuls: Mosaic GPU kernels compiled as jax.lax.ragged_dot, FLOPs counted as "
                         "the kernels run them")
        elif self.grouped_matmul in ("mosaic_gpu", "mosaic_gpu_or_xla") and self.deviceless:
            changes["grouped_matmul"] = "xla"  # the weights' gradient kernel asks jax.devices() for its SM count
            notes.append("grouped matmuls: Mosaic GPU kernels compiled as jax.lax.ragged_dot (they read the "
                         "device's SM count)")
        if self.exchange == RAGGED_ALL_TO_ALL and self.platform not in ACCELERATORS:
            changes["exchange"] = ALL_GATHER
            notes.append(f"expert exchange: {RAGGED_ALL_TO_ALL} compiled as {ALL_GATHER}")
        if self.remat == "offload" and self.platform not in ACCELERATORS:
            changes["remat"] = "minimal"
            notes.append("remat: offload compiled as minimal (no device memory apart from the host's)")
        return dataclasses.replace(self, **changes, substitutions=tuple(notes)) if changes else self

    def widens_what_the_target_does_not(self) -> bool:
        """Whether this compile runs 16-bit float ops in float32, with converts around each, where the target
        runs them as they are: XLA:CPU compiling for a GPU or TPU (explain leaves those converts out)."""
        return self.platform == "cpu" and self.target != "cpu"

    def for_flop_count(self) -> Backend | None:
        """Returns the backend of a program compiled only to count the target's FLOPs where the compiled one's
        count them otherwise, else None. The target's grouped GEMMs (Mosaic GPU kernels, XLA:TPU's ragged
        dot) multiply each row once; XLA:CPU's and XLA:GPU's ragged_dot multiply it by every group's weights,
        and XLA's cost analysis counts a kernel's custom call as nothing."""
        if self.grouped_matmul == "none":
            return None
        if self.target == "tpu" or self.grouped_matmul == "mosaic_gpu":
            counted = COUNTED_AS_GROUPED_GEMM
        elif self.grouped_matmul == "mosaic_gpu_or_xla":
            counted = COUNTED_WHERE_KERNELS_TILE
        else:
            return None  # ragged_dot on a GPU: every row times every group's weights, as XLA counts it
        compiled = self.compiled_here()
        if compiled.platform == "tpu":
            return None  # XLA:TPU counts its ragged dot as it runs it
        return dataclasses.replace(compiled, grouped_matmul=counted)

    def report(self) -> dict[str, Any]:
        """Returns explain's `backend` entry: the target, each choice made for it, and what a compile on
        `platform` substitutes."""
        names = self.ops().names
        return {"target": self.target, "device_kind": self.device_kind, "remat": self.remat,
                "attention": names["attention"], "matmuls": names["einsum"], "swiglu": names["swiglu"],
                "grouped_matmul": names["grouped_matmul"], "exchange": self.exchange,
                "pipeline_loop": self.pipeline_loop.name,
                "substitutions": list(self.compiled_here().substitutions)}


def _remat(request: BackendRequest, target: str) -> str:
    """Returns the remat policy of `model.remat` for `target`: `auto` is `dots` on accelerators (the fastest
    measured on an H100) and `full` on CPU (faster than keeping everything there; docs/benchmarks.md)."""
    name = request.remat
    if name == "auto":
        return "dots" if target in ACCELERATORS else "full"
    if name == "offload" and target not in ACCELERATORS:
        return "minimal"  # CPU has no device memory apart from the host's
    return name


def _attention(request: BackendRequest, target: str, context_devices: int) -> str:
    """Returns the attention of `model.attention` for `target`: `auto` is cuDNN flash attention on GPUs in
    bfloat16 or float16; bfloat16 on CPU computes it from float32 sums; else jax's xla implementation.
    Raises BackendError for cudnn off a GPU or with rows split by mesh.context."""
    choice, dtype = request.attention, request.dtype
    if choice == "cudnn" and target != "gpu":
        raise BackendError("model.attention", f"cudnn needs a GPU, the run is meant for {target}; use auto or xla")
    if choice == "cudnn" and context_devices > 1:
        raise BackendError("model.attention", "cudnn does not run attention over a row split by mesh.context (the "
                           "context attention computes its blocks itself, model.context_attention); use auto or xla")
    if target == "cpu" and dtype == "bfloat16":
        return "float32 sums"
    if choice == "auto":
        return "cudnn" if target == "gpu" and dtype in _LOW_PRECISION else "xla"
    return choice


def _grouped_matmul(request: BackendRequest, target: str, hopper: bool) -> str:
    """Returns the grouped matmuls of dropless layers: for `auto`, the Mosaic GPU kernels where each device's
    expert weights tile (else ragged_dot) on Hopper GPUs in bfloat16 or float16 (with fp8 too: the kernels
    stay bfloat16, XLA:GPU's ragged_dot being far slower), else ragged_dot. Raises BackendError when
    mosaic_gpu is asked for off a Hopper GPU or in float32."""
    choice, dtype = request.grouped_matmul, request.dtype
    if not request.dropless_layers:
        return "none"  # no grouped matmul runs
    kernels_run = target == "gpu" and hopper and dtype in _LOW_PRECISION
    if choice == "mosaic_gpu" and not kernels_run:
        raise BackendError("moe.grouped_matmul", f"mosaic_gpu needs a Hopper GPU and model.dtype bfloat16 or "
                           f"float16 (target: {target}, dtype {dtype}); use auto or xla")
    if choice == "auto":
        return "mosaic_gpu_or_xla" if kernels_run else "xla"
    return choice


def _exchange(request: BackendRequest, target: str) -> str:
    """Returns the expert exchange of `moe.exchange`: `auto` is the ragged all-to-all where XLA implements
    it (GPU, TPU). Raises BackendError for ragged_all_to_all on CPU, whose XLA lacks it."""
    choice = request.exchange
    if choice == "auto":
        return RAGGED_ALL_TO_ALL if target in ACCELERATORS else ALL_GATHER
    if choice == "ragged_all_to_all" and target not in ACCELERATORS:
        raise BackendError("moe.exchange", f"XLA on {target} has no ragged-all-to-all (GPU and TPU have it); "
                           "use auto or all_gather")
    return EXCHANGE_CHOICES[choice]


# NVIDIA GPUs with float8 tensor cores (compute capability 8.9+): Ada, Hopper, Blackwell device kinds
_FP8_GPU_WORDS = (*_HOPPER_WORDS, "l4", "l40", "l40s", "ada", "4090", "4080", "b100", "b200", "gb200", "b300",
                  "gb300", "blackwell", "5090", "5080")


def _matmul_precision(request: BackendRequest, target: str, device_kind: str | None, capability: str | None) -> str:
    """Returns `model.matmul_precision`. Raises BackendError for fp8 on a TPU (not built for it), or on a GPU
    whose compute capability (or, unknown, whose device kind) is not NVIDIA's 8.9 or above."""
    choice = request.matmul_precision
    if choice != "fp8":
        return choice
    if target == "tpu":
        raise BackendError("model.matmul_precision", "fp8 is built for NVIDIA GPUs of compute capability 8.9+ (and "
                           "emulated on CPU), not TPUs; use bfloat16")
    if target == "gpu":
        if capability:  # NVIDIA's "9.0"; ROCm reports a gfx name, and its float8 formats are others
            version = re.fullmatch(r"(\d+)(?:\.(\d+))?", str(capability))
            able = bool(version) and (int(version[1]), int(version[2] or 0)) >= (8, 9)
        else:
            able = device_kind is None or bool(_words(device_kind) & set(_FP8_GPU_WORDS))
        if not able:
            raise BackendError("model.matmul_precision", f"fp8 needs float8 tensor cores (compute capability 8.9+: "
                               f"Ada, Hopper, Blackwell); {device_kind or 'this GPU'} has none; use bfloat16")
    return choice


def resolve_backend(request: BackendRequest, platform: str, device_kind: str | None = None,
                    compute_capability: str | None = None, context_devices: int = 1) -> Backend:
    """Returns the backend of `request` for the devices present (jax `platform`, their `device_kind` and
    `compute_capability` when GPUs) on a mesh that splits rows over `context_devices`, its choices made for
    the run's target (`target_of`). Raises BackendError when the request asks for something the target
    cannot run."""
    platform = platform_family(platform)
    target = target_of(request, platform)
    kind = request.device_kind or (device_kind if platform != "cpu" else None)
    # the devices' own compute capability only where they are the target (no cluster.device_kind names another)
    capability = compute_capability if platform == "gpu" and not request.device_kind else None
    hopper = target == "gpu" and is_hopper(kind, capability)
    # Simulated CPU devices share the host's processors: a pipeline stage's skipped bubble gives its time to the
    # busy stages. An accelerator per stage would idle either way, and keeps the plain loop. XLA:CPU's
    # collective-permute meets every device of the program, so a permute inside a stage that the others skip
    # waits for them forever: with rows split over context (the ring's permutes, and those the partitioner
    # places to move MoE groups between context devices) every stage runs every iteration.
    loop = PER_STAGE_SKIPPING if target == "cpu" and context_devices == 1 else BUFFERED
    return Backend(target=target, platform=platform, device_kind=kind, remat=_remat(request, target),
                   remat_names=tuple(request.remat_names), attention=_attention(request, target, context_devices),
                   float32_sums=target == "cpu" and request.dtype == "bfloat16",
                   grouped_matmul=_grouped_matmul(request, target, hopper), exchange=_exchange(request, target),
                   pipeline_loop=loop, matmul_precision=_matmul_precision(request, target, kind, capability),
                   context_attention=request.context_attention, context_balance=request.context_balance)


def backend_of_devices(request: BackendRequest, devices, context_devices: int = 1) -> Backend:
    """Returns `resolve_backend` for the jax `devices` a run compiles on (their platform, device kind and,
    for GPUs, compute capability; deviceless where they are a target's topology), rows split over
    `context_devices`. Raises BackendError as resolve_backend does."""
    from nestor.backend.targets import is_deviceless  # it imports BackendError from here

    device = devices[0]
    backend = resolve_backend(request, device.platform, device.device_kind,
                              getattr(device, "compute_capability", None), context_devices)
    return dataclasses.replace(backend, deviceless=is_deviceless(device))
