"""LoRA on a model of the user's: `lora.targets` name its parameters by path (`blocks/mlp/w1`, globs too).

nestor cannot reach into a user's matmuls, so each targeted weight W [lead..., in..., out] (lead: the
dimensions named by a stack or experts; out: the last) gets its adapter beside the params, under the entry
`lora` of the params tree at W's path, A [lead..., in..., rank] and B [lead..., rank, out], named with W's
logical axes and the replicated rank (models.axes.LORA_RANK), and the step hands the model W + scale A B
(models.lora.update). That merged weight is formed, and differentiated, one weight at a time as the model
reads it; nestor's LM adapts its projections beside the weight instead (models.lora).
"""

from __future__ import annotations

import fnmatch
import math
import zlib

import jax
import jax.numpy as jnp

from nestor.models import axes
from nestor.models.lora import update
from nestor.orchestrator.config.schema import Config
from nestor.orchestrator.errors import ConfigError

KEY = "lora"  # the params' entry holding a user model's adapters
LEAD = {axes.LAYERS, axes.DENSE_LAYERS, axes.EXPERT}  # leading dimensions an adapter stacks along


def _flat(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    flat = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, (*prefix, name)))
        else:
            flat[(*prefix, name)] = value
    return flat


def nest(flat: dict[tuple, object]) -> dict:
    """Returns the nested dicts of a {path tuple: leaf} mapping."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def _split(names: tuple) -> int:
    """Returns how many leading dimensions of a weight named `names` are stacked (LEAD)."""
    lead = 0
    while lead < len(names) and names[lead] in LEAD:
        lead += 1
    return lead


def adapter_layout(config: Config, logical: dict, shapes: dict) -> tuple[dict, dict]:
    """Returns (logical axes, shapes) of the adapters of the parameters `lora.targets` names, nested as
    the params; raises ConfigError naming lora.targets for a target that names no weight."""
    names, sizes = _flat(logical), {path: leaf.shape for path, leaf in _flat(shapes).items()}
    rank, problems = config.lora.rank, []
    adapter_axes, adapter_shapes = {}, {}
    for target in config.lora.targets:
        matched = [path for path in names if fnmatch.fnmatchcase("/".join(path), target)]
        weights = [path for path in matched if len(sizes[path]) - _split(names[path]) >= 2]
        if not weights:
            shown = ", ".join("/".join(path) for path in list(names)[:8])
            problems.append(("lora.targets", f"{target!r} names no weight matrix of {config.model.class_} (its "
                                             f"parameters: {shown}{', ...' if len(names) > 8 else ''})"))
        for path in weights:
            lead = _split(names[path])
            shape, named = sizes[path], names[path]
            adapter_axes[path] = {"a": (*named[:-1], axes.LORA_RANK), "b": (*named[:lead], axes.LORA_RANK, named[-1])}
            adapter_shapes[path] = {"a": jax.ShapeDtypeStruct((*shape[:-1], rank), jnp.float32),
                                    "b": jax.ShapeDtypeStruct((*shape[:lead], rank, shape[-1]), jnp.float32)}
    if problems:
        raise ConfigError(problems)
    return nest(adapter_axes), nest(adapter_shapes)


def init_adapters(config: Config, adapter_shapes: dict, adapter_logical: dict) -> dict:
    """Returns fresh adapters: A uniform within 1/sqrt(fan-in) from run.seed and the weight's path, B zero."""
    key = jax.random.key(config.run.seed)
    names = _flat(adapter_logical)

    def init(path: tuple[str, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        if path[-1] == "b":
            return jnp.zeros(leaf.shape, leaf.dtype)
        lead = _split(names[path])
        bound = 1 / math.sqrt(math.prod(leaf.shape[lead:-1]))
        salt = zlib.crc32("/".join(path).encode()) & 0x7FFFFFFF
        return jax.random.uniform(jax.random.fold_in(key, salt), leaf.shape, leaf.dtype, -bound, bound)

    return nest({path: init(path, leaf) for path, leaf in _flat(adapter_shapes).items()})


def merged(params: dict, scale: float) -> dict:
    """Returns the params without their `lora` entry, each adapted weight with scale A B added (float32)."""
    if KEY not in params:
        return params
    adapters = _flat(params[KEY])
    flat = _flat({name: value for name, value in params.items() if name != KEY})
    for path in {path[:-1] for path in adapters}:
        a, b = adapters[(*path, "a")], adapters[(*path, "b")]
        flat[path] = flat[path] + update(a, b, scale, b.ndim - 2)
    return nest(flat)

