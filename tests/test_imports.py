"""nestor's import graph, read with `ast` (nothing is imported): no circle between modules, whether an
import runs when its module loads or inside a function, the rooms' arrows as DESIGN.md draws them, and inside
the orchestrator the arrows each room's __init__ docstring names.

Imports under `if TYPE_CHECKING:` never run, and both checks count them all the same: a type a module
names is a dependency too (the run config's, from the pure orchestrator.config.schema).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

from tests.settings import ROOT

ROOMS = ("orchestrator", "backend", "models", "parallel", "cluster")
# room -> the rooms it may import
ARROWS = {"orchestrator": {"backend", "models", "parallel", "cluster"}, "backend": {"models", "parallel"},
          "models": set(), "parallel": set(), "cluster": set()}


# Inside the orchestrator, each folder is a room whose __init__ docstring names the orchestrator rooms it may
# import in a line "Orchestrator rooms it may import: a, b." ("root": the modules of orchestrator/ itself).
ARROWS_LINE = re.compile(r"Orchestrator rooms it may import: ([\w, ]+?) ?[.(]")
ORCHESTRATOR_ROOMS = ("root", *sorted(path.parent.name for path in (ROOT / "orchestrator").glob("*/__init__.py")))
ENTRY_POINT = "orchestrator.__main__"  # `python -m nestor.orchestrator` runs commands.cli


class Import(NamedTuple):
    source: str     # importing module, e.g. "orchestrator.loop.train"
    target: str     # imported module of a room
    late: bool      # inside a function body
    where: str      # path:line


def modules(root: Path) -> dict[str, Path]:
    """Returns module name (without `nestor.`) -> file, for every module of the rooms."""
    found = {}
    for room in ROOMS:
        for path in sorted((root / room).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _statements(tree: ast.AST, typing: bool = False):
    """Yields (import statement, inside a function) for every import that can run, and with `typing` those
    under `if TYPE_CHECKING:` too."""
    def walk(node: ast.AST, late: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == \
                    "TYPE_CHECKING" and not typing:
                for inner in child.orelse:
                    yield from walk(inner, late)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, late
            yield from walk(child, late or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    yield from walk(tree, False)


def imports(root: Path, typing: bool = False) -> list[Import]:
    """Returns every import of a room's module by a room's module (absolute, `nestor.`-prefixed or relative),
    with `typing` those under TYPE_CHECKING too; importing a.b.c also runs a and a.b, which count as
    imported too."""
    known = modules(root)

    def owner(name: str) -> str | None:  # the longest module that `name` is or lies in
        name = name.removeprefix("nestor.")
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for source, path in known.items():
        for node, late in _statements(ast.parse(path.read_text(), str(path)), typing):
            if isinstance(node, ast.Import):
                named = [owner(alias.name) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                base = base.removeprefix("nestor.")
                named = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else owner(base)
                         for alias in node.names]
            for target in dict.fromkeys(filter(None, named)):
                parts = target.split(".")
                for module in (".".join(parts[:index]) for index in range(1, len(parts) + 1)):
                    if module in known and module != source and not source.startswith(module + "."):
                        found.append(Import(source, module, late, f"{path.relative_to(root)}:{node.lineno}"))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Returns the strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def graph_of(found: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in found:
        graph.setdefault(imp.source, set()).add(imp.target)
    return graph


def test_no_module_imports_itself_back_at_load_time_inside_a_function_or_for_a_type():
    found = imports(ROOT, typing=True)
    assert any(imp.late for imp in found)  # function-level imports are in the graph (the CLI's, by subcommand)
    assert cycles(graph_of(found)) == []


def test_the_cycle_check_finds_a_circle_hidden_in_a_function():
    found = [Import("orchestrator.a", "orchestrator.b", False, "a.py:1"),
             Import("orchestrator.b", "orchestrator.a", True, "b.py:9")]
    assert cycles(graph_of(found)) == [["orchestrator.a", "orchestrator.b"]]


def test_every_room_imports_only_the_rooms_its_arrows_allow_type_checking_imports_included():
    against = [f"{imp.where}: {imp.source} -> {imp.target}" for imp in imports(ROOT, typing=True)
               if imp.target.split(".")[0] != imp.source.split(".")[0]
               and imp.target.split(".")[0] not in ARROWS[imp.source.split(".")[0]]]
    assert against == []


def test_config_error_is_imported_from_its_one_home():
    """ConfigError lives in orchestrator.errors (light enough for processes without JAX); no module takes it
    from another module that only uses it, by import or as an attribute (`config_lib.ConfigError`)."""
    borrowed = []
    for root in ("orchestrator", "backend", "models", "parallel", "cluster", "bench", "tests"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                taken = isinstance(node, ast.ImportFrom) and not (node.module or "").endswith("errors") and \
                    any(alias.name == "ConfigError" for alias in node.names)
                attribute = isinstance(node, ast.Attribute) and node.attr == "ConfigError"
                if taken or attribute:
                    borrowed.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert borrowed == []


def test_the_layout_in_the_docs_names_every_module_and_folder_of_every_room():
    """docs/concepts.md's layout is read against the tree: each room's modules and folders are named there."""
    text = (ROOT / "docs" / "concepts.md").read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[layout.index("```") + 3:]
    words = set(re.findall(r"[\w.]+/?", layout[:layout.index("```")]))
    missing = []
    for room in ORCHESTRATOR_ROOMS[1:]:  # an orchestrator room's modules on the lines of its own entry
        entry = re.search(rf"^ +{room}/ +(.*?)(?=^ +\w+/ |^\S)", layout, re.M | re.S)
        named_there = set(re.findall(r"[\w.]+", entry.group(1))) if entry else set()
        missing += [f"orchestrator/{room}/{path.name} (not under {room}/)"
                    for path in sorted((ROOT / "orchestrator" / room).glob("*.py"))
                    if path.name != "__init__.py" and path.name not in named_there]
    for room in (*ROOMS, "bench"):
        for path in sorted((ROOT / room).iterdir()):
            if path.name.startswith(".") or path.name in ("__init__.py", "__pycache__"):
                continue
            if path.is_dir():
                named = f"{path.name}/" in words
            else:  # a module by its file name; a benchmark by the name `python -m bench.NAME` runs
                named = (path.stem if room == "bench" else path.name) in words
            if not named:
                missing.append(f"{room}/{path.name}")
    assert missing == []


def orchestrator_room(module: str) -> str | None:
    """Returns the orchestrator room of `module` ("orchestrator.job.step" -> "job", "orchestrator.errors" ->
    "root"), or None outside the orchestrator."""
    parts = module.split(".")
    if parts[0] != "orchestrator":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ORCHESTRATOR_ROOMS else "root"


def orchestrator_arrows() -> dict[str, set[str]]:
    """Returns orchestrator room -> the rooms its __init__ docstring says it may import."""
    arrows = {}
    for room in ORCHESTRATOR_ROOMS:
        init = ROOT / "orchestrator" / ("" if room == "root" else room) / "__init__.py"
        said = ARROWS_LINE.search(" ".join((ast.get_docstring(ast.parse(init.read_text())) or "").split()))
        assert said, f"{init.relative_to(ROOT)}'s docstring does not say which orchestrator rooms it may import"
        arrows[room] = {name.strip() for name in said.group(1).split(",")} - {"none"}
    return arrows


def against_orchestrator_arrows(found: list[Import], arrows: dict[str, set[str]]) -> list[str]:
    """Returns the imports from one orchestrator room into another that its arrows do not allow."""
    return [f"{imp.where}: {imp.source} -> {imp.target}" for imp in found
            if imp.source != ENTRY_POINT and (source := orchestrator_room(imp.source))
            and (target := orchestrator_room(imp.target)) and imp.target != "orchestrator"
            and source != target and target not in arrows[source]]


def test_each_orchestrator_room_imports_only_the_rooms_its_init_names_type_checking_imports_included():
    arrows = orchestrator_arrows()
    assert set(arrows) == set(ORCHESTRATOR_ROOMS) and len(ORCHESTRATOR_ROOMS) > 5
    assert all(allowed <= set(ORCHESTRATOR_ROOMS) for allowed in arrows.values()), arrows
    assert cycles(arrows) == []  # the rooms stack: none imports another that may import it back
    found = imports(ROOT, typing=True)
    crossing = {(orchestrator_room(imp.source), orchestrator_room(imp.target)) for imp in found}
    assert {("loop", "checkpoint"), ("job", "config"), ("commands", "loop"), ("checkpoint", "job")} <= crossing
    assert against_orchestrator_arrows(found, arrows) == []


def test_every_folder_of_the_orchestrator_is_a_room_with_an_init():
    """A folder without __init__.py would count as the root, which every room may import, unchecked."""
    folders = {path.parent for path in (ROOT / "orchestrator").rglob("*.py")} - {ROOT / "orchestrator"}
    assert sorted(str(folder.relative_to(ROOT)) for folder in folders if not (folder / "__init__.py").is_file()) == []
    assert {folder.name for folder in folders} == set(ORCHESTRATOR_ROOMS) - {"root"}  # no folder inside a room


def test_the_room_check_finds_an_import_against_the_arrows():
    arrows = {"root": set(), "config": {"root"}, "job": {"root", "config"}}
    found = [Import("orchestrator.config.schema", "orchestrator.errors", False, "a.py:1"),
             Import("orchestrator.job.step", "orchestrator.config.schema", False, "b.py:2"),
             Import("orchestrator.config.schema", "orchestrator.job.step", True, "a.py:9")]
    assert against_orchestrator_arrows(found, arrows) == ["a.py:9: orchestrator.config.schema -> orchestrator.job.step"]
