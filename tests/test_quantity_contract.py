"""The Quantity contract (issue 24): one registry from which everything about a quantity is
read, the docs' quantity reference and example generated or run from the code, parts that
import one way, and no reach into the Recorder's private state."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import networkx as nx
import pytest

import gradscope
from gradscope import distributed
from gradscope.recorder.quantities import spike
from gradscope.recorder.quantities.registry import QUANTITY_SETS, REGISTRY, reference

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradscope"
DOCS = ROOT / "docs"


def _docs_hooks():
    """docs/hooks.py, the mkdocs hook that writes the quantity reference into the docs."""
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_built_in_quantity_keeps_the_contract():
    for name, q in REGISTRY.items():
        q.check()
        assert q.name == name and q.description, name
    assert set(gradscope.QUANTITIES) == {n for q in REGISTRY.values() for n in q.names}
    assert all(set(p) <= set(REGISTRY) for p in QUANTITY_SETS.values())


def test_ranks_and_spike_read_the_registry():
    assert set(distributed.SHARED_QUANTITIES) == {n for n, q in REGISTRY.items() if q.across_ranks == "shared"}
    assert set(distributed.PER_RANK_QUANTITIES) == {n for n, q in REGISTRY.items()
                                                    if q.across_ranks not in ("shared", "local")}
    assert set(spike.WATCHED) == {n for n, q in REGISTRY.items() if q.spike_watched}


def test_the_docs_quantity_reference_is_generated_from_the_registry():
    hooks = _docs_hooks()
    page = (DOCS / "quantities.md").read_text()
    assert page.count(hooks.MARKER) == 1, "docs/quantities.md lost the marker the hook replaces"
    made = hooks.on_page_markdown(page, None, None, None)
    assert reference() in made and hooks.MARKER not in made
    for name, q in REGISTRY.items():
        assert f"### {name}\n" in made and q.description in made, name
    slow = [n for n, q in REGISTRY.items() if q.slow]
    assert slow == ["cosine", "update_ratio", "update_rms", "spectral_norm", "stable_rank"] and "every × slow_every" in made


def test_the_docs_user_quantity_example_runs(capsys):
    page = (DOCS / "own-quantity.md").read_text()
    block = page.split("<!-- user-quantity example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(block, "docs user-quantity example", "exec"), scope)
    df = scope["rec"].frame()
    assert {"act_max_abs", "act_grad_rms", "param_grad_max", "act_grad_norm"} <= set(df.quantity)
    norms = df[df.quantity == "act_grad_norm"].set_index("site").value
    rms = df[df.quantity == "act_grad_rms"].set_index("site").value
    assert set(rms.index) == set(norms.index)
    out = scope["model"](scope["torch"].randn(4, 5, 16))  # the site tensors are (4, 5, 16): rms = norm / sqrt(320)
    assert out.shape == (4, 5, 16)
    assert (rms - norms[rms.index] / 320 ** 0.5).abs().max() <= 1e-6 * norms.max()


def _part_graph() -> nx.DiGraph:
    """Parts are gradscope's top-level subpackages and modules; edges are imports between them,
    lazy (inside functions) and type-only ones included."""
    graph = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("").parts
        if rel == ("__init__",) or rel[0] == "__main__":
            continue
        src = rel[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradscope"):
                names = [node.module] if node.module != "gradscope" else [f"gradscope.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("gradscope.")]
            for name in names:
                parts = name.split(".")
                if len(parts) > 1 and parts[1] != src:
                    graph.add_edge(src, parts[1], file=str(path.relative_to(ROOT)))
    return graph


def test_parts_import_one_way():
    graph = _part_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, [" -> ".join(c + [c[0]]) + f" ({[graph.edges[a, b]['file'] for a, b in zip(c, c[1:] + c[:1])]})"
                        for c in cycles]
    assert nx.has_path(graph, "recorder", "sinks") and nx.has_path(graph, "sinks", "table")
    assert not nx.has_path(graph, "table", "recorder") and not nx.has_path(graph, "sinks", "recorder")


def test_nothing_reaches_into_the_recorder():
    reach = re.compile(r"\brec(order)?\._[a-z]")
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in ("gradscope", "analyses", "benchmarks", "notebooks")
             for p in (ROOT / folder).rglob("*.py") if p.name != "recorder.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if reach.search(line)]
    assert not found, found


def test_a_row_key_is_defined_once():
    defined = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if re.search(r"^(class Key\b|Key\s*=)", p.read_text(), re.M)]
    assert defined == ["gradscope/table/keys.py"]


@pytest.mark.parametrize("bad", ["nonfinite_grad", "act_grad_norms"])
def test_an_unknown_quantity_name_is_refused_with_the_valid_ones(bad):
    import torch

    with pytest.raises(ValueError, match="valid:"):
        gradscope.Recorder(torch.nn.Linear(2, 2), quantities=[bad])
