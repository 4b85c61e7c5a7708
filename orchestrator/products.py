"""Counts that are products of config keys: tokens per step and per evaluation, and an MoE layer's routed
tokens and expert slots. Each is held to INT32_MAX, as every count a key holds is, and is checked here in
Python integers before the program computes it: the MoE layers index slots and routed tokens in int32."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nestor.models.moe import expert_capacity
from nestor.orchestrator.config_keys import INT32_MAX

if TYPE_CHECKING:  # the config is read, never built, here
    from nestor.orchestrator.config import Config

TOKENS_KEY = "train.global_batch, train.seq_len"


def product_problems(config: Config) -> list[tuple[str, str]]:
    """Returns (key path, message) for each product of keys past INT32_MAX in a step of nestor's LM: its
    tokens, and its MoE layers' routed tokens and slots."""
    t = config.train
    step = t.global_batch * (t.seq_len + 1)  # a row of tokens holds its last target too
    if config.model.builtin_lm and step > INT32_MAX:
        return [(TOKENS_KEY, f"train.global_batch x (train.seq_len + 1) = {step:,} tokens a step, more than "
                             f"{INT32_MAX:,}; use a smaller batch or shorter sequences")]
    if config.model.builtin_lm and config.moe.num_experts and config.moe.every:
        return _moe_products(config)
    return []


def evaluation_problems(config: Config) -> list[tuple[str, str]]:
    """Returns (eval.steps, message) when an evaluation's tokens (rows for a model of the user's), eval.steps
    batches of a step's, pass INT32_MAX, else nothing."""
    t, lm = config.train, config.model.builtin_lm
    step = t.global_batch * (t.seq_len + 1 if lm else 1)
    evaluation = config.eval.steps * step
    if evaluation <= INT32_MAX:
        return []
    return [("eval.steps", f"{config.eval.steps:,} batches of {step:,} {'tokens' if lm else 'rows'} = "
                           f"{evaluation:,} an evaluation, more than {INT32_MAX:,}; use eval.steps <= "
                           f"{INT32_MAX // step:,}")]


def _moe_products(config: Config) -> list[tuple[str, str]]:
    """The MoE layers' int32 indices: top_k choices of a step's tokens, and each group's expert slots
    (moe.num_experts x the capacity of each capacity factor; none when dropless)."""
    moe, t = config.moe, config.train
    routed = moe.top_k * t.global_batch * t.seq_len
    if routed > INT32_MAX:
        return [("moe.top_k", f"{moe.top_k} choices for each of the {t.global_batch * t.seq_len:,} tokens of a step "
                              f"= {routed:,} routed tokens, more than {INT32_MAX:,}; route fewer or shorten the step")]
    problems = []
    tokens_per_group = moe.group_size or t.seq_len
    for name in ("capacity_factor", "eval_capacity_factor") if moe.capacity_factor else ():  # 0: dropless
        factor = getattr(moe, name)
        slots = moe.num_experts * expert_capacity(tokens_per_group, moe.num_experts, moe.top_k, factor)
        if slots > INT32_MAX:
            most = INT32_MAX / (moe.top_k * tokens_per_group)
            problems.append((f"moe.{name}", f"{factor:g} gives a group's {moe.num_experts} experts {slots:,} slots, "
                                            f"more than {INT32_MAX:,}; use at most {most:.4g} (above "
                                            f"moe.num_experts / moe.top_k = {moe.num_experts / moe.top_k:g} no "
                                            "token is ever dropped)"))
    return problems
