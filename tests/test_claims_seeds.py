"""Verdicts over seeds (gradscope.claims.seeds), the controls' table, the quoted sentences, and
Wang's in-training embedding rule, on tables built here."""

from __future__ import annotations

import inspect

import numpy as np
import pandas as pd
import pytest

from gradscope import claims
from gradscope.claims import Verdict
from gradscope.claims.quotes import QUOTES
from gradscope.table import make_frame


def _v(margin: float | None, holds: bool | None = None, value: float = 1.0) -> Verdict:
    if holds is None and margin is not None:
        holds = margin > 0
    return Verdict("Fig. X", "c", "rule", {"x": value}, holds, "ci", "", margin)


@pytest.mark.parametrize(("margins", "expected"), [
    ([0.5, 0.6, 0.55], True),            # every seed far on the claim's side
    ([-0.5, -0.6, -0.55], False),
    ([0.02, 0.3, -0.2], None),           # the mean margin lies inside the seeds' spread
    ([0.1, 0.1, 1.0], None),             # all positive, yet mean 0.4 < spread 0.6: inconclusive, not holds
    ([0.5, 0.6], None),                  # two seeds: too few
])
def test_a_margin_inside_the_spread_is_inconclusive(margins, expected):
    v = claims.combine([_v(m, value=m) for m in margins])
    assert v.holds is expected and v.seeds == len(margins)
    assert v.margin == pytest.approx(np.mean(margins))
    assert v.margin_spread == pytest.approx(max(abs(m - np.mean(margins)) for m in margins))
    assert v.values["x"] == pytest.approx(np.mean(margins)) and v.spread["x"] == pytest.approx(v.margin_spread)
    if expected is None:
        assert "spread" in v.detail or "seed" in v.detail


def test_outcome_rules_need_every_seed():
    assert claims.combine([_v(None, True)] * 3).holds is True
    assert claims.combine([_v(None, False)] * 3).holds is False
    assert claims.combine([_v(None, True), _v(None, True), _v(None, False)]).holds is None
    mixed = claims.combine([_v(None, True), _v(None, True), Verdict("F", "c", "r", {}, None, "ci", "partial run")])
    assert mixed.holds is None and "1 of 3 seeds inconclusive" in mixed.detail
    assert claims.combine([_v(None, True)], min_seeds=1).holds is True


def test_runs_are_split_by_seed_and_decided_on_each():
    rows = []
    for k, (post, b2t) in enumerate([(0.1, 0.5), (0.12, 0.45), (0.09, 0.6)]):
        for variant, bottom in (("post_ln", post), ("b2t", b2t)):
            run = claims.seed_run(variant, k)
            rows += [dict(run=run, variant=variant, step=0, stack="decoder", layer=i, site=f"decoder.layers.{i - 1}.out",
                          role="layer_out", quantity="act_grad_norm", value=v) for i, v in ((1, bottom), (2, 1.0))]
    df = make_frame(rows)
    assert sorted(df.run.unique()) == ["b2t", "b2t · seed 1", "b2t · seed 2", "post_ln", "post_ln · seed 1",
                                       "post_ln · seed 2"]
    assert [claims.split_run(r) for r in ("b2t", "b2t · seed 2")] == [("b2t", 0), ("b2t", 2)]
    assert {k: sorted(t.run.unique()) for k, t in claims.by_seed(df).items()} == {k: ["b2t", "post_ln"] for k in range(3)}
    v = claims.over_seeds(claims.takase_fig3_b2t_mitigates, df)
    assert v.holds is True and v.seeds == 3 and v.quote == QUOTES["takase_fig3_b2t_mitigates"]
    assert v.values["b2t bottom/top"] == pytest.approx(np.mean([0.5, 0.45, 0.6]))
    logs = np.log([0.5 / 0.1, 0.45 / 0.12, 0.6 / 0.09])
    assert v.margin == pytest.approx(logs.mean())


def test_controls_have_their_own_table(tmp_path):
    claim = Verdict("Fig. X", "a claim", "r", {"x": 1.0}, True, "ci", "", 0.5, quote="P §1: \"it is.\"", seeds=3,
                    spread={"x": 0.1}, margin_spread=0.2)
    control = Verdict("Fig. X", "a control", "r", {"y": 2.0}, True, "ci", "", kind=claims.CONTROL)
    text = claims.write_claims([control, claim], tmp_path / "CLAIMS.md", analysis="a").read_text()
    head, controls = text.split("Controls (checks of the method, not verdicts on the paper):")
    assert "a claim" in head and "a control" not in head and "a control" in controls and "a claim" not in controls
    assert "| P §1: \"it is.\" |" in head and "| 3 |" in head and "x = 1 ± 0.1" in head and "| 0.5 ± 0.2 |" in head
    assert claims.verdict_line(control).startswith("[holds] control: Fig. X")


def test_every_rule_quotes_its_paper():
    rules = [name for name, obj in inspect.getmembers(claims, inspect.isfunction)
             if name.startswith(("takase_", "wang_", "xu_", "nguyen_", "sweep_", "qk_norm_", "z_loss_", "logits_"))
             and name != "sweep_summary"]
    assert len(rules) >= 18
    for name in rules:
        quote = QUOTES.get(name, "")
        assert quote.count("\"") >= 2 and ("§" in quote or "abstract" in quote), name


def _embed_rows(run: str, values: dict[int, float]) -> list[dict]:
    return [dict(run=run, variant="post_ln", step=s, stack="encoder", layer=0, site="encoder.embed.out", role="embed",
                 quantity="act_grad_norm", value=v) for s, v in values.items()]


@pytest.mark.parametrize(("deep_tail", "expected"), [(1e-6, True), (5e-4, True), (5e-3, False), (5e-2, False)])
def test_wang_in_training_rule(deep_tail, expected):
    steps = range(0, 41, 5)
    deep = {s: 0.05 if s == 0 else (0.05 if s < 20 else deep_tail) for s in steps}
    shallow = dict.fromkeys(steps, 0.1)
    df = make_frame(_embed_rows("deep", deep) + _embed_rows("shallow", shallow))
    v = claims.wang_embed_grad_collapses_in_training(df, deep="deep", shallow="shallow")
    assert v.holds is expected
    assert v.values["deep/shallow"] == pytest.approx(deep_tail / 0.1)
    assert v.margin == pytest.approx(np.log(1e-2 / (deep_tail / 0.1)))
    too_short = make_frame(_embed_rows("deep", {0: 1.0, 1: 1.0}) + _embed_rows("shallow", {0: 1.0, 1: 1.0}))
    assert claims.wang_embed_grad_collapses_in_training(too_short, deep="deep", shallow="shallow").holds is None


def test_lr_sensitivity_is_wortsmans_metric():
    """E_lr[min(l(lr), l0) - l*]: a diverged run costs l0 - l*, a run worse than its start is capped at l0."""
    runs = pd.DataFrame({"final_loss": [2.0, 2.5, np.inf, 4.0], "first_loss": [3.0, 3.0, 3.0, 3.0]})
    assert claims.lr_sensitivity(runs) == pytest.approx(np.mean([0.0, 0.5, 1.0, 1.0]))
