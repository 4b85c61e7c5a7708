"""Compiled HLO text read as a program: collectives (count and bytes) and FLOPs per run.

The text is the deterministic record of what the partitioner and the
compiler decided, so tests and `nestor explain` read communication and work
from it instead of timing them. An instruction inside a `while` body (a scan
over layers, a pipeline loop) runs once per iteration: its computation's
multiplier is the product of the `known_trip_count`s of the loops around it.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import NamedTuple

import numpy as np

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}
# a computation's first line; the lowered (unoptimized) module's printer leaves out the parameters
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")  # tuples of six or more elements carry `/*index=5*/`
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\([^=]*?\)|\S+)\s+"
                   r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


class _Instruction(NamedTuple):
    """One HLO instruction: its result shape text, opcode, operand names and the text after the operands."""

    name: str
    shape: str
    op: str
    operands: tuple[str, ...]
    attributes: str


def _split_operands(rest: str) -> tuple[list[str], str]:
    """Returns the top-level operands of `rest` (the text after `op(`) and the text after their `)`."""
    operands, depth, start = [], 0, 0
    for i, char in enumerate(rest):
        if char in "([{":
            depth += 1
        elif char in ")]}" and depth:
            depth -= 1
        elif char == ")" or (char == "," and depth == 0):
            operands.append(rest[start:i].strip())
            start = i + 1
            if char == ")":
                return [o for o in operands if o], rest[i + 1:]
    return [o for o in operands if o], ""


def _parse_instruction(line: str) -> _Instruction | None:
    """Returns the instruction on one line of HLO text, or None for headers, braces and blank lines.

    Operands are names; an operand printed with its shape in front (older
    printers) keeps only its name.
    """
    match = _LINE.match(_COMMENT.sub("", line))
    if not match:
        return None
    operands, attributes = _split_operands(match.group("rest"))
    names = tuple(operand.split()[-1].lstrip("%") for operand in operands)
    return _Instruction(match.group("name"), match.group("shape"), match.group("op"), names, attributes)


def _arrays(shape: str) -> list[tuple[str, list[int]]]:
    """Returns (dtype, dims) of every array in a shape (one, or each element of a tuple)."""
    return [(dtype, [int(d) for d in filter(None, dims.split(","))]) for dtype, dims in _ARRAY.findall(shape)]


def _elements(shape: str) -> list[int]:
    return [math.prod(dims) for _, dims in _arrays(shape)]


def _array_bytes(shape: str) -> list[int]:
    return [math.prod(dims) * _DTYPE_BYTES.get(dtype, 4) for dtype, dims in _arrays(shape)]


def _computations(hlo_text: str) -> tuple[dict[str, list[_Instruction]], str | None]:
    computations: dict[str, list[_Instruction]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None and (instruction := _parse_instruction(line)):
            computations[current].append(instruction)
    return computations, entry


def _callees(instruction: _Instruction) -> list[tuple[str, int]]:
    """Returns (computation, runs per run of `instruction`) for what it calls once or in a loop.

    A reducer (`to_apply` of reduce, all-reduce, scatter, ...) is applied per
    element: its work belongs to the instruction, so it is not listed; a
    `call`'s `to_apply` runs once and is.
    """
    trip = _TRIP.search(instruction.attributes)
    callees = []
    for role, callee in _CALLEE.findall(instruction.attributes):
        if role == "to_apply" and instruction.op != "call":
            continue
        callees.append((callee, int(trip.group(1)) if role == "body" and trip else 1))
    for group in _BRANCHES.findall(instruction.attributes):
        callees += [(callee, 1) for callee in re.findall(r"%?([\w.\-]+)", group)]
    return callees


def _multipliers(computations: dict[str, list[_Instruction]], entry: str, *,
                 loop_iterations: bool = True) -> dict[str, int]:
    """Returns how many times each computation runs per run of `entry`; with
    `loop_iterations=False`, every loop body counts once (as XLA's cost analysis counts it)."""
    multiplier: dict[str, int] = defaultdict(int)

    def visit(name: str, factor: int) -> None:
        multiplier[name] += factor
        for instruction in computations.get(name, ()):
            for callee, runs in _callees(instruction):
                visit(callee, factor * (runs if loop_iterations else 1))

    visit(entry, 1)
    return multiplier


class CollectiveOp(NamedTuple):
    """One collective instruction of a module: its kind, bytes per device per run (for an async `-start`
    tuple, the received buffer; for a ragged all-to-all, the smaller of its input and output buffers: the
    rows a balanced routing moves, where the output has room for all of them from one device), runs per run
    of the module, and the groups of device ids it joins (the
    partition ids of the program's device assignment; one group of all devices where the module names
    none; a collective-permute's source-target pairs)."""

    kind: str
    bytes: int
    runs: int
    groups: tuple[tuple[int, ...], ...]


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
    """Returns every collective instruction run per run of the module (loop bodies once per iteration),
    less those within groups of one device, which move nothing."""
    computations, entry = _computations(hlo_text)
    if entry is None:
        return []
    found = []
    for name, factor in _multipliers(computations, entry).items():
        for instruction in computations.get(name, ()):
            kind = _collective_kind(instruction)
            groups = _groups(instruction.attributes) if kind else ()
            # groups of one device each move nothing (a shard_map's transpose sums a cotangent over the size-1
            # mesh axes its specs leave out)
            if kind is None or (groups and all(len(group) == 1 for group in groups)):
                continue
            sizes = _array_bytes(instruction.shape)
            size = sizes[-1] if instruction.op.endswith("-start") and sizes else sum(sizes)
            if instruction.op.startswith("ragged-"):
                # its output buffer has room for every row to come from one device; the rows sent are at most
                # its input (an async start's first element, else its first operand)
                sent = sizes[0] if instruction.op.endswith("-start") else sum(_array_bytes(next(
                    (i.shape for i in computations[name] if i.name == instruction.operands[0]), "")))
                size = min(size, sent) if sent else size
            found.append(CollectiveOp(kind, size, factor, groups))
    return found


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Returns {kind: {"count": n, "bytes": b}} executed per run of the HLO module.

    Bytes are the per-device result size of each collective (for an async
    `-start` tuple, its last element, the received buffer; a ragged all-to-all's
    as `CollectiveOp` says). Kinds absent from
    the module are reported with zeros; a collective within groups of one
    device, which moves nothing, is left out.
    """
    result = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVE_KINDS}
    for op in collective_ops(hlo_text):
        result[op.kind]["count"] += op.runs
        result[op.kind]["bytes"] += op.runs * op.bytes
    return result


_LISTED_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}")
# the iota form: [groups, size]<=[dims] with an optional transpose T(perm) of the iota before the reshape
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


# the mesh form: mesh['axis_0'=2,'axis_1'=4][, device_ids=([dims]T(perm))] {'axis_0'}: the devices of a mesh of
# those sizes (device_ids, an iota reshaped and transposed, else in order), grouped along the named axes
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                          r"\s*\{([^}]*)\}")


def _iota(dims: list[int], perm: str | None) -> np.ndarray:
    """Returns iota(prod(dims)) reshaped to `dims` and transposed by `perm` (HLO's `[dims]T(perm)`)."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _mesh_groups(match: re.Match) -> tuple[tuple[int, ...], ...]:
    """Returns the groups of a mesh-form replica_groups attribute (`_MESH_GROUPS`)."""
    axes = [(name.strip(" '"), int(size)) for name, size in
            (item.rsplit("=", 1) for item in match.group(1).split(","))]
    sizes = [size for _, size in axes]
    ids = (_iota([int(d) for d in match.group(2).split(",")], match.group(3)).reshape(sizes) if match.group(2)
           else np.arange(math.prod(sizes)).reshape(sizes))
    grouped = {name.strip(" '") for name in match.group(4).split(",") if name.strip()}
    along = [index for index, (name, _) in enumerate(axes) if name in grouped]
    kept = [index for index in range(len(axes)) if index not in along]
    size = math.prod(sizes[index] for index in along)
    return tuple(tuple(int(i) for i in row) for row in ids.transpose(kept + along).reshape(-1, size))


def _groups(attributes: str) -> tuple[tuple[int, ...], ...]:
    """Returns the device groups an instruction's attributes name (listed, in iota or in mesh form); () for
    none."""
    if mesh := _MESH_GROUPS.search(attributes):
        return _mesh_groups(mesh)
    if listed := _LISTED_GROUPS.search(attributes):
        return tuple(tuple(int(i) for i in group.split(",") if i)
                     for group in re.findall(r"\{([\d,]*)\}", listed.group(1)))
    if iota := _IOTA_GROUPS.search(attributes):
        ids = _iota([int(d) for d in iota.group(3).split(",")], iota.group(4))
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(int(iota.group(1)), int(iota.group(2))))
    return ()


def _collective_kind(instruction: _Instruction) -> str | None:
    kind = instruction.op.removeprefix("ragged-").removesuffix("-start")
    return kind if kind in COLLECTIVE_KINDS else None


def conditional_branch_ops(hlo_text: str, op: str) -> list[tuple[int, ...]]:
    """Returns, for each `conditional` of the module, how many `op` instructions each of its branches holds
    (in the branch's computation and the computations it calls, each instruction once), in branch order."""
    computations, _ = _computations(hlo_text)

    def held(name: str) -> int:
        return sum(instruction.op == op for callee in _multipliers(computations, name)
                   for instruction in computations.get(callee, ()))

    return [tuple(held(branch) for branch, _ in _callees(instruction))
            for instructions in computations.values() for instruction in instructions
            if instruction.op == "conditional"]


def dot_operand_dtypes(hlo_text: str) -> list[tuple[str, ...]]:
    """Returns the operand dtypes of every `dot` instruction in the module, fused computations' included
    (a dot of bfloat16 values that XLA upcast reads `f32` operands)."""
    computations, _ = _computations(hlo_text)
    instructions = [instruction for body in computations.values() for instruction in body]
    dtypes = {instruction.name: arrays[0][0] for instruction in instructions if (arrays := _arrays(instruction.shape))}
    return [tuple(dtypes[name] for name in instruction.operands) for instruction in instructions
            if instruction.op == "dot"]


def collective_lines(hlo_text: str, kind: str) -> list[str]:
    """Returns the HLO instruction lines of one collective kind (for tests and debugging)."""
    return [line.strip() for line in hlo_text.splitlines()
            if (instruction := _parse_instruction(line)) and _collective_kind(instruction) == kind]


# FLOPs as XLA's HloCostAnalysis counts them: one per output element of an elementwise op
# (transcendentals such as exp, log, rsqrt are a separate count, not FLOPs); 2 per
# multiply-accumulate of a dot or convolution; a reducer's FLOPs per application; data
# movement (copy, transpose, slices, gather, broadcast) none.
_ELEMENTWISE = frozenset((
    "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "and", "or", "xor", "not",
    "negate", "abs", "sign", "compare", "select", "clamp", "convert", "bitcast-convert", "stochastic-convert",
    "floor", "ceil", "round-nearest-afz", "round-nearest-even", "is-finite", "shift-left",
    "shift-right-logical", "shift-right-arithmetic", "popcnt", "count-leading-zeros", "real", "imag",
    "complex", "reduce-precision",
))


def _attribute_ints(attributes: str, key: str) -> list[int]:
    match = re.search(rf"\b{key}=\{{([\d,]*)\}}", attributes)
    return [int(d) for d in filter(None, match.group(1).split(","))] if match else []


def _reducer(instruction: _Instruction) -> str | None:
    match = re.search(r"\bto_apply=%?([\w.\-]+)", instruction.attributes)
    return match.group(1) if match else None


class _FlopCounter:
    """FLOPs of each computation's own instructions (callees excluded: they have their own multipliers)."""

    def __init__(self, computations: dict[str, list[_Instruction]]):
        self.computations = computations
        self.counted: dict[str, float] = {}

    def own(self, name: str) -> float:
        if name not in self.counted:
            instructions = self.computations.get(name, ())
            shapes = {instruction.name: instruction.shape for instruction in instructions}
            self.counted[name] = float(sum(self._instruction(i, shapes) for i in instructions))
        return self.counted[name]

    def _instruction(self, instruction: _Instruction, shapes: dict[str, str]) -> float:
        op, out = instruction.op, _elements(instruction.shape)

        def operand_elements(index: int) -> int:
            return sum(_elements(shapes.get(instruction.operands[index], "")))

        if op in _ELEMENTWISE:
            return out[0]
        if op == "dot":
            lhs = _arrays(shapes.get(instruction.operands[0], ""))[0][1]
            width = math.prod(lhs[d] for d in _attribute_ints(instruction.attributes, "lhs_contracting_dims"))
            return 2 * out[0] * width
        if op == "convolution":
            return _convolution_flops(instruction, shapes)
        if op in ("all-reduce", "all-reduce-start"):
            return sum(out)  # XLA's model: two inputs per output element
        if op == "sort":
            n = operand_elements(0)
            return n * math.ceil(math.log2(n)) if n > 1 else 0
        reducer = _reducer(instruction)
        if reducer is None:
            return 0
        if op == "reduce":
            return (operand_elements(0) - out[0]) * self.own(reducer)
        if op == "reduce-window":
            window = re.search(r"\bwindow=\{size=([\dx]+)", instruction.attributes)
            size = math.prod(int(s) for s in window.group(1).split("x")) if window else 1
            return (size - 1) * out[0] * self.own(reducer)
        if op == "scatter":  # operands: N inputs, the indices, N updates
            return operand_elements(len(instruction.operands) // 2 + 1) * self.own(reducer)
        return 0


def _window(attributes: str, spatial_dims: int) -> dict[str, list[int]]:
    """Returns a convolution's window per spatial dimension: size, stride, pad_low, lhs_dilate, rhs_dilate."""
    match = re.search(r"\bwindow=\{([^}]*)\}", attributes)
    fields = dict(field.split("=") for field in match.group(1).split()) if match else {}

    def ints(key: str, default: int, per_dim: int = 1) -> list[int]:
        text = fields.get(key)
        return [int(n) for n in re.findall(r"-?\d+", text)] if text else [default] * spatial_dims * per_dim

    return {"size": ints("size", 1), "stride": ints("stride", 1), "pad_low": ints("pad", 0, per_dim=2)[::2],
            "lhs_dilate": ints("lhs_dilate", 1), "rhs_dilate": ints("rhs_dilate", 1)}


def _taps(window: dict[str, list[int]], dim: int, input_length: int, output_length: int) -> int:
    """Returns the (kernel tap, output position) pairs of one spatial dimension that read a real input element."""
    taps = 0
    for tap in range(window["size"][dim]):
        for position in range(output_length):
            index = position * window["stride"][dim] - window["pad_low"][dim] + tap * window["rhs_dilate"][dim]
            dilate = window["lhs_dilate"][dim]
            taps += index % dilate == 0 and 0 <= index // dilate < input_length
    return taps


def _convolution_flops(instruction: _Instruction, shapes: dict[str, str]) -> float:
    """Returns 2 x the multiply-accumulates of a convolution, counting, as XLA does, only the
    kernel taps that land inside the (padded, dilated) input."""
    labels = re.search(r"\bdim_labels=(\w+)_\w+->(\w+)", instruction.attributes)
    lhs_labels, out_labels = labels.groups()
    lhs = _arrays(shapes[instruction.operands[0]])[0][1]
    out = _arrays(instruction.shape)[0][1]
    groups = dict(re.findall(r"\b(feature|batch)_group_count=(\d+)", instruction.attributes))
    window = _window(instruction.attributes, len(lhs) - 2)
    taps = math.prod(_taps(window, d, lhs[lhs_labels.index(str(d))], out[out_labels.index(str(d))])
                     for d in range(len(lhs) - 2))
    input_features = lhs[lhs_labels.index("f")] // int(groups.get("feature", 1))
    batch = lhs[lhs_labels.index("b")] // int(groups.get("batch", 1))
    return 2 * input_features * out[out_labels.index("f")] * batch * taps


def _flops(computations: dict[str, list[_Instruction]], entry: str, counter: _FlopCounter, *,
           loop_iterations: bool) -> float:
    multipliers = _multipliers(computations, entry, loop_iterations=loop_iterations)
    return sum(factor * counter.own(name) for name, factor in multipliers.items())


def estimated_flops(hlo_text: str, *, loop_iterations: bool = True) -> float:
    """Returns the FLOPs of one run of the module, estimated from its HLO text as XLA's cost analysis counts them.

    With `loop_iterations=False` every `while` body counts once, which is what
    `compiled.cost_analysis()` reports; the default counts it once per
    iteration (its `known_trip_count`). Custom calls count zero.
    """
    computations, entry = _computations(hlo_text)
    if entry is None:
        return 0.0
    return _flops(computations, entry, _FlopCounter(computations), loop_iterations=loop_iterations)


def flops_per_run(hlo_text: str, xla_flops: float) -> float:
    """Returns XLA's FLOP count of one run of the module with every loop body counted once per iteration.

    `xla_flops` is `compiled.cost_analysis()["flops"]`, which counts a while
    body once whatever its trip count; the estimated FLOPs of each computation
    inside loops are added (multiplier - 1) more times. Code outside loops keeps
    XLA's own count, so only the loop bodies rest on the estimate.
    """
    computations, entry = _computations(hlo_text)
    if entry is None:
        return xla_flops
    counter = _FlopCounter(computations)
    return (xla_flops + _flops(computations, entry, counter, loop_iterations=True)
            - _flops(computations, entry, counter, loop_iterations=False))


_OP_NAME = re.compile(r'op_name="([^"]*)"')
PHASES = ("forward", "backward", "update", "unnamed")
_NARROW_FLOATS = ("bf16", "f16", "f8e4m3fn", "f8e5m2")


def _widening_or_narrowing(instruction: _Instruction, shapes: dict[str, str]) -> bool:
    """Whether `instruction` is a convert between a 16- or 8-bit float and float32 that no jax op asked for
    (no op name): what a compiler without that arithmetic adds around each op to run it in float32."""
    if instruction.op != "convert" or _OP_NAME.search(instruction.attributes):
        return False
    operand = _arrays(shapes.get(instruction.operands[0], ""))
    dtypes = {_arrays(instruction.shape)[0][0], *(dtype for dtype, _ in operand[:1])}
    return len(dtypes) == 2 and "f32" in dtypes and bool(dtypes & set(_NARROW_FLOATS))


def float_normalization_flops(hlo_text: str) -> float:
    """Returns the estimated FLOPs of one run (loop bodies x trip count) spent in converts between 16-bit
    floats and float32 that the compiler added (`_widening_or_narrowing`): a compiler without 16-bit float
    arithmetic runs those ops in float32 this way; a target with it runs them as they are."""
    computations, entry = _computations(hlo_text)
    if entry is None:
        return 0.0
    total = 0.0
    for name, factor in _multipliers(computations, entry).items():
        instructions = computations.get(name, ())
        shapes = {instruction.name: instruction.shape for instruction in instructions}
        total += factor * sum(_elements(i.shape)[0] for i in instructions if _widening_or_narrowing(i, shapes))
    return total


def flops_by_phase(hlo_text: str) -> dict[str, float]:
    """Returns the estimated FLOPs of one run (loop bodies x trip count) by the phase jax's op names give
    each instruction: `backward` under `transpose(` (the gradient and its reductions), `forward` under
    `jvp(` (the loss), `update` for the rest of jax's (what a train step does with the gradient: the
    optimizer, the update's application, norms), `unnamed` for what XLA added without an op name."""
    phases = dict.fromkeys(PHASES, 0.0)
    for (phase, _, _), flops in flops_by_op(hlo_text).items():
        phases[phase] += flops
    return phases


def flops_by_op(hlo_text: str, *, without_widening: bool = False) -> dict[tuple[str, str, str], float]:
    """Returns the estimated FLOPs of one run (loop bodies x trip count) by (phase as `flops_by_phase`
    names it, HLO op, the jax op that made it: the last part of its op name, "" when unnamed); with
    `without_widening`, less the converts `float_normalization_flops` counts."""
    computations, entry = _computations(hlo_text)
    if entry is None:
        return {}
    counter, totals = _FlopCounter(computations), {}
    for name, factor in _multipliers(computations, entry).items():
        instructions = computations.get(name, ())
        shapes = {instruction.name: instruction.shape for instruction in instructions}
        for instruction in instructions:
            flops = counter._instruction(instruction, shapes)
            if not flops or (without_widening and _widening_or_narrowing(instruction, shapes)):
                continue
            named = _OP_NAME.search(instruction.attributes)
            op_name = named.group(1) if named else None
            phase = ("unnamed" if op_name is None else "backward" if "transpose(" in op_name
                     else "forward" if "jvp(" in op_name else "update")
            jax_op = re.sub(r"\[.*?\]", "", op_name.rsplit("/", 1)[-1]) if op_name else ""
            key = (phase, instruction.op, jax_op)
            totals[key] = totals.get(key, 0.0) + factor * flops
    return totals
