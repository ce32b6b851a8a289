"""The effdl package's import graph has no cycle (top-level, lazy and TYPE_CHECKING imports)."""

import ast
from pathlib import Path

import effdl

ROOT = Path(effdl.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The ``modules`` that ``source`` imports anywhere: top level, in functions, under
    ``TYPE_CHECKING``. ``from pkg import name`` counts as ``pkg.name`` when that is a module."""
    targets = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                targets.add(sub if sub in modules else node.module)
    return targets & modules


def import_graph() -> dict[str, set[str]]:
    """Each effdl module -> the other effdl modules it imports."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    return {
        name: imported_modules(path.read_text(encoding="utf-8"), modules) - {name}
        for name, path in paths.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_imports_are_found_wherever_they_are():
    source = """
from typing import TYPE_CHECKING
import p.a
from p import b, CONSTANT
if TYPE_CHECKING:
    from p.c import Thing
def f():
    from p.d import g
import other
"""
    modules = {"p", "p.a", "p.b", "p.c", "p.d", "p.e"}
    assert imported_modules(source, modules) == {"p", "p.a", "p.b", "p.c", "p.d"}


def test_graph_covers_the_package():
    graph = import_graph()
    assert {"effdl.cli", "effdl.data.packing", "effdl.ops.document_mask"} <= set(graph)
    assert "effdl.results" in graph["effdl.cli"]


def test_no_import_cycle_among_effdl_modules():
    assert cycles(import_graph()) == []


def runtime_imports(source: str) -> set[str]:
    """Module names ``source`` imports outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(source)
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for n in ast.walk(block)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_profiling_depends_on_nothing_above_it():
    """effdl.profiling measures; models, data, training set-ups and the CLI build on it, not the
    other way round (type-only imports aside)."""
    allowed = ("effdl.profiling", "effdl.tables", "effdl.gc_pause", "effdl.results")
    for path in (ROOT / "profiling").rglob("*.py"):
        effdl_imports = {m for m in runtime_imports(path.read_text()) if m.startswith("effdl")}
        assert all(m.startswith(allowed) for m in effdl_imports), (path.name, effdl_imports)
