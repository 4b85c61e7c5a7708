"""Pipeline parallelism inside one SPMD program: GPipe and circular schedules.

GPipe (Huang et al., arXiv 1811.06965) splits a stack of layers into S stages
and the batch into M micro-batches; stage s works on micro-batch m at
iteration m + s, so a step takes M + S - 1 iterations of which S - 1 are the
bubble. The circular schedule gives each stage R non-adjacent groups of layers
(stage s holds groups s, s + S, s + 2S, ...) and sends every micro-batch round
the ring R times: R*M + S - 1 iterations, bubble (S-1)/(R*M + S - 1).

The stage dimension of every array is sharded over the mesh axes of the
logical name `stage`; each iteration runs all stages at once with a `vmap`
over that dimension (its `spmd_axis_name` keeps the stage dimension on those
axes), and activations move to the next stage with `jnp.roll` on the
stage-sharded state, which the partitioner lowers to a collective-permute.
Inside a stage, weights and activations keep the shardings of their logical
names, so data, fsdp, tensor and expert parallelism compose with the pipeline
unchanged. A bubble stage's work is on zeros and thrown away. The loop is a
strategy the runner is given (`PipelineLoop`): with `skipping_stages` the
stages' work is instead a program per stage (`jax.shard_map` over the stage
axes alone, the other axes still GSPMD's) that skips each layer of a bubble
iteration by `lax.cond`, which pays where devices share processors.

The layer stack keeps its canonical layout `[layers, ...]` outside; it is
viewed as `[repeats, stages, layers_per_stage, ...]` only inside the step.
Nothing here knows what a layer computes: the runner takes a callable, and
the rematerialisation policy as a plain `jax.checkpoint` policy.
Per-row inputs that every layer reads unchanged (segment ids) are split into
the same micro-batches as the activations; each stage reads its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import Recompute
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nestor.parallel.rules import Rules, partition_spec

STAGE = "stage"  # logical name of the stage dimension (a rule maps it to mesh axes)

LayerFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, dict]]
RematPolicy = Callable[..., Any]


class Work(NamedTuple):
    """What a stage runs in one 1F1B tick: its `position` in the stage's order of forwards or backwards
    (a bubble outside 0 .. R*M - 1), the layer `group`, the `microbatch`, and the position of the
    forward whose input the pass reads (`forward_position`)."""

    position: Any
    group: Any
    microbatch: Any
    forward_position: Any


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a step is pipelined: S stages, M micro-batches, R layer groups per stage; with
    `one_f_one_b` the backward pass runs inside the loop (parallel.pipeline_1f1b), interleaved when R > 1;
    with `zero_bubble` too (R = 1), split into an input-gradient and a deferred weight-gradient pass."""

    stages: int
    microbatches: int
    repeats: int = 1
    one_f_one_b: bool = False
    zero_bubble: bool = False

    def __post_init__(self):
        if self.zero_bubble and not self.one_f_one_b:
            raise ValueError("zero_bubble splits the backward pass of the 1F1B loop: set one_f_one_b too")

    @property
    def name(self) -> str:
        """Returns "zero_bubble", "1f1b" or "interleaved_1f1b", or "circular" when stages hold several layer
        groups, else "gpipe"."""
        if self.zero_bubble:
            return "zero_bubble"
        if self.one_f_one_b:
            return "interleaved_1f1b" if self.repeats > 1 else "1f1b"
        return "circular" if self.repeats > 1 else "gpipe"

    @property
    def iterations(self) -> int:
        """Returns the loop length including the bubble: R*M + S - 1 forward iterations, or
        R*M + (R+1)S - 2 clock ticks for (interleaved) 1F1B: the first backward starts at tick RS - 1,
        when micro-batch 0 leaves the last layer group, and the last takes S - 1 ticks back."""
        if self.one_f_one_b:
            return self.repeats * self.microbatches + (self.repeats + 1) * self.stages - 2
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """Returns (S-1)/(R*M + S - 1), the share of a stage's time that does no work, counting a forward, an
        input-gradient and a weight-gradient pass as equal costs.

        For 1F1B too: its R*M + S - 1 ticks that run a forward and as many that run a backward
        each cost 1/R of a stage's forward or backward, against the R*M of each that do work.
        That is a bubble of (S-1)/(R*M) of the work, Megatron's interleaved one (arXiv 2104.04473, 2.2).
        Zero-bubble runs the weight pass in only M ticks: 2(S-1)/(3M + 2(S-1)).
        """
        idle = self.stages - 1
        if self.zero_bubble:
            return 2 * idle / (3 * self.microbatches + 2 * idle)
        return idle / (self.repeats * self.microbatches + idle)

    def forward_work(self, tick: Any, stage: Any) -> Work:
        """Returns the forward each `stage` runs at `tick` under 1F1B. Works on ints and integer arrays alike.

        Positions 0 .. R*M - 1 are a stage's forwards in order: Megatron's interleaved order, groups of S
        micro-batches through layer group 0, then the same S through group 1, ...; a position outside
        that range is a bubble.
        """
        position = tick - stage
        group = position % (self.repeats * self.stages) // self.stages
        return Work(position, group, self._microbatch(position), position)

    def backward_work(self, tick: Any, stage: Any) -> Work:
        """Returns the backward each `stage` runs at `tick` under 1F1B: the same groups of S micro-batches,
        layer groups last to first, RS - 1 ticks behind the forwards at the last stage and one tick more
        per stage back."""
        position = tick - ((self.repeats + 1) * self.stages - 2 - stage)
        group = self.repeats - 1 - position % (self.repeats * self.stages) // self.stages
        return Work(position, group, self._microbatch(position),
                    position + (2 * group + 1 - self.repeats) * self.stages)

    def weight_work(self, tick: Any, stage: Any) -> Work:
        """Returns the weight-gradient pass each `stage` runs at `tick`: under 1F1B the backward's own; under
        zero-bubble (ZB-H1, arXiv 2401.10241; R = 1) stage s defers it s ticks, so every stage runs the weight
        pass of micro-batch m at tick 2S - 2 + m, and the S - 1 ticks after the first backward run none."""
        if not self.zero_bubble:
            return self.backward_work(tick, stage)
        return self.backward_work(tick - stage, stage)

    def spans(self) -> dict[str, tuple[int, int]]:
        """Returns the ticks [start, stop) of the 1F1B loop in which some stage runs each pass: "forward",
        "backward" (the input gradient, and under 1F1B the weights' too) and "weights": all R*M + S - 1 ticks
        after the first backward, or for zero-bubble the M ticks from 2S - 2."""
        work = self.repeats * self.microbatches
        found = {}
        for name, work_of in (("forward", self.forward_work), ("backward", self.backward_work),
                              ("weights", self.weight_work)):
            ticks = [tick for tick in range(self.iterations)
                     if any(0 <= work_of(tick, stage).position < work for stage in range(self.stages))]
            found[name] = (ticks[0], ticks[-1] + 1)
        return found

    def _microbatch(self, position: Any) -> Any:
        return position // (self.repeats * self.stages) * self.stages + position % self.stages

    def ring_slots(self) -> np.ndarray:
        """Returns [S, R*M] int32: the ring slot where each stage keeps the input of each forward position
        from its forward tick to its weight-gradient pass under 1F1B (slots reused greedily, so a stage uses
        as many as it holds at once)."""
        work = self.repeats * self.microbatches
        table = np.zeros((self.stages, work), np.int32)
        for stage in range(self.stages):
            free, used = set(), 0
            for tick in range(self.iterations):
                forward, weights = self.forward_work(tick, stage), self.weight_work(tick, stage)
                if 0 <= forward.position < work:  # the forward writes before the later passes of the tick read
                    slot = min(free) if free else used
                    table[stage, forward.position] = slot
                    free.discard(slot)
                    used = max(used, slot + 1)
                if 0 <= weights.position < work:
                    free.add(int(table[stage, weights.forward_position]))
        return table

    def in_flight(self) -> list[int]:
        """Returns, for each stage, the work items (micro-batch x layer group) whose residuals it holds at once.

        GPipe keeps every work item's until the backward pass (R*M). 1F1B keeps stage s's from its
        forward to its backward tick, (R+1)S - 1 - 2s of them in the steady state: 2(S-s)-1 for R = 1,
        at most R*M (one SPMD tick is a forward and a backward, so each hop of the round trip costs a whole
        tick, not the half tick of the per-stage programs of arXiv 2104.04473). Zero-bubble keeps each input
        s ticks longer, until the deferred weight pass: 2S - 1 - s (and the output gradient from the input
        pass to the weight pass, in a ring of as many slots).
        """
        if self.one_f_one_b:
            return [int(row.max()) + 1 for row in self.ring_slots()]
        return [self.repeats * self.microbatches] * self.stages

    def problems(self, num_layers: int) -> list[tuple[str, str]]:
        """Returns (what, message) for each reason this schedule cannot run `num_layers` layers.

        `what` is "layers", "microbatches" or "repeats": the quantity to change. Empty when it can run.
        """
        found = []
        if num_layers % (self.stages * self.repeats):
            found.append(("layers", f"{num_layers} layers do not split into {self.stages} stages x "
                                    f"{self.repeats} repeats; use a multiple of {self.stages * self.repeats}"))
        if self.zero_bubble and self.repeats > 1:
            found.append(("repeats", f"zero_bubble runs one layer group per stage (got repeats={self.repeats})"))
        if self.repeats > 1 and self.one_f_one_b and self.microbatches % self.stages:
            found.append(("microbatches", f"interleaved 1f1b runs micro-batches in groups of one per stage "
                                          f"through each layer group; use a multiple of {self.stages} "
                                          f"(got {self.microbatches})"))
        elif self.repeats > 1 and self.microbatches < self.stages:
            found.append(("microbatches", f"the circular schedule needs microbatches >= stages "
                                          f"({self.microbatches} < {self.stages}): a micro-batch must leave the "
                                          "last stage before the first stage needs it again"))
        return found


# Ops that only move or view data: recomputing them in the backward pass costs next to nothing.
_DATA_MOVEMENT = frozenset({"dynamic_slice", "slice", "gather", "squeeze", "reshape", "broadcast_in_dim",
                            "transpose", "convert_element_type"})


def _layer_policy(remat_policy: RematPolicy | None) -> RematPolicy:
    """Returns the checkpoint policy of a layer inside a stage: `remat_policy` (None: save everything), but never
    saving what only moves or views data. The layer slices and casts its own weights from the stage's stack;
    saving those would keep a copy of the weights for every loop iteration, and recomputing them is free.
    (jax 0.10's save_anything_except_these_names ignores its names, so naming the slices would not do.)"""

    def saveable(primitive, *args, **params):
        if primitive.name in _DATA_MOVEMENT:
            return False
        return True if remat_policy is None else remat_policy(primitive, *args, **params)

    return saveable


def stage_function(layer_fn: LayerFn, remat_policy: RematPolicy | None, layer_stats: Any = None):
    """Returns f(stage_params [R, layers_per_stage, ...], repeat, x, row_inputs) -> (x, stats [layers_per_stage, ...]).

    Each layer is a checkpoint of its own (`_layer_policy`, even without remat) that takes the whole
    stage's stack and slices its weights (group `repeat`, layer j) inside. The stack is the same in every
    iteration, so the loop's autodiff keeps it once; what each iteration keeps is each layer's input and
    what the policy saves. (A checkpoint around the whole stage would run the stage's forward a second time
    in the backward pass to recover each layer's input, gathering fsdp weights again.)

    Given `layer_stats` (the shapes of one layer's stats), f is one stage's program (`skipping_stages`):
    stage_params are [R, 1, layers_per_stage, ...] and f takes `busy` (a bool scalar) after row_inputs; each
    layer runs under `lax.cond(busy, ...)`, and a bubble passes x through with zeros of `layer_stats`. The
    cond sits inside the layer's checkpoint, so the weights stay its input and are kept once, not per
    iteration (a cond's residuals are outputs of one branch, which the loop would stack). A policy that
    recomputes matmuls (`full`, `minimal`) gets a second checkpoint inside the cond, so the recomputation
    lands in the backward pass's own cond and shares its weights' fsdp all-gathers; a policy that keeps them
    (`dots`, none) recomputes only elementwise work, in a cond of its own (docs/benchmarks.md compares both).
    """
    policy = _layer_policy(remat_policy)
    one_stage = layer_stats is not None
    busy_layer = layer_fn
    if one_stage:
        kept = policy(jax.lax.dot_general_p, dimension_numbers=(((1,), (0,)), ((), ())))
        if kept is False or kept is Recompute:  # an offloading policy's marker is truthy
            busy_layer = jax.checkpoint(layer_fn, policy=policy, prevent_cse=False)

    def layer(stage_params: Any, repeat: jax.Array, index: jax.Array, x: jax.Array, row_inputs: Any,
              busy: jax.Array | None):
        params = jax.tree.map(lambda leaf: leaf[(repeat, 0, index) if one_stage else (repeat, index)], stage_params)
        if busy is None:
            return layer_fn(params, x, row_inputs)

        def bubble(params, x, row_inputs):
            return x, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), layer_stats)

        return jax.lax.cond(busy, busy_layer, bubble, params, x, row_inputs)

    layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def stage(stage_params: Any, repeat: jax.Array, x: jax.Array, row_inputs: Any, busy: jax.Array | None = None):
        per_stage = jax.tree.leaves(stage_params)[0].shape[2 if one_stage else 1]
        return jax.lax.scan(lambda h, index: layer(stage_params, repeat, index, h, row_inputs, busy), x,
                            jnp.arange(per_stage))

    return stage


class Layout:
    """Shardings of the pipeline's arrays, from the `stage` rule and the activation's logical axes."""

    def __init__(self, mesh: Mesh, rules: Rules, activation_axes: tuple[str | None, ...]):
        self.mesh = mesh
        self.rules = rules
        self.activation_axes = activation_axes
        self.stage_axes = tuple(rules[STAGE])
        self.stage_devices = math.prod(mesh.shape[axis] for axis in self.stage_axes)  # 1 without stage axes
        self.state = NamedSharding(mesh, partition_spec((STAGE, *activation_axes), rules))
        self.buffer = NamedSharding(mesh, partition_spec((None, *activation_axes), rules))
        self.activation = NamedSharding(mesh, partition_spec(activation_axes, rules))

    def rows(self, leaf: jax.Array, leading: str | None) -> jax.Array:
        """Returns a row input [leading, mb, ...] pinned like the activations' leading dims
        (`leading` = STAGE for per-stage rows, None for the micro-batch buffer)."""
        spec = partition_spec((leading, *self.activation_axes[:leaf.ndim - 1]), self.rules)
        return jax.lax.with_sharding_constraint(leaf, NamedSharding(self.mesh, spec))

    def stage_params(self, leaf: jax.Array) -> jax.Array:
        """Returns `leaf` [repeats, stages, ...] with its stage dim on the stage axes, the rest left to GSPMD."""
        rest = (PartitionSpec.UNCONSTRAINED,) * (leaf.ndim - 2)
        spec = PartitionSpec(None, self.stage_axes or None, *rest)
        return jax.lax.with_sharding_constraint(leaf, NamedSharding(self.mesh, spec))


def to_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
    """Returns `x` [batch, ...] as [M, batch/M, ...]: row r goes to micro-batch r % M,
    so every micro-batch spans every batch shard."""
    batch = x.shape[0]
    return x.reshape(batch // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)  # [M, batch/M, ...]


def from_microbatches(x: jax.Array) -> jax.Array:
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])  # [batch, ...]


def stage_view(stacked_params: Any, schedule: Schedule, layout: Layout) -> Any:
    """Returns the params viewed as [repeats, stages, layers_per_stage, ...] with stages sharded.

    Layer l = (r*S + s)*layers_per_stage + j sits at [r, s, j]: stage s holds the
    groups s, s+S, ... (for R = 1, the contiguous block the state already keeps).
    """
    s, r = schedule.stages, schedule.repeats

    def view(leaf):
        per_stage = leaf.shape[0] // (s * r)
        return layout.stage_params(leaf.reshape(r, s, per_stage, *leaf.shape[1:]))

    return jax.tree.map(view, stacked_params)


def vmapped_stages(layer_fn: LayerFn, remat_policy: RematPolicy | None, params: Any, layout: Layout,
                   stats_shape: Any) -> Callable:
    """Returns run_stages(repeat [S], x [S, mb, ...], rows [S, mb, ...], busy [S]) -> (x, stats
    [S, layers_per_stage, ...]): every stage at once under one `vmap` over the stage dimension (its
    `spmd_axis_name` keeps it on the stage axes); a bubble stage works on zeros."""
    del stats_shape  # every stage works: no zeros to stand in for a skipped layer's stats
    stage_fn = jax.vmap(stage_function(layer_fn, remat_policy), in_axes=(1, 0, 0, 0),
                        spmd_axis_name=layout.stage_axes or None)
    return lambda repeat, x, rows, busy: stage_fn(params, repeat, x, rows)


def skipping_stages(layer_fn: LayerFn, remat_policy: RematPolicy | None, params: Any, layout: Layout,
                    stats_shape: Any) -> Callable:
    """Returns run_stages as `vmapped_stages` does, each device group running its own stage's program
    (`jax.shard_map` over the stage axes, the others left to GSPMD) that skips its layers where `busy` is
    False: where devices share processors, the busy stages get a bubble's time. Without one stage per
    device group on the stage axes it is `vmapped_stages`."""
    if not layout.stage_axes or jax.tree.leaves(params)[0].shape[1] != layout.stage_devices:
        return vmapped_stages(layer_fn, remat_policy, params, layout, stats_shape)
    layer_stats = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[2:], s.dtype), stats_shape)
    stage = stage_function(layer_fn, remat_policy, layer_stats)
    spec = PartitionSpec(layout.stage_axes)

    def on_stage(params: Any, repeat: jax.Array, x: jax.Array, rows: Any, busy: jax.Array):
        x, stats = stage(params, repeat[0], x[0], jax.tree.map(lambda leaf: leaf[0], rows), busy[0])
        return x[None], jax.tree.map(lambda leaf: leaf[None], stats)

    def run(repeat: jax.Array, x: jax.Array, rows: Any, busy: jax.Array):
        in_specs = (jax.tree.map(lambda _: PartitionSpec(None, layout.stage_axes), params), spec, spec,
                    jax.tree.map(lambda _: spec, rows), spec)
        out_specs = (spec, jax.tree.map(lambda _: spec, stats_shape))
        return jax.shard_map(on_stage, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=frozenset(layout.stage_axes), check_vma=False)(params, repeat, x, rows, busy)

    return run


def buffered_loop(tick: Callable, state: jax.Array, totals: Any, buffer: jax.Array, schedule: Schedule,
                  layout: Layout):
    """Returns (outputs [M, mb, ...], totals) of the schedule's R*M + S - 1 iterations.

    `buffer` [M, mb, ...] holds each micro-batch's input until stage 0 takes it and receives it back from
    the last stage, which feeds its next round to stage 0; after the last iteration it holds the outputs.
    """
    del layout  # the buffer keeps the layout it was given
    stages, micro = schedule.stages, schedule.microbatches

    def iteration(carry, t):
        state, buffer, totals = carry
        state, totals = tick(state, totals, t, buffer[t % micro])
        finished = t - (stages - 1)  # the item the last stage just completed
        slot = finished % micro
        buffer = buffer.at[slot].set(jnp.where(finished >= 0, state[stages - 1], buffer[slot]))
        return (state, buffer, totals), None

    (_, buffer, totals), _ = jax.lax.scan(iteration, (state, buffer, totals), jnp.arange(schedule.iterations))
    return buffer, totals


def streamed_loop(tick: Callable, state: jax.Array, totals: Any, buffer: jax.Array, schedule: Schedule,
                  layout: Layout):
    """Returns what `buffered_loop` returns; GPipe's (R = 1) micro-batches are the loop's xs instead (with
    S - 1 empty slots after them) and the last stage's outputs its ys, so the loop carries only the
    stages' state: less work per iteration, more temporaries for the inputs and outputs. Micro-batch m
    enters stage 0 at iteration m and leaves the last stage at m + S - 1. Circular schedules (R > 1) feed
    rounds back through the buffer: `buffered_loop`."""
    if schedule.repeats > 1:
        return buffered_loop(tick, state, totals, buffer, schedule, layout)
    stages = state.shape[0]
    fed = jnp.concatenate([buffer, jnp.zeros((stages - 1, *buffer.shape[1:]), buffer.dtype)])
    fed = jax.lax.with_sharding_constraint(fed, layout.buffer)

    def iteration(carry, step):
        state, totals = tick(*carry, *step)
        return (state, totals), state[stages - 1]

    (_, totals), outputs = jax.lax.scan(iteration, (state, totals), (jnp.arange(fed.shape[0]), fed))
    return jax.lax.with_sharding_constraint(outputs[stages - 1:], layout.buffer), totals


class PipelineLoop(NamedTuple):
    """How the pipeline's loop runs: `stages` builds each iteration's work of every stage (`vmapped_stages`,
    `skipping_stages`), `loop` feeds the micro-batches (`buffered_loop`, `streamed_loop`). The results are
    the same either way, to float rounding; the backend picks one for its target."""

    name: str
    stages: Callable = vmapped_stages
    loop: Callable = buffered_loop


BUFFERED = PipelineLoop("stages under one vmap, micro-batches in a buffer")
PER_STAGE_SKIPPING = PipelineLoop("a program per stage skipping its bubbles, GPipe's micro-batches streamed",
                                  skipping_stages, streamed_loop)


def pipeline_runner(schedule: Schedule, mesh: Mesh, rules: Rules, activation_axes: tuple[str | None, ...],
                    remat_policy: RematPolicy | None = None, loop: PipelineLoop = BUFFERED):
    """Returns runner(layer_fn, stacked_params, x, row_inputs=None) -> (x, stats) that pipelines a layer stack.

    `stacked_params` leaves are `[layers, ...]`; `x` is `[batch, ...]` with
    logical axes `activation_axes`; `row_inputs` a pytree of `[batch, ...]`
    arrays laid out like the leading dims of `x` (or None);
    `layer_fn(layer_params, x, row_inputs) -> (x, stats)` sees the rows of its micro-batch.
    `remat_policy` (a `jax.checkpoint` policy; None = save everything) decides
    what each layer keeps for the backward pass besides its input; `loop` how the iterations run.
    The runner returns the stack's output and each layer's stats stacked
    `[layers, ...]`, averaged over micro-batches (bubble iterations excluded).
    Raises ValueError when the batch does not split into
    micro-batches or the layers into stages x repeats.
    """
    layout = Layout(mesh, rules, activation_axes)
    stages, micro, repeats = schedule.stages, schedule.microbatches, schedule.repeats

    def runner(layer_fn: LayerFn, stacked_params: Any, x: jax.Array, row_inputs: Any = None):
        num_layers = jax.tree.leaves(stacked_params)[0].shape[0]
        problems = [message for _, message in schedule.problems(num_layers)]
        if x.shape[0] % micro:
            problems.append(f"batch {x.shape[0]} does not split into {micro} micro-batches")
        if problems:
            raise ValueError("; ".join(problems))
        params = stage_view(stacked_params, schedule, layout)
        buffer = jax.lax.with_sharding_constraint(to_microbatches(x, micro), layout.buffer)  # [M, mb, ...]
        rows = jax.tree.map(lambda leaf: layout.rows(to_microbatches(leaf, micro), None), row_inputs)
        state = jnp.zeros((stages, *buffer.shape[1:]), x.dtype)  # [S, mb, ...]: each stage's last output
        no_work = jnp.zeros((stages,), jnp.int32)
        stats_shape = jax.eval_shape(
            lambda params, repeat, x, rows: vmapped_stages(layer_fn, remat_policy, params, layout, None)(
                repeat, x, rows, None), params, no_work, state, stage_rows(rows, no_work, layout))[1]
        totals = jax.tree.map(lambda s: jnp.zeros((repeats, *s.shape), s.dtype), stats_shape)
        run_stages = loop.stages(layer_fn, remat_policy, params, layout, stats_shape)
        outputs, totals = loop.loop(_tick_fn(schedule, layout, rows, run_stages), state, totals, buffer, schedule,
                                    layout)
        out = jax.lax.with_sharding_constraint(from_microbatches(outputs), layout.activation)
        # [R, S, layers_per_stage, ...] -> [layers, ...]: the canonical order, l = (r*S + s)*per_stage + j
        stats = jax.tree.map(lambda total: (total / micro).reshape(num_layers, *total.shape[3:]), totals)
        return out, stats

    return runner


def stage_rows(rows: Any, micro_index: jax.Array, layout: Layout) -> Any:
    """Returns each stage's row inputs [S, mb, ...]: stage s reads micro-batch `micro_index[s]` of `rows` [M, mb, ...]."""
    return jax.tree.map(lambda leaf: layout.rows(leaf[micro_index], STAGE), rows)


def _tick_fn(schedule: Schedule, layout: Layout, rows: Any, run_stages: Callable):
    """Returns tick(state [S, mb, ...], totals, t, first [mb, ...]) -> (state, totals): iteration t of every
    stage, stage 0 taking `first` and stage s stage s-1's output (a collective-permute).

    `rows` [M, mb, ...] stay put: each stage reads those of the micro-batch it works on.
    `run_stages(repeat, x, rows, busy)` runs every stage, `busy` [S] False on a bubble.
    """
    stages, micro, repeats = schedule.stages, schedule.microbatches, schedule.repeats
    stage_ids = jnp.arange(stages)

    def tick(state: jax.Array, totals: Any, t: jax.Array, first: jax.Array):
        item = t - stage_ids  # [S]: the work item r*M + m each stage runs now
        valid = (item >= 0) & (item < repeats * micro)
        incoming = jnp.where(expand(stage_ids == 0, state), first[None], jnp.roll(state, 1, 0))
        # Bubble stages get zeros (finite, whether they work on them or skip) and their outputs are never read.
        incoming = jax.lax.with_sharding_constraint(jnp.where(expand(valid, state), incoming, 0), layout.state)
        repeat = jnp.clip(item // micro, 0, repeats - 1)
        rows_now = stage_rows(rows, jnp.maximum(item, 0) % micro, layout)
        # [S, mb, ...], stats [S, layers_per_stage, ...]
        state, stats = run_stages(repeat, incoming, rows_now, valid)
        state = jax.lax.with_sharding_constraint(state, layout.state)
        return state, add_stats(totals, stats, repeat, valid)

    return tick


def add_stats(totals: Any, stats: Any, group: jax.Array, valid: jax.Array) -> Any:
    """Returns `totals` [R, S, layers_per_stage, ...] plus each stage's `stats` [S, layers_per_stage, ...]
    in the row of its layer `group` [S], for the stages with real work (`valid` [S])."""

    def add(total, s):
        cell = (jnp.arange(total.shape[0])[:, None] == group[None, :]) & valid[None, :]  # [R, S]
        return total + jnp.where(expand(cell, total), s[None], 0)

    return jax.tree.map(add, totals, stats)


def expand(mask: jax.Array, like: jax.Array) -> jax.Array:
    """Returns `mask` with trailing unit dims so it broadcasts against `like`."""
    return mask.reshape(mask.shape + (1,) * (like.ndim - mask.ndim))
