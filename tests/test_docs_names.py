"""Issue 52 part 8: a user never needs a private name. Every ``gradscope`` name the docs'
examples use (their Python blocks, inline code that calls or assigns, and every name on the
user-quantity page) lives in a public namespace and exists there."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

import gradscope

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
PUBLIC = {"gradscope", "gradscope.plots", "gradscope.presets", "gradscope.sinks", "gradscope.distributed",
          "gradscope.train", "gradscope.recorder", "gradscope.table", "gradscope.integrations.hf",
          "gradscope.integrations.lightning", "gradscope.integrations.tensorboard", "gradscope.model_spec"}
"""The namespaces a user imports from: the package, and its subpackages with a public
``__all__`` or a documented entry point. Anything deeper (``gradscope.table.keys``,
``gradscope.recorder.quantities.quantity``) is the implementation's."""
CHAIN = re.compile(r"\bgradscope(?:\.\w+)+")
FROM = re.compile(r"^\s*from (gradscope[\w.]*) import \(?([\w, \n]+)\)?", re.M)


def _used(page: Path) -> set[str]:
    """The dotted gradscope names a page's examples use."""
    text = page.read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)
    spans = re.findall(r"`([^`]{1,300})`", re.sub(r"```.*?```", "", text, flags=re.S))
    if page.name != "own-quantity.md":
        spans = [s for s in spans if "(" in s or "=" in s or s.startswith(("import ", "from "))]
    names = {m for block in code + spans for m in CHAIN.findall(block)}
    for module, imported in (m for block in code + spans for m in FROM.findall(block)):
        names |= {f"{module}.{n.strip()}" for n in imported.replace("\n", ",").split(",") if n.strip()}
    return names


def _resolve(name: str) -> tuple[str, object]:
    """(the longest importable module prefix of ``name``, the object ``name`` is)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return ".".join(parts[:cut]), obj
    raise ImportError(name)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_docs_examples_use_only_public_names(page):
    private = []
    for name in sorted(_used(page)):
        if name.startswith("gradscope.integrations.") and importlib.util.find_spec("transformers") is None:
            continue
        try:
            module, _ = _resolve(name)
        except (ImportError, AttributeError) as err:
            private.append(f"{name}: does not exist ({err})")
            continue
        if module not in PUBLIC:
            private.append(f"{name}: from the private module {module}")
    assert not private, private


def test_the_user_quantity_page_names_what_it_needs_publicly():
    used = _used(ROOT / "docs" / "own-quantity.md")
    assert {"gradscope.Quantity", "gradscope.Key", "gradscope.COMBINE", "gradscope.RANK_RULES"} <= used
    assert set(gradscope.COMBINE) <= set(gradscope.RANK_RULES)
    for name in ("Key", "COMBINE", "RANK_RULES", "ReplayOptions", "find_spikes", "DEFAULT_QUANTITIES"):
        assert name in gradscope.__all__ and getattr(gradscope, name) is not None


def test_a_key_of_ones_own_adds_its_row_as_the_page_says():
    class HeadGradNorm(gradscope.Quantity):
        name = "head_grad_norm"
        description = "‖∂L/∂W‖ of the output layer"
        across_ranks = "local"
        needs_backward = True

        def collect(self, ctx):  # what docs/own-quantity.md shows: ctx.add(gradscope.Key(...), value)
            ctx.add(gradscope.Key(-1, "", None, "head", self.name, None, ""), model[1].weight.grad.norm())

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with gradscope.record(model, quantities=["act_grad_norm", HeadGradNorm()]) as rec:
        model(torch.randn(3, 4)).square().sum().backward()
    row = rec.frame().query("quantity == 'head_grad_norm'")
    assert row.site.tolist() == ["head"] and row.value.item() == pytest.approx(model[1].weight.grad.norm().item(), rel=1e-6)
