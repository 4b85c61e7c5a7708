"""1F1B (PipeDream-Flush, arXiv 2006.09503; Megatron, arXiv 2104.04473) inside one SPMD program.

GPipe runs every forward before any backward, so a stage holds the residuals
of all M micro-batches. 1F1B starts a micro-batch's backward as soon as its
forward leaves the last stage, so a stage holds only those in flight. Here the
backward is written by hand inside the loop: each clock tick every stage runs
one forward and one backward, all stages at once under a `vmap` over the
stage dimension (sharded on the `stage` mesh axes, as in parallel.pipeline).

Tick t: stage s runs the forward of micro-batch t - s, its input taken from
stage s-1 (a collective-permute one way), and the backward of micro-batch
t - (2S-2-s), its output gradient taken from stage s+1 (a permute the other
way). The last stage's output goes through the loss head (`head_fn`: final
norm, unembedding, cross-entropy) in the same tick, and the head's input
gradient is the last stage's output gradient. A stage keeps its input of every
micro-batch in flight in a ring of `max(Schedule.in_flight())` slots and
recomputes the stage forward under `jax.vjp` in the backward tick (weights are
never saved per micro-batch; the layer remat policy decides what that
recomputation keeps for its own backward). The loop runs as one scan per run
of ticks that run the same passes (`_phases`): S-1 forward-only ticks, M ticks
of both, S-1 backward-only ticks, so the bubble costs what GPipe's does,
(S-1)(F+B).

Interleaved 1F1B (Megatron, arXiv 2104.04473, section 2.2) gives each stage R
layer groups laid out as the circular schedule lays them (stage s holds groups
s, s+S, ...): a tick runs one group, 1/R of a stage, forward and backward.
Micro-batches go in groups of S, through layer group 0, then group 1, ...: the
last stage's output of group r reaches stage 0 one tick later for group r+1
(the forward permute wraps round), and gradients wrap the other way. The first
backward starts at tick RS-1, and R*M + S - 1 ticks run a forward and as many a
backward, each 1/R of the work: a bubble of (S-1)/(R*M). Which slot of the
ring holds which input is planned before tracing (`Schedule.ring_slots`), so a
stage holds (R+1)S - 1 - 2s inputs whatever M is.

Zero-bubble (ZB-H1, Qi et al., arXiv 2401.10241) splits the backward tick in
two: the input-gradient pass (a vjp of the stage forward in its input only),
which sends the gradient on to the stage before and stays on the critical path,
and the weight-gradient pass (a vjp in the weights only), which does not. Stage
s defers its weight pass s ticks, keeping the input and the output gradient in
the rings until then, so every stage runs the weight pass of micro-batch m in
the same tick, 2S - 2 + m: M ticks run one, against 1F1B's M + S - 1, and in
lock-step the S - 1 ticks after the first backward pay for no weight pass. Each
pass recomputes the stage forward, and the weight pass back-propagates through
the stage's activations again to reach every layer's weights, so in this
program the split costs more than it saves (docs/benchmarks.md).

Gradients of the stage weights accumulate in the loop, in the stage view of the
stack. What makes the stack's input (`input_fn`, the embedding) runs per
micro-batch in the first stage's forward tick and its vjp in that stage's
backward tick, so no activation of all M micro-batches is ever held: the
memory is flat in M. Statistics the layers report enter the loss linearly
(`stats_loss`), so their cotangent is a constant known before the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from nestor.parallel.pipeline import (STAGE, Layout, LayerFn, RematPolicy, Schedule, Work, add_stats, expand,
                               stage_function, stage_rows, stage_view, to_microbatches)
from nestor.parallel.rules import Rules, partition_spec

InputFn = Callable[[Any, Any], jax.Array]  # input_fn(outer_params, inputs) -> x: the stack's input
HeadFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, dict]]  # head_fn(outer_params, y, inputs) -> (loss, metrics)


def _is_floating(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jnp.inexact)


def _inexact_split(tree: Any) -> tuple[list[jax.Array], Callable[[list], Any]]:
    """Returns (the floating leaves of `tree`, rebuild(floating leaves) -> tree with the other leaves as they were).

    Random-routing keys travel with the layer weights and integer counts with the stats; neither has a gradient.
    """
    leaves, treedef = jax.tree.flatten(tree)
    floating = [_is_floating(leaf) for leaf in leaves]

    def rebuild(new_leaves: list) -> Any:
        replacements = iter(new_leaves)
        return jax.tree.unflatten(treedef, [next(replacements) if f else leaf for f, leaf in zip(floating, leaves)])

    return [leaf for f, leaf in zip(floating, leaves) if f], rebuild


def _stage_pullback(stage: Callable, wrt: str = "both") -> Callable:
    """Returns pullback(stage_params, repeat, x, rows, dy, dstats) -> (d stage_params floating leaves, dx),
    or only dx (`wrt="input"`) or only the weight gradients (`wrt="weights"`).

    The stage forward runs again here (under its checkpoint policy) and its vjp is applied at once. What is
    not asked for is not differentiated: the input pass holds the weights constant, the weight pass the input.
    """

    def pullback(stage_params, repeat, x, rows, dy, dstats):
        weights, rebuild = _inexact_split(stage_params)

        def forward(weights, x):
            y, stats = stage(rebuild(weights), repeat, x, rows)
            return y, _inexact_split(stats)[0]

        if wrt == "input":
            return jax.vjp(lambda x: forward(weights, x), x)[1]((dy, dstats))[0]
        if wrt == "weights":
            return jax.vjp(lambda weights: forward(weights, x), weights)[1]((dy, dstats))[0]
        return jax.vjp(forward, weights, x)[1]((dy, dstats))

    return pullback


def _stats_cotangent(stats_loss: Callable | None, stats_shape: Any, schedule: Schedule) -> list[jax.Array]:
    """Returns d loss / d (one micro-batch's stats), floating leaves [R, S, per_stage, ...] (`stats_shape` is
    [S, per_stage, ...]): the gradient of the linear `stats_loss` of the micro-batch average, i.e. divided by M."""
    repeats = schedule.repeats
    stacked = jax.tree.map(lambda s: jnp.zeros((repeats * s.shape[0] * s.shape[1], *s.shape[2:]), s.dtype),
                           stats_shape)  # [layers, ...]
    floating, rebuild = _inexact_split(stacked)
    if stats_loss is not None:
        floating = [g / schedule.microbatches
                    for g in jax.grad(lambda leaves: stats_loss(rebuild(leaves)))(floating)]
    return [g.reshape(repeats, *like.shape) for g, like in zip(floating, _inexact_split(stats_shape)[0])]


def one_f_one_b(schedule: Schedule, mesh: Mesh, rules: Rules, activation_axes: tuple[str | None, ...],
                remat_policy: RematPolicy | None = None):
    """Returns value_and_grad(layer_fn, input_fn, head_fn, stacked_params, outer_params, inputs, row_inputs=None,
    stats_loss=None) -> ((loss, metrics, stats), (stacked_grads, outer_grads)) that runs a model under 1F1B,
    interleaved over `schedule.repeats` layer groups per stage when that is above 1, with the weight-gradient
    pass split off and deferred when `schedule.zero_bubble`.

    The model is input_fn -> the layer stack -> head_fn, per micro-batch.
    `stacked_params` leaves are `[layers, ...]`; `outer_params` are what
    `input_fn(outer_params, inputs) -> x` (the embedding; x with logical axes
    `activation_axes`) and `head_fn(outer_params, y, inputs) -> (loss, metrics)`
    (one micro-batch's mean loss) read. `inputs` and `row_inputs` are pytrees of
    `[batch, ...]` arrays split into micro-batches; each layer sees its
    micro-batch's `row_inputs`. `stats_loss(stats [layers, ...]) -> loss`, linear,
    is what the layers' stats add to the loss. Returns the loss (mean over
    micro-batches of the head's loss, without `stats_loss`), the head's metrics
    and the layers' stats averaged over micro-batches, and the gradients of
    loss + stats_loss with respect to the floating leaves of `stacked_params`
    (other leaves None) and to `outer_params`. Raises ValueError when the batch
    does not split into micro-batches or the layers into stages x repeats.
    """
    layout = Layout(mesh, rules, activation_axes)
    stages, micro = schedule.stages, schedule.microbatches
    ring_sharding = NamedSharding(mesh, partition_spec((STAGE, None, *activation_axes), rules))

    def value_and_grad(layer_fn: LayerFn, input_fn: InputFn, head_fn: HeadFn, stacked_params: Any,
                       outer_params: Any, inputs: Any, row_inputs: Any = None, stats_loss: Callable | None = None):
        num_layers = jax.tree.leaves(stacked_params)[0].shape[0]
        batch = jax.tree.leaves(inputs)[0].shape[0]
        problems = [message for _, message in schedule.problems(num_layers)]
        if batch % micro:
            problems.append(f"batch {batch} does not split into {micro} micro-batches")
        if problems:
            raise ValueError("; ".join(problems))
        params = stage_view(stacked_params, schedule, layout)  # [R, S, layers_per_stage, ...]
        split = jax.tree.map(lambda leaf: layout.rows(to_microbatches(leaf, micro), None),
                             {"inputs": inputs, "rows": row_inputs})  # [M, mb, ...]
        stage = stage_function(layer_fn, remat_policy)
        spmd_axes = layout.stage_axes or None
        forward = jax.vmap(stage, in_axes=(1, 0, 0, 0), spmd_axis_name=spmd_axes)
        pullbacks = {wrt: jax.vmap(_stage_pullback(stage, wrt), in_axes=(1, 0, 0, 0, 0, 0), out_axes=out_axes,
                                   spmd_axis_name=spmd_axes)
                     for wrt, out_axes in (("both", (1, 0)), ("input", 0), ("weights", 1))}
        first_inputs = jax.tree.map(lambda leaf: leaf[0], split["inputs"])
        x_shape = jax.eval_shape(input_fn, outer_params, first_inputs)
        activation = jnp.zeros((stages, *x_shape.shape), x_shape.dtype)  # [S, mb, ...]
        group = jnp.zeros((stages,), jnp.int32)
        stats_shape = jax.eval_shape(forward, params, group, activation, stage_rows(split["rows"], group, layout))[1]
        head_shape = jax.eval_shape(head_fn, outer_params, activation[0], first_inputs)
        ring = jax.lax.with_sharding_constraint(
            jnp.zeros((stages, max(schedule.in_flight()), *x_shape.shape), x_shape.dtype), ring_sharding)
        carry = {
            "forward": activation,   # [S, mb, ...]: each stage's last output
            "backward": activation,  # [S, mb, ...]: each stage's last input gradient
            "ring": ring,  # [S, slots, mb, ...]: each stage's inputs in flight
            "weight_grads": [jnp.zeros_like(w) for w in _inexact_split(params)[0]],  # [R, S, per_stage, ...]
            "outer_grads": _zeros(outer_params),
            "loss": _zeros(head_shape),
            "stats": _zeros(jax.tree.map(lambda s: jax.ShapeDtypeStruct((schedule.repeats, *s.shape), s.dtype),
                                         stats_shape)),  # [R, S, per_stage, ...]
        }
        if schedule.zero_bubble:
            carry["grad_ring"] = ring  # [S, slots, mb, ...]: the output gradient of each deferred weight pass
        passes = _Passes(schedule, layout, params, split, input_fn, head_fn, outer_params, forward, pullbacks,
                         _stats_cotangent(stats_loss, stats_shape, schedule))
        for start, stop, flags in _phases(schedule):
            carry, _ = jax.lax.scan(lambda c, t: (passes.tick(c, t, *flags), None), carry, jnp.arange(start, stop))
        loss, metrics = jax.tree.map(lambda total: total / micro, carry["loss"])
        stats = jax.tree.map(lambda total: (total / micro).reshape(num_layers, *total.shape[3:]), carry["stats"])
        weight_grads = iter(g.reshape(num_layers, *g.shape[3:]) for g in carry["weight_grads"])
        leaves, treedef = jax.tree.flatten(stacked_params)
        stacked_grads = jax.tree.unflatten(treedef, [next(weight_grads) if _is_floating(leaf) else None
                                                     for leaf in leaves])
        return (loss, metrics, stats), (stacked_grads, carry["outer_grads"])

    return value_and_grad


def _phases(schedule: Schedule) -> list[tuple[int, int, tuple[bool, bool, bool]]]:
    """Returns the loop as runs of ticks [(start, stop, (forward, backward, weights))] that run the same passes.

    1F1B: forward-only ticks until the first micro-batch leaves the last layer group, then both, then
    backward-only ticks once the last forward is done: RS - 1, R(M - S) + S, RS - 1 (the weight pass is
    the backward's). Zero-bubble runs no weight pass in the S - 1 ticks after the first backward.
    """
    spans = schedule.spans()
    bounds = sorted({edge for span in spans.values() for edge in span})
    return [(start, stop, tuple(lo <= start < hi for lo, hi in spans.values()))
            for start, stop in zip(bounds, bounds[1:])]


def _zeros(shapes: Any) -> Any:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class _Passes:
    """One clock tick of every stage: the forward, loss head, backward and (zero-bubble) weight-gradient passes
    over the loop's carry."""

    def __init__(self, schedule: Schedule, layout: Layout, params: Any, split: dict, input_fn: InputFn,
                 head_fn: HeadFn, outer_params: Any, forward: Callable, pullbacks: dict, stats_cotangent: list):
        self.schedule, self.stages, self.micro = schedule, schedule.stages, schedule.microbatches
        self.layout, self.params, self.split = layout, params, split
        self.input_fn, self.head_fn, self.outer_params = input_fn, head_fn, outer_params
        self.forward, self.pullbacks, self.stats_cotangent = forward, pullbacks, stats_cotangent
        self.stage_ids = jnp.arange(self.stages)
        self.slots = jnp.asarray(schedule.ring_slots())  # [S, R*M]
        spmd_axes = layout.stage_axes or None
        self.read_slot = jax.vmap(lambda ring, slot: ring[slot], spmd_axis_name=spmd_axes)
        # A bubble stage's clipped item may name a slot still in flight: it writes nothing.
        self.write_slot = jax.vmap(lambda ring, slot, x, valid: ring.at[slot].set(jnp.where(valid, x, ring[slot])),
                                   spmd_axis_name=spmd_axes)

    def tick(self, carry: dict, t: jax.Array, forward_pass: bool, backward_pass: bool, weight_pass: bool) -> dict:
        """Returns the carry after tick `t`; the flags say which passes any stage has work for."""
        carry = dict(carry)
        output_grad = None
        if forward_pass:
            carry = self.run_forward(carry, t)
        if forward_pass and backward_pass:
            carry, output_grad = self.run_head(carry, t)
        if backward_pass:
            carry = self.run_backward(carry, t, output_grad)
        if weight_pass and self.schedule.zero_bubble:
            carry = self.run_weights(carry, t)
        return carry

    def _work(self, work: Work) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Returns (layer group, micro-batch, forward position, whether it is real) of each stage's `work` [S],
        clipped into range for the bubble stages."""
        valid = (work.position >= 0) & (work.position < self.schedule.repeats * self.micro)
        return (jnp.where(valid, work.group, 0), jnp.where(valid, work.microbatch, 0),
                jnp.where(valid, work.forward_position, 0), valid)

    def _inputs(self, item: jax.Array) -> Any:
        return jax.tree.map(lambda leaf: leaf[item], self.split["inputs"])

    def run_forward(self, carry: dict, t: jax.Array) -> dict:
        """Stage s runs the forward of `Schedule.forward_work`; stage 0's input is `input_fn` of its micro-batch
        for layer group 0, else the last stage's output of the group before (the permute wraps round)."""
        group, item, position, valid = self._work(self.schedule.forward_work(t, self.stage_ids))
        state, layout = carry["forward"], self.layout
        x = jax.lax.with_sharding_constraint(self.input_fn(self.outer_params, self._inputs(item[0])),
                                             layout.activation)
        embedded = expand((self.stage_ids == 0) & (group == 0), state)
        incoming = jnp.where(embedded, x[None], jnp.roll(state, 1, 0))
        incoming = jax.lax.with_sharding_constraint(jnp.where(expand(valid, state), incoming, 0), layout.state)
        carry["ring"] = self.write_slot(carry["ring"], self.slots[self.stage_ids, position], incoming, valid)
        out, stats = self.forward(self.params, group, incoming, stage_rows(self.split["rows"], item, layout))
        carry["forward"] = jax.lax.with_sharding_constraint(out, layout.state)
        carry["stats"] = add_stats(carry["stats"], stats, group, valid)
        return carry

    def run_head(self, carry: dict, t: jax.Array) -> tuple[dict, jax.Array]:
        """Returns (carry, the gradient of the loss head's input): the head on the micro-batch the last
        stage just ran forward, when that was the last layer group (always, for R = 1; else the gradient is 0)."""
        group, item, _, _ = self._work(self.schedule.forward_work(t, self.stage_ids))
        inputs = self._inputs(item[-1])
        y = jax.lax.with_sharding_constraint(carry["forward"][-1], self.layout.activation)

        def head(y):
            loss, vjp, metrics = jax.vjp(lambda p, y: self.head_fn(p, y, inputs), self.outer_params, y, has_aux=True)
            outer_grads, output_grad = vjp(jnp.asarray(1 / self.micro, loss.dtype))
            return (loss, metrics), outer_grads, output_grad

        if self.schedule.repeats == 1:
            totals, outer_grads, output_grad = head(y)
        else:  # the head's cost (the unembedding) is paid only in the ticks that end a micro-batch's forward
            totals, outer_grads, output_grad = jax.lax.cond(
                group[-1] == self.schedule.repeats - 1, head, lambda y: _zeros(jax.eval_shape(head, y)), y)
        carry["outer_grads"] = jax.tree.map(jnp.add, carry["outer_grads"], outer_grads)
        carry["loss"] = jax.tree.map(jnp.add, carry["loss"], totals)
        return carry, output_grad

    def run_backward(self, carry: dict, t: jax.Array, output_grad: jax.Array | None) -> dict:
        """Stage s runs the backward of `Schedule.backward_work`; the last stage's output gradient is the loss
        head's for the last layer group, else stage 0's input gradient of the group after (the permute
        wraps round); stage 0's input gradient of group 0 goes through `input_fn`'s vjp."""
        group, item, position, valid = self._work(self.schedule.backward_work(t, self.stage_ids))
        state, layout = carry["backward"], self.layout
        incoming = jnp.roll(state, -1, 0)
        if output_grad is not None:
            from_head = (self.stage_ids == self.stages - 1) & (group == self.schedule.repeats - 1)
            incoming = jnp.where(expand(from_head, state), output_grad[None], incoming)
        incoming = jax.lax.with_sharding_constraint(jnp.where(expand(valid, state), incoming, 0), layout.state)
        slot = self.slots[self.stage_ids, position]
        saved = self.read_slot(carry["ring"], slot)
        rows = stage_rows(self.split["rows"], item, layout)
        if self.schedule.zero_bubble:  # the weight gradients wait for `run_weights`, with this output gradient
            dx = self.pullbacks["input"](self.params, group, saved, rows, incoming, self._dstats(group, valid))
            carry["grad_ring"] = self.write_slot(carry["grad_ring"], slot, incoming, valid)
        else:
            weight_grads, dx = self.pullbacks["both"](self.params, group, saved, rows, incoming,
                                                      self._dstats(group, valid))
            carry["weight_grads"] = self._add_weight_grads(carry["weight_grads"], weight_grads, valid)
        carry["backward"] = jax.lax.with_sharding_constraint(dx, layout.state)
        first_inputs = self._inputs(item[0])
        _, input_vjp = jax.vjp(lambda p: self.input_fn(p, first_inputs), self.outer_params)
        input_grad = jax.lax.with_sharding_constraint(jnp.where(valid[0] & (group[0] == 0), dx[0], 0),
                                                      layout.activation)
        (outer_grads,) = input_vjp(input_grad)
        carry["outer_grads"] = jax.tree.map(jnp.add, carry["outer_grads"], outer_grads)
        return carry

    def run_weights(self, carry: dict, t: jax.Array) -> dict:
        """Zero-bubble: stage s runs the weight-gradient pass of `Schedule.weight_work`, from the input and the
        output gradient its input pass left in the rings."""
        group, item, position, valid = self._work(self.schedule.weight_work(t, self.stage_ids))
        slot = self.slots[self.stage_ids, position]
        saved, output_grad = self.read_slot(carry["ring"], slot), self.read_slot(carry["grad_ring"], slot)
        output_grad = jnp.where(expand(valid, output_grad), output_grad, 0)
        weight_grads = self.pullbacks["weights"](self.params, group, saved,
                                                 stage_rows(self.split["rows"], item, self.layout), output_grad,
                                                 self._dstats(group, valid))
        carry["weight_grads"] = self._add_weight_grads(carry["weight_grads"], weight_grads, valid)
        return carry

    def _dstats(self, group: jax.Array, valid: jax.Array) -> list[jax.Array]:
        """Returns each stage's cotangent of its layers' stats [S, per_stage, ...], zero for bubble stages."""
        return [jnp.where(expand(valid, c[group, self.stage_ids]), c[group, self.stage_ids], 0)
                for c in self.stats_cotangent]

    @staticmethod
    def _add_weight_grads(totals: list, weight_grads: list, valid: jax.Array) -> list:
        """Returns `totals` plus the stages' `weight_grads`, those of bubble stages left out (their cotangents
        are zero, so their weight gradients are too; the mask only keeps that exact)."""
        return [total + jnp.where(expand(valid, g[0])[None], g, 0) for total, g in zip(totals, weight_grads)]
