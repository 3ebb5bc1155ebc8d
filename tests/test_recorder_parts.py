"""The recorder's parts import one way: no file of gradscope imports itself back through
others, and inside ``gradscope/recorder/`` every import goes from a later part to an earlier
one (or stays inside its part), in the order :data:`PARTS` gives."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradscope"
PARTS = ("numerics", "discovery", "capture", "quantities", "step", "rows", "replay", "")
"""The recorder's subpackages, each importing only those before it; "" is the recorder's own
files (``recorder.py``, ``oneshot.py``, ...), which compose the parts."""


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_graph() -> nx.DiGraph:
    """Every module under gradscope/ and the gradscope modules it imports: at the top, inside
    functions, and for type hints only."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                if not base.startswith("gradscope"):
                    continue
                for alias in node.names:  # a submodule imported by name, or a name from the module
                    targets.append(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("gradscope")]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target != name:
                    graph.add_edge(name, target, line=node.lineno)
    return graph


def _part(module: str) -> str | None:
    """The recorder part a module belongs to, or None outside the recorder."""
    prefix = "gradscope.recorder"
    if not module.startswith(prefix):
        return None
    rest = module[len(prefix) + 1:].split(".")
    return rest[0] if len(rest) > 1 or rest[0] in PARTS else ""


def test_no_file_imports_itself_back():
    graph = _file_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, sorted(" -> ".join([*c, c[0]]) for c in cycles)[:10]


def test_every_recorder_file_belongs_to_a_part_and_imports_only_earlier_parts():
    graph = _file_graph()
    assert len(graph) > 100  # (every file of gradscope/ is a node)
    recorder = [m for m in graph if _part(m) is not None]
    assert {_part(m) for m in recorder} == set(PARTS), "a recorder subpackage that PARTS does not list"
    wrong = [f"{a} -> {b} (line {graph.edges[a, b]['line']})" for a, b in graph.edges
             if _part(a) is not None and _part(b) is not None and PARTS.index(_part(a)) < PARTS.index(_part(b))]
    assert not wrong, wrong


def test_every_part_says_what_it_owns():
    for part in PARTS[:-1]:
        doc = ast.get_docstring(ast.parse((PACKAGE / "recorder" / part / "__init__.py").read_text()))
        assert doc and "Imports" in doc, part


def test_no_file_of_gradscope_is_much_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 410}
    assert not long, long
