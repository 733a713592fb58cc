"""The house's import graph, read with ``ast`` from the sources (module-level and function-level imports, relative
ones resolved): no two modules import each other, directly or around a circle, and the packages lean one way.

- ``edge`` (what runs on a device) imports nothing of ``coordinator`` or ``export``;
- ``export`` imports nothing of ``coordinator`` (the coordinator imports export, not the other way);
- ``firmware_tests`` (the device conformance suite) imports nothing of ours but ``edge``.

A late import inside a function is still an import: it only moves the circle from import time to call time.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("edge", "coordinator", "export", "firmware_tests")
# package -> packages of ours it must not import
FORBIDDEN = {
    "edge": {"coordinator", "export", "firmware_tests"},
    "export": {"coordinator"},  # (export.golden writes firmware_tests' golden files from its cases: allowed)
    "firmware_tests": {"coordinator", "export"},
}


def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = list(p.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def import_graph(mods: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, int]]:
    """Module -> {module of ours it imports: line}. ``from pkg import name`` is an import of ``pkg.name`` when
    that is a module, else of ``pkg``; ``import a.b.c`` of the longest prefix that is one of ours."""

    def ours(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for m, (path, is_pkg) in mods.items():
        here = m.split(".") if is_pkg else m.split(".")[:-1]
        out = graph.setdefault(m, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                t = ours(t)
                if t is not None and t != m:
                    out.setdefault(t, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(comp: list[str], graph: dict[str, dict[str, int]], mods) -> str:
    return "; ".join(f"{a} -> {b} ({mods[a][0].relative_to(ROOT)}:{graph[a][b]})"
                     for a in comp for b in graph[a] if b in comp)


def test_no_import_circles():
    mods = modules()
    graph = import_graph(mods)
    found = cycles(graph)
    assert not found, "import circles: " + " | ".join(_describe(c, graph, mods) for c in found)


def test_packages_lean_one_way():
    mods = modules()
    graph = import_graph(mods)
    wrong = [f"{m} -> {t} ({mods[m][0].relative_to(ROOT)}:{line})"
             for m, out in sorted(graph.items()) for t, line in sorted(out.items())
             if t.split(".")[0] in FORBIDDEN.get(m.split(".")[0], ())]
    assert not wrong, "imports against the layering: " + "; ".join(wrong)


# The scanner itself, on small trees: it must see what the tests above rely on it seeing.

def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, tuple[Path, bool]]:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return modules(tmp_path)


def test_scanner_sees_late_relative_imports(tmp_path):
    mods = _tree(tmp_path, {
        "export/__init__.py": "",
        "export/build.py": "def f():\n    from .store import Store\n",
        "export/store.py": "from . import build\n",
        "edge/__init__.py": "",
        "edge/protocol/__init__.py": "",
        "edge/protocol/wire.py": "def g():\n    from ..runtime import data\n    import coordinator.rounds\n",
        "edge/runtime/__init__.py": "",
        "edge/runtime/data.py": "from edge.protocol.wire import g\n",
        "coordinator/__init__.py": "",
        "coordinator/rounds.py": "",
        "firmware_tests/__init__.py": "",
    })
    graph = import_graph(mods)
    assert graph["export.build"] == {"export.store": 2}
    assert graph["export.store"] == {"export.build": 1}
    assert graph["edge.protocol.wire"] == {"edge.runtime.data": 2, "coordinator.rounds": 3}
    assert cycles(graph) == [["edge.protocol.wire", "edge.runtime.data"], ["export.build", "export.store"]]


def test_scanner_finds_no_circle_in_a_chain(tmp_path):
    mods = _tree(tmp_path, {
        "edge/__init__.py": "from .a import x\n",
        "edge/a.py": "from .b import y\nx = 1\n",
        "edge/b.py": "y = 2\n",
        "export/__init__.py": "", "coordinator/__init__.py": "", "firmware_tests/__init__.py": "",
    })
    graph = import_graph(mods)
    assert graph["edge"] == {"edge.a": 1} and graph["edge.a"] == {"edge.b": 1}
    assert cycles(graph) == []


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_package_is_scanned(pkg):
    assert any(m == pkg or m.startswith(pkg + ".") for m in modules()), pkg
