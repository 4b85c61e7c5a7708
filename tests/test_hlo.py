"""Collective accounting on HLO text."""

from parallel.hlo import collectives

_ELEMENT = "f32[1,2,40,128]{3,2,1,0}"


def _module(operands: int) -> str:
    shapes = ", ".join(("/*index=5*/" if i == 5 else "") + _ELEMENT for i in range(operands))
    args = ", ".join(f"%p{i}" for i in range(operands))
    return f"ENTRY %main () -> f32[] {{\n  %a = ({shapes}) all-to-all({args}), channel_id=1\n}}\n"


def test_tuple_collectives_of_any_width_are_counted_with_all_their_bytes():
    for operands in (2, 8):
        assert collectives(_module(operands))["all-to-all"] == {"count": 1, "bytes": operands * 2 * 40 * 128 * 4}
