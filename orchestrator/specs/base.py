"""The interface every model answers through (`ModelSpec`); its defaults are those of a model nestor knows
nothing of beyond the task contract (models.task)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flax import nnx

from nestor.models import axes
from nestor.parallel.pipeline import Schedule

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config.schema import Config

Problems = list[tuple[str, str]]  # (key path, message)


class ModelSpec:
    """What the orchestrator asks of a model. The defaults: batches are rows of named arrays, XLA's cost
    analysis counts its FLOPs, it has no decoding and no Hugging Face architecture, and its parameters are
    checked against the mesh once it is built (orchestrator.job.state)."""

    counts_tokens = False   # its rows are tokens: rates, int32 limits and evaluation summaries count tokens
    decodes = False         # `nestor sample` and `nestor logits` run it
    hugging_face = False    # `nestor export` and `model.init_from` map its parameters
    layout_checked = True   # its parameters' names and shapes are checked against the mesh once built
    splits_rows = False     # known to read the sequence layout where mesh.context splits rows (else traced to see)

    def build(self, config: Config, rngs: nnx.Rngs) -> nnx.Module:
        """Returns the model, freshly initialised. Raises ConfigError naming the keys that cannot build it."""
        raise NotImplementedError

    def user_code(self, config: Config) -> list[str]:
        """Returns the import paths of the user's code that builds it (shipped to a remote cluster's workers)."""
        return []

    def key_problems(self, config: Config) -> Problems:
        """Returns the problems of its keys alone (the key table's ranges hold)."""
        return []

    def mesh_problems(self, config: Config, degrees: dict[str, int] | None) -> Problems:
        """Returns the problems of its keys against the mesh `degrees` (None while a -1 axis waits for the
        device count, or while other keys have problems): asked after the mesh's own checks."""
        return []

    def chosen_keys(self, config: Config, degrees: dict[str, int]) -> list[tuple[str, Any, str]]:
        """Returns (dotted key, value, why) for each key the run left unset that the model chooses for the mesh
        `degrees` (asked once the mesh's own checks hold); none by default."""
        return []

    def split_problems(self, config: Config, degrees: dict[str, int]) -> Problems:
        """Returns the problems of splitting its dimensions and the batch over the known mesh `degrees`."""
        return []

    def rule_axes(self) -> Any:
        """Returns the logical axes `mesh.rules` may name (None: any, the model names its own)."""
        return None

    def pipeline_units(self, config: Config, schedule: Schedule) -> tuple[int, str]:
        """Returns (the units its pipelined stack holds, a note on how they are counted) for the schedule's
        checks; by default the schedule's own stages x repeats: the stack is checked once built."""
        return schedule.stages * schedule.repeats, ""

    def flops_per_step(self, config: Config) -> tuple[float, float] | None:
        """Returns the analytic (model, executed) FLOPs of a training step, else None (XLA's count alone)."""
        return None

    def size_key(self, logical_axis: str | None) -> str:
        """Returns the config key that sizes parameters along `logical_axis` (for an out-of-memory message)."""
        return "model.args"

    def checkpoint_shape_keys(self, current: dict, saved: dict) -> list[tuple[str, str]] | None:
        """Returns the (section, key) pairs whose values shape the arrays of a checkpoint written with the
        config `saved`, compared before launch; None leaves the comparison to the workers' restore."""
        return None

    def activation_axes(self, ndim: int) -> tuple[str | None, ...]:
        """Returns the logical axes of its pipelined stack's input and output, `ndim` dimensions: rows split
        as the batch, the rest whole."""
        return (axes.BATCH,) + (None,) * (ndim - 1)

    def idle_modes(self, config: Config) -> list[tuple[tuple[str, ...], str]]:
        """Returns (keys, why) for keys that this config of the model leaves unused (orchestrator.loader.idle_keys)."""
        return []

    def dropless_layers(self, config: Config) -> bool:
        """Whether it may hold dropless MoE layers, whose grouped matmuls the backend chooses."""
        return True
