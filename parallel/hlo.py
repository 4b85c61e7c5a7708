"""Collectives in compiled HLO text: count and bytes per step, by kind.

The text is the deterministic record of what the partitioner decided, so tests
and `nestor explain` read communication from it instead of timing it. An
instruction inside a `while` body (a scan over layers, a pipeline loop)
counts once per iteration: its computation's multiplier is the product of the
`known_trip_count`s of the loops around it.
"""

from __future__ import annotations

import re
from collections import defaultdict

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(
    # tuple shapes of six or more elements carry `/*index=5*/` comments
    r"=\s*(?P<shape>\((?:[^=]|/\*index=\d+\*/)*?\)|\S+)\s+(?P<op>ragged-all-to-all|all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _array_bytes(shape: str) -> list[int]:
    sizes = []
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        sizes.append(count * _DTYPE_BYTES.get(dtype, 4))
    return sizes


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    computations: dict[str, list[str]] = {}
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
        elif current is not None:
            computations[current].append(line)
    return computations, entry


def _multipliers(computations: dict[str, list[str]], entry: str) -> dict[str, int]:
    multiplier: dict[str, int] = defaultdict(int)

    def visit(name: str, factor: int) -> None:
        multiplier[name] += factor
        for line in computations.get(name, ()):
            trip = _TRIP.search(line)
            for role, callee in _CALLEE.findall(line):
                visit(callee, factor * (int(trip.group(1)) if role == "body" and trip else 1))
            for group in _BRANCHES.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", group):
                    visit(callee, factor)

    visit(entry, 1)
    return multiplier


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Returns {kind: {"count": n, "bytes": b}} executed per run of the HLO module.

    Bytes are the per-device result size of each collective (for an async
    `-start` tuple, its last element, the received buffer). Kinds absent from
    the module are reported with zeros.
    """
    computations, entry = _computations(hlo_text)
    result = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVE_KINDS}
    if entry is None:
        return result
    for name, factor in _multipliers(computations, entry).items():
        for line in computations.get(name, ()):
            match = _INSTRUCTION.search(line)
            if not match:
                continue
            kind = match.group("op").removeprefix("ragged-")
            sizes = _array_bytes(match.group("shape"))
            size = sizes[-1] if match.group("start") and sizes else sum(sizes)
            result[kind]["count"] += factor
            result[kind]["bytes"] += factor * size
    return result


def collective_lines(hlo_text: str, kind: str) -> list[str]:
    """Returns the HLO instruction lines of one collective kind (for tests and debugging)."""
    return [line.strip() for line in hlo_text.splitlines()
            if (m := _INSTRUCTION.search(line)) and m.group("op").removeprefix("ragged-") == kind]
