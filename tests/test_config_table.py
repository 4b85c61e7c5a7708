"""base.yaml is the key table (orchestrator/config/schema.py) written out: every key, its default and its comment."""

import re

import yaml

from nestor.orchestrator.loader.config import CONFIGS_DIR, key_table

_LINE = re.compile(r"^(?P<indent>\s*)(?P<name>\w+):(?P<value>[^#]*?)\s*(?:#\s?(?P<comment>.*))?$")


def base_yaml_keys() -> dict[str, tuple[object, str]]:
    """Returns dotted path -> (default, comment) for every key line of base.yaml (sections left out)."""
    keys, stack = {}, []
    for line in (CONFIGS_DIR / "base.yaml").read_text().splitlines():
        match = _LINE.match(line)
        if not match or line.lstrip().startswith("#"):
            continue
        stack = stack[:len(match["indent"]) // 2] + [match["name"]]
        if match["value"].strip():
            keys[".".join(stack)] = (yaml.safe_load(match["value"]), match["comment"] or "")
    return keys


def test_base_yaml_lists_every_key_of_the_table_with_its_default_and_comment():
    written = base_yaml_keys()
    table = {path: (default, spec) for path, _, default, spec in key_table()}
    assert list(written) == list(table)  # the same keys, in the same order
    for path, (default, spec) in table.items():
        value, comment = written[path]
        assert value == (list(default) if isinstance(default, tuple) else default), path
        assert comment == spec.comment(), f"{path}: base.yaml says {comment!r}, the table {spec.comment()!r}"


def test_every_choice_of_a_key_is_named_in_its_comment():
    for path, hint, _, spec in key_table():
        if spec.choices and "tuple" not in str(hint):
            missing = [choice for choice in spec.choices if not re.search(rf"\b{re.escape(choice)}\b", spec.doc)]
            assert not missing, f"{path}: the comment does not name {missing}"


def test_a_range_shows_in_the_comment_as_declared():
    table = {path: spec for path, _, _, spec in key_table()}
    assert table["optimizer.b1"].comment().endswith("[>= 0, < 1]")
    assert table["mesh.data"].comment().endswith("[>= 1 or -1]")
    assert table["model.preset"].bounds() == ""
