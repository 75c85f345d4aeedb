"""The package's import graph, read from the source with `ast`: no module imports one that imports
it back (directly or around a longer loop, not even for annotations), no layer imports a layer above
it (docs/architecture.md), and the OpenAI and LMI dialects depend on each other in at most one
direction.

Every import counts, also one inside a function (a "lazy" import only hides a cycle), except
those under `if TYPE_CHECKING:`, which never run (`test_no_import_cycle_counting_annotations` counts
them too: a module that needs its user back for a type is the same knot). `from pkg import sub` of
a module `pkg/sub.py` is an edge to that module, `from pkg import name` of anything else an edge to
`pkg`. That Python runs a package's `__init__` before any of its submodules is not counted as an
import: it is how packages work, and counting it would make every `__init__` that imports a
submodule a "cycle".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "lmi_serve"
ROOT = Path(__file__).resolve().parents[3] / "src" / PACKAGE


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST, annotations: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at any depth, but not in an `if TYPE_CHECKING:` body
    (with `annotations`, those too)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not annotations:
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name of `from <node.module> import ...`, as written in `module`."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (with `annotations`, also under TYPE_CHECKING)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _runtime_imports(tree, annotations):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                target = _resolve(name, path.name == "__init__.py", node)
                # `from pkg import sub` imports the module pkg.sub; `from pkg import attr`, pkg itself.
                targets = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                           for alias in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search keeping the current path)."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:  # every import of path[-1] explored: no cycle through it
                stack.pop()
                done.add(path.pop())
            elif nxt in path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_graph_sees_the_package():
    graph = import_graph()
    # A sample of edges that exist, one of each form the resolver handles.
    assert f"{PACKAGE}.errors" in graph[f"{PACKAGE}.dialects.lmi.errors"]  # from lmi_serve.errors import
    assert f"{PACKAGE}.dialects.lmi.errors" in graph[f"{PACKAGE}.server.error_routing"]  # from lmi_serve.dialects.lmi import errors
    assert f"{PACKAGE}.handler_api" in graph[PACKAGE]  # from lmi_serve.handler_api import, in an __init__


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_no_import_cycle_counting_annotations():
    """Not even for a type: a module that imports its user back under TYPE_CHECKING is a part of it
    (the scheduler's prefill was once such a mixin; it is now an object the scheduler holds)."""
    cycle = find_cycle(import_graph(annotations=True))
    assert cycle is None, "import cycle (counting TYPE_CHECKING imports): " + " -> ".join(cycle or ())


def unit_of(module: str, packages: set[str]) -> str:
    """The unit a module belongs to in the package graph: a module at the top of the package is a unit
    of its own (errors, handler_api); any other belongs to its package two levels down at most
    (`engine`, `engine.kv`, `dialects.lmi`, `serving.handlers`)."""
    parts = module.split(".")
    package = parts if module in packages else parts[:-1]
    return module if len(package) == 1 else ".".join(package[:3])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges between units. A package and its own subpackages are one layer (engine.sampling reads
    engine.types and the engine drives the sampler), so edges between them are left out."""
    packages = {name for name, path in _modules().items() if path.name == "__init__.py"}
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        a = unit_of(module, packages)
        units.setdefault(a, set())
        for target in targets:
            b = unit_of(target, packages)
            if not (a == b or a.startswith(b + ".") or b.startswith(a + ".")):
                units[a].add(b)
    return units


def test_package_graph_units():
    packages = {f"{PACKAGE}.engine", f"{PACKAGE}.engine.kv", PACKAGE}
    assert unit_of(f"{PACKAGE}.errors", packages) == f"{PACKAGE}.errors"
    assert unit_of(f"{PACKAGE}.engine.kv.slots", packages) == f"{PACKAGE}.engine.kv"
    assert unit_of(f"{PACKAGE}.engine.kv", packages) == f"{PACKAGE}.engine.kv"
    assert unit_of(f"{PACKAGE}.engine.scheduler", packages) == f"{PACKAGE}.engine"
    assert unit_of(f"{PACKAGE}.dialects.lmi.routes", packages) == f"{PACKAGE}.dialects.lmi"


# What the architecture says (docs/architecture.md), from the top: each layer imports only those below
# it. The modules at the top of the package (errors, handler_api, json_body, ...) are the ground floor
# every layer stands on: they import no layer; `__main__`, the launcher, is above them all.
# kernels/ sits above config and below model and engine: those may ask it what runs; it asks none of them.
LAYERS = ("server", "dialects", "serving", "engine", "model", "kernels", "config")
LAUNCHER = f"{PACKAGE}.__main__"


def layer_of(unit: str) -> str | None:
    """The layer of a unit (`lmi_serve.serving.handlers` -> serving); None for the ground floor."""
    parts = unit.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def layer_violations(units: dict[str, set[str]]) -> list[str]:
    """Every edge from a unit to one of a higher layer (any layer, from the ground floor)."""
    rank = {layer: len(LAYERS) - i for i, layer in enumerate(LAYERS)}  # config 1 ... server 7
    found = []
    for a, targets in units.items():
        if a == LAUNCHER:
            continue
        for b in targets:
            lower, upper = layer_of(a), layer_of(b)
            if upper is not None and (lower is None or rank[upper] > rank[lower]):
                found.append(f"{a} ({lower or 'ground floor'}) -> {b} ({upper})")
    return sorted(found)


def test_layer_violations_sees_an_arrow_up_from_every_layer():
    units = {f"{PACKAGE}.serving.handlers": {f"{PACKAGE}.dialects.lmi", f"{PACKAGE}.engine"},
             f"{PACKAGE}.handler_api": {f"{PACKAGE}.dialects.common", f"{PACKAGE}.json_body"},
             f"{PACKAGE}.dialects.lmi": {f"{PACKAGE}.serving", f"{PACKAGE}.server"},
             LAUNCHER: {f"{PACKAGE}.server"}}
    assert layer_violations(units) == [
        f"{PACKAGE}.dialects.lmi (dialects) -> {PACKAGE}.server (server)",
        f"{PACKAGE}.handler_api (ground floor) -> {PACKAGE}.dialects.common (dialects)",
        f"{PACKAGE}.serving.handlers (serving) -> {PACKAGE}.dialects.lmi (dialects)"]


def test_no_package_cycle():
    """The layers depend one way: config and the engine know no server, serving no dialect, no two
    dialects each other; a loop between packages is a layer that lost its place."""
    units = package_graph(import_graph())
    cycle = find_cycle(units)
    assert cycle is None, "package cycle: " + " -> ".join(cycle or ())
    # What the architecture says, checked directly, so a new edge shows where it broke the layering.
    found = layer_violations(units)
    assert not found, f"imports of a layer above the importer's: {found}"


# Pairs of dialect packages that may depend on each other in one direction only.
ONE_WAY = [("openai", "lmi"), ("anthropic", "openai")]


@pytest.mark.parametrize("first, second", ONE_WAY)
def test_dialects_depend_one_way(first, second):
    graph = import_graph()

    def edges(src: str, dst: str) -> list[str]:
        a, b = f"{PACKAGE}.dialects.{src}", f"{PACKAGE}.dialects.{dst}"
        return sorted(f"{m} -> {t}" for m, targets in graph.items() if m == a or m.startswith(a + ".")
                      for t in targets if t == b or t.startswith(b + "."))

    forth, back = edges(first, second), edges(second, first)
    assert not (forth and back), f"{first} and {second} import each other: {forth + back}"


# Pairs of dialect packages that import each other in neither direction: what both need is in
# dialects/common.
APART = [("lmi", "tgi"), ("anthropic", "lmi"), ("anthropic", "tgi"), ("anthropic", "triton")]


def dialect_edges(graph: dict[str, set[str]], src: str, dst: str) -> list[str]:
    """The imports from dialect package `src` (or its modules) of `dst` (or its modules)."""
    a, b = f"{PACKAGE}.dialects.{src}", f"{PACKAGE}.dialects.{dst}"
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if m == a or m.startswith(a + ".")
                  for t in targets if t == b or t.startswith(b + "."))


def test_dialect_edges_sees_an_import_either_way():
    graph = {f"{PACKAGE}.dialects.lmi.formatters": {f"{PACKAGE}.dialects.tgi.protocol"},
             f"{PACKAGE}.dialects.tgi.routes": {f"{PACKAGE}.dialects.common.schema"}}
    assert dialect_edges(graph, "lmi", "tgi") == [
        f"{PACKAGE}.dialects.lmi.formatters -> {PACKAGE}.dialects.tgi.protocol"]
    assert dialect_edges(graph, "tgi", "lmi") == []


@pytest.mark.parametrize("first, second", APART)
def test_dialects_kept_apart_import_each_other_in_neither_direction(first, second):
    graph = import_graph()
    found = dialect_edges(graph, first, second) + dialect_edges(graph, second, first)
    assert not found, f"{first} and {second} must not import each other: {found}"
