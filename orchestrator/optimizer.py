"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from models import axes
from orchestrator.config import Config
from parallel.rules import is_logical_axes


def learning_rate(config: Config) -> optax.Schedule:
    """Returns step -> lr: linear warmup to `optimizer.lr` (step 0 already moves),
    then cosine decay to `lr * min_lr_ratio` at `train.steps`."""
    opt, steps = config.optimizer, config.train.steps
    warmup = min(opt.warmup_steps, steps)
    peak, floor = opt.lr, opt.lr * opt.min_lr_ratio

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1) / max(warmup, 1)
        progress = jnp.clip((step - warmup) / max(steps - warmup, 1), 0.0, 1.0)
        cosine = floor + 0.5 * (peak - floor) * (1 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warmup, warm, cosine)

    return schedule


def _decay_mask(logical_tree):
    # Norm scales are not decayed: shrinking them only fights the normalisation.
    return jax.tree.map(lambda names: axes.NORM not in names, logical_tree, is_leaf=is_logical_axes)


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
