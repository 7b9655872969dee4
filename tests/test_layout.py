"""The package's layout: no import circle between ``cuproc`` modules (issue 41).

The data flows one way (headers -> ffi -> loader -> registry -> driver -> objects -> tools), so the
modules' imports must form no circle.  The graph read here has every ``from .x import`` /
``from cuproc.x import`` / ``import cuproc.x`` between two ``cuproc`` modules, at module level and inside
functions: a function-level import that only dodges a circle is still a circle.  Imports under
``if TYPE_CHECKING:`` never run and are left out (they name types for the checkers, which resolve
mutual references).  ``cuproc._fastpath_c`` (built by setup.py, absent without a compiler) and the
``.pyi`` stubs are not source modules of the graph.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cuproc

PACKAGE = Path(cuproc.__file__).resolve().parent
pytestmark = pytest.mark.slow   # the package's import graph (the tree's design, not behaviour): CI runs it
NOT_SOURCE = ("cuproc._fastpath_c", "cuproc._cnames")   # compiled, or stubs: nothing they import is ours


def _modules() -> dict[str, tuple[Path, list[str]]]:
    """Module name -> (its file, the package its relative imports start from)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["cuproc", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
            found[".".join(parts)] = (path, parts)
        else:
            found[".".join(parts)] = (path, parts[:-1])
    return found


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth, except under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_in(child))
            continue
        yield from _imports(node)


def _imports_in(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node)


def import_graph() -> dict[str, set[str]]:
    """``cuproc`` module -> the ``cuproc`` modules it imports (module or function level)."""
    modules = _modules()

    def target(name: str) -> str | None:
        if name.startswith(NOT_SOURCE):
            return None
        while name and name not in modules:   # an attribute of a module: the module
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                         or f"{base}.{alias.name}".startswith(NOT_SOURCE) else base for alias in node.names]
            for imported in names:
                if imported == "cuproc" or imported.startswith("cuproc."):
                    found = target(imported)
                    if found is not None and found != name:
                        graph[name].add(found)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_cycle_finder_names_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_function_level_imports_and_skips_type_checking_ones():
    graph = import_graph()
    assert "cuproc.loader" in graph["cuproc.driver"]                  # module level
    assert "cuproc.launch" in graph["cuproc.graph_nodes"]              # inside kernel_parts
    assert "cuproc.stream_capture" not in graph["cuproc.graph"]        # under TYPE_CHECKING only
    assert not any(name.startswith(NOT_SOURCE) for targets in graph.values() for name in targets)


def test_no_import_circle():
    """Every circle is broken (issue 41): a new one is a failure to fix by turning its upward edge the
    right way (or a small module both sides import), never an exception listed here."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())
