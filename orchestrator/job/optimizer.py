"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from nestor.models import axes
from nestor.orchestrator.config.schema import Config
from nestor.parallel.rules import is_logical_axes


@dataclasses.dataclass(frozen=True)
class LearningRateSchedule:
    """step -> lr: linear warmup to `lr` (step 0 already moves), cosine decay to
    `lr * min_lr_ratio` at `decay_steps`, then that floor."""

    lr: float
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float

    @classmethod
    def of(cls, tree: dict) -> "LearningRateSchedule":
        """Returns the schedule a config gives, read from its plain data (`Config.to_dict()` or a
        checkpoint's `config` item); `optimizer.decay_steps` null (or absent) means `train.steps`."""
        opt = tree["optimizer"]
        decay_steps = opt.get("decay_steps") or tree["train"]["steps"]
        # Without an explicit decay_steps a run shorter than its warmup warms up for the whole run.
        return cls(float(opt["lr"]), min(opt["warmup_steps"], decay_steps), decay_steps, float(opt["min_lr_ratio"]))

    def __call__(self, step):
        step = jnp.asarray(step, jnp.float32)
        peak, floor = self.lr, self.lr * self.min_lr_ratio
        warm = peak * (step + 1) / max(self.warmup_steps, 1)
        progress = (step - self.warmup_steps) / max(self.decay_steps - self.warmup_steps, 1)
        cosine = floor + 0.5 * (peak - floor) * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < self.warmup_steps, warm, jnp.where(step < self.decay_steps, cosine, floor))


def learning_rate(config: Config) -> LearningRateSchedule:
    """Returns the run's step -> lr schedule (see LearningRateSchedule)."""
    return LearningRateSchedule.of(config.to_dict())


def schedule_change(saved: dict, config: Config, step: int) -> str | None:
    """Returns one line naming how `config`'s learning-rate schedule differs from the one of `saved`
    (the config a checkpoint of `step` was written with), old -> new, and the lr the next step gets
    under each; None when the schedules are the same."""
    old, new = LearningRateSchedule.of(saved), learning_rate(config)
    if old == new:
        return None
    follows_steps = config.optimizer.decay_steps is None
    changes = []
    for field in dataclasses.fields(LearningRateSchedule):
        before, after = getattr(old, field.name), getattr(new, field.name)
        if before != after:
            source = " (null: follows train.steps)" if field.name == "decay_steps" and follows_steps else ""
            changes.append(f"optimizer.{field.name} {before:g} -> {after:g}{source}")
    keep = (f"; optimizer.decay_steps={old.decay_steps} keeps the checkpoint's schedule length"
            if follows_steps and old.decay_steps != new.decay_steps else "")
    return (f"learning-rate schedule differs from checkpoint {step}'s: {', '.join(changes)}; "
            f"step {step + 1} gets lr {float(old(step)):.2e} under the checkpoint's schedule, "
            f"{float(new(step)):.2e} under this run's{keep}")


def _decay_mask(logical_tree):
    # Norm scales and biases are not decayed: shrinking a norm's scale only fights the normalisation, and
    # a bias scales no input.
    return jax.tree.map(lambda names: axes.NORM not in names and axes.BIAS not in names, logical_tree,
                        is_leaf=is_logical_axes)


def make_optimizer(config: Config, logical_tree) -> optax.GradientTransformation:
    """Returns the optax chain: clip by global norm (identity when 0), then AdamW on the schedule.

    The chain has the same state tree whatever the values, so a run may change
    `optimizer.*` when it resumes from a checkpoint.
    """
    opt = config.optimizer
    adamw = optax.adamw(learning_rate(config), b1=opt.b1, b2=opt.b2, eps=opt.eps,
                        weight_decay=opt.weight_decay, mask=_decay_mask(logical_tree))
    clip = optax.clip_by_global_norm(opt.clip_norm) if opt.clip_norm > 0 else optax.identity()
    return optax.chain(clip, adamw)
