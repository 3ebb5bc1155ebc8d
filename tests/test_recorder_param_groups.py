"""Every parameter in exactly one leaf group (issue 23): on the published architectures of
test_recorder_published (HF Llama, GPT-2, BERT, T5, ..., nanoGPT, x-transformers, torch.nn),
the leaf groups' squared norms add up to the total's, tied parameters counted once, and the
total equals the norm of ``p.grad`` computed here."""

from __future__ import annotations

import pytest
import torch
from published_models import NAMES
from published_rules import build

import gradscope
from gradscope.table import PARAM_ROLES


def _leaves(groups: dict) -> list[str]:
    return [g for g in groups if g and not any(o != g and o.startswith(f"{g}.") for o in groups)]


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_is_in_one_leaf_group_and_the_squares_add_up(name):
    model, run = build(name)
    rec = gradscope.Recorder(model, quantities=["param_grad_norm"])
    with rec.step(0):
        run().backward()
    rec.close()
    rows = rec.frame().set_index("site")
    by_name = dict(model.named_parameters(remove_duplicate=False))
    groups = rec.layout.param_groups
    owners: dict[int, list[str]] = {}
    for g in _leaves(groups):
        for pid in {id(by_name[p]) for p in groups[g][2]}:
            owners.setdefault(pid, []).append(g)
    unique = list(model.parameters())
    shared_across_blocks = [p for p in unique if len(owners.get(id(p), [])) > 1]
    missing = [n for n, p in model.named_parameters() if id(p) not in owners]
    assert not missing, f"{name}: parameters in no leaf group: {missing}"
    assert not shared_across_blocks, f"{name}: parameters in two leaf groups"
    want = sum(p.grad.double().square().sum().item() for p in unique if p.grad is not None) ** 0.5
    total = rows.loc["", "value"]
    assert total == pytest.approx(want, rel=1e-6)
    leaf_sq = sum(rows.loc[g, "value"] ** 2 for g in _leaves(groups) if g in rows.index)
    assert leaf_sq ** 0.5 == pytest.approx(want, rel=1e-6)
    outside = rows[rows.role != ""]
    assert set(outside.role) <= set(PARAM_ROLES)
    if any(isinstance(m, torch.nn.Embedding) for m in model.modules()):
        assert "embedding" in set(outside.role), name


def test_site_names_of_a_foreign_model_are_the_recorders():
    model, _ = build("llama")
    assert gradscope.site_names(model) == gradscope.Recorder(model).site_names and gradscope.site_names(model)


def test_llama_roles_for_embedding_final_norm_and_head():
    model, run = build("llama")
    with gradscope.record(model, quantities=["param_grad_norm"]) as rec:
        run().backward()
    df = rec.frame()
    roles = dict(zip(df.site, df.role))
    assert roles["model.embed_tokens"] == "embedding" and roles["model.norm"] == "final_norm" and roles["lm_head"] == "head"
