"""The devices a compile is meant for when they are not here: a deviceless topology of a named GPU or TPU
slice, compiled by the target's own XLA.

A GPU target is a `GpuTargetConfig` text proto shipped in gpu_targets/ (numbers from NVIDIA's spec sheets),
compiled by XLA:GPU from the `jax-cuda12-plugin` wheel without CUDA (`pip install nestor[gpu-compile]`); a
TPU slice is a topology libtpu knows (`pip install nestor[tpu-compile]`), as MaxText's train_compile and
axlearn's AOT tool build it. Without the extra the caller compiles with XLA:CPU standing in, and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
from pathlib import Path

from nestor.backend import BackendError, entry_named

GPU_TARGET_DIR = Path(__file__).parent / "gpu_targets"
GPU_TARGETS = ("h100", "h200", "b200", "a100")  # gpu_targets/<name>.textproto
GPU_PACKAGE, TPU_PACKAGE, CUDNN_PACKAGE = "jax-cuda12-plugin", "libtpu", "nvidia-cudnn-cu12"


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A TPU generation as libtpu names its slices: `topologies[chips]` is the chip grid of a slice."""

    prefix: str            # libtpu's name of the generation in a topology ("v5:4x4x4")
    chip_config: str       # megacore: one device per chip of two cores; default: one core per chip
    topologies: dict[int, str]


_TWO_D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
# Chip grids of Google Cloud's slice shapes (cloud.google.com/tpu/docs/v5p, v5e, v6e: "accelerator types").
TPU_SLICES = {
    "tpu-v5p": TpuSlice("v5", "megacore", {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4",
                                           128: "4x4x8", 256: "4x8x8", 512: "8x8x8"}),
    "tpu-v5e": TpuSlice("v5e", "default", _TWO_D),
    "tpu-v6e": TpuSlice("v6e", "default", _TWO_D),
}
# The words that name each target in a device kind (backend.entry_named)
_TARGET_WORDS = [(("h100",), "h100"), (("h200",), "h200"), (("b200",), "b200"), (("a100", "80gb"), "a100"),
                 (("tpu", "v5p"), "tpu-v5p"), (("tpu", "v5"), "tpu-v5p"), (("tpu", "v5e"), "tpu-v5e"),
                 (("tpu", "v5", "lite"), "tpu-v5e"), (("tpu", "v6e"), "tpu-v6e"), (("tpu", "v6", "lite"), "tpu-v6e")]


@dataclasses.dataclass(frozen=True)
class TargetDevices:
    """The devices a compile for a target uses (deviceless ones of its platform, or None: the devices present)
    and the compiler that compiles for them, named for reports."""

    target: str
    devices: list | None
    compiler: str


def target_name(device_kind: str | None) -> str | None:
    """Returns the shipped target `device_kind` names (GPU_TARGETS or TPU_SLICES), or None."""
    return entry_named(device_kind, _TARGET_WORDS)


def _extra(target: str) -> tuple[str, str]:
    """Returns (the extra that installs `target`'s compiler, the package it brings)."""
    return ("tpu-compile", TPU_PACKAGE) if target in TPU_SLICES else ("gpu-compile", GPU_PACKAGE)


def installed_version(package: str) -> str | None:
    """Returns the installed version of `package`, else None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def compiler_version(target: str) -> str | None:
    """Returns the version of `target`'s compiler package when installed, else None."""
    return installed_version(_extra(target)[1])


@functools.cache
def cudnn_installed() -> bool:
    """Whether cuDNN's wheel is installed: deviceless XLA:GPU lowers cuDNN's attention only with it (it asks
    the library for its version)."""
    return bool(installed_version(CUDNN_PACKAGE))


def compiler_identity(device_kind: str | None) -> str:
    """Returns what names the compiler of a deviceless compile for `device_kind` beside its program (a key
    of kept figures): the shipped target, its compiler's and cuDNN's versions, and a GPU target's description."""
    target = target_name(device_kind)
    proto = GPU_TARGET_DIR / f"{target}.textproto"
    return "\0".join([str(target), str(target and compiler_version(target)), str(installed_version(CUDNN_PACKAGE)),
                       proto.read_text() if target and proto.is_file() else ""])


def standing_in(target: str) -> str:
    """Returns the report's name of an XLA:CPU compile for `target` whose own compiler is not installed."""
    return f"XLA:CPU standing in for {target}: install nestor[{_extra(target)[0]}] for the target's compiler"


def _gpu_devices(target: str, hosts: int, devices_per_host: int) -> list:
    """Returns `hosts` x `devices_per_host` deviceless GPUs of `target`, a process per host."""
    from jax.experimental import topologies

    # the plugin checks the CUDA libraries' versions as it loads; compiling needs none of them
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    proto = (GPU_TARGET_DIR / f"{target}.textproto").read_text()
    topology = topologies.get_topology_desc(f"{target}x{hosts * devices_per_host}", "cuda", target_config=proto,
                                            topology=f"1x{hosts}x{devices_per_host}")
    return list(topology.devices)


_CHIPS_PER_HOST = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}  # a TPU host's chip grid by its chip count


def _tpu_devices(target: str, hosts: int, chips_per_host: int, slices: int) -> list:
    """Returns the chips of `slices` deviceless TPU slices of `target`, `hosts` x `chips_per_host` in all.
    Raises BackendError when a slice's or a host's chip count is not one of the shapes known here."""
    from jax.experimental import topologies

    kind, chips = TPU_SLICES[target], hosts * chips_per_host
    per_slice = chips // slices
    if chips % slices or per_slice not in kind.topologies:
        raise BackendError("cluster.hosts", f"{chips} {target} chips in {slices} slice(s) (mesh.dcn): a slice of "
                                            f"{target} has one of {sorted(kind.topologies)} chips; change "
                                            "cluster.hosts or cluster.devices_per_host")
    if chips_per_host not in _CHIPS_PER_HOST:
        raise BackendError("cluster.devices_per_host", f"{chips_per_host} chips per {target} host; a TPU host has "
                                                       f"one of {sorted(_CHIPS_PER_HOST)}")
    name = f"{kind.prefix}:{kind.topologies[per_slice]}"
    topology = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name=kind.chip_config,
                                            chips_per_host_bounds=_CHIPS_PER_HOST[chips_per_host], num_slices=slices)
    return list(topology.devices)


def target_devices(device_kind: str | None, present: str, hosts: int, devices_per_host: int,
                   slices: int = 1) -> TargetDevices:
    """Returns the devices a compile for `device_kind` (cluster.device_kind) uses and its compiler's name,
    where jax here has `present` devices (a platform family: cpu, gpu, tpu): the deviceless topology of
    the target it names, `hosts` x `devices_per_host` of them (TPU chips in `slices` slices), when the
    target's compiler is installed; else no devices (None: the devices present, compiled by their XLA,
    standing in for the target's). Raises BackendError for `devices_per_host` -1 (all) or a TPU slice of a
    shape libtpu does not know."""
    target = target_name(device_kind)
    family = None if target is None else "tpu" if target in TPU_SLICES else "gpu"
    if family is None or family == present:
        named = f"XLA:{present.upper()} (the devices present)"
        if device_kind and present == "cpu" and not device_kind.lower().startswith("cpu"):
            named = (f"XLA:CPU standing in for {device_kind}: nestor ships targets for "
                     f"{', '.join('a100-80gb' if name == 'a100' else name for name in GPU_TARGETS)}, "
                     f"{', '.join(TPU_SLICES)}")
        return TargetDevices(target or present, None, named)
    version = compiler_version(target)
    if version is None:
        return TargetDevices(target, None, standing_in(target))
    if devices_per_host == -1:
        raise BackendError("cluster.devices_per_host", f"-1 (all the devices present) counts none of {target}'s; "
                           f"name how many each host has (8 for a GPU node, 4 for a TPU host)")
    count = hosts * devices_per_host
    if family == "tpu":
        return TargetDevices(target, _tpu_devices(target, hosts, devices_per_host, slices),
                             f"XLA:TPU ({TPU_PACKAGE} {version}, deviceless, {target} x{count} in {slices} slice(s))")
    return TargetDevices(target, _gpu_devices(target, hosts, devices_per_host),
                         f"XLA:GPU ({GPU_PACKAGE} {version}, deviceless, {target} target)")


def is_deviceless(device) -> bool:
    """True for a device of a topology built here (`target_devices`), not one jax can run on."""
    import jax

    return device.platform != jax.devices()[0].platform
