"""Claim rules on synthetic tables built here: holds, does not hold, inconclusive; CLAIMS.md."""

from __future__ import annotations

import os

os.environ.setdefault("MPLBACKEND", "Agg")

from collections.abc import Callable, Sequence  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from gradscope import claims  # noqa: E402
from gradscope.claims import Verdict  # noqa: E402
from gradscope.table import make_frame  # noqa: E402
from gradscope.train import LossBounds  # noqa: E402

BOUNDS = LossBounds(chance=5.0, floor=1.0, chance_accuracy=0.1, smoothing=0.1)  # gap closed = (5 - best) / 4


def frame(*parts: list[dict]) -> pd.DataFrame:
    return make_frame([row for part in parts for row in part])


def outs(variant: str, values: Sequence[float], stack: str = "decoder", run: str | None = None) -> list[dict]:
    """act_grad_norm at layer outputs 1..L (two micro-batches each, same mean)."""
    return [dict(run=run or variant, variant=variant, step=0, micro_step=m, stack=stack, layer=i,
                 site=f"{stack}.layers.{i - 1}.out", role="layer_out", quantity="act_grad_norm", value=v * (0.5 + m))
            for i, v in enumerate(values, start=1) for m in (0, 1)]


def locations(layers: dict[int, Sequence[float]], variant: str = "post_ln") -> list[dict]:
    suffixes = ["self_attn.norm.in", "self_attn.norm.out", "cross_attn.norm.in", "cross_attn.norm.out", "ffn.norm.in"]
    return [dict(run=variant, variant=variant, step=0, stack="decoder", layer=i, site=f"decoder.layers.{i - 1}.{s}",
                 role="norm_" + s.rsplit(".", 1)[1], quantity="act_grad_norm", value=v)
            for i, g in layers.items() for s, v in zip(suffixes, g) if np.isfinite(v)]


def matrix(variant: str, mat: np.ndarray, quantity: str, stack: str) -> list[dict]:
    return [dict(run=variant, variant=variant, step=3, stack=stack, layer=i, layer_j=j, site=f"{stack}.m",
                 quantity=quantity, value=float(mat[i, j])) for i in range(len(mat)) for j in range(i + 1)]


def cosine(variant: str, lower_left: float, size: int = 5) -> list[dict]:
    """Cosine matrix at 0.5 everywhere except the lower-left block (i > L/2, j < L/2)."""
    mat = np.full((size, size), 0.5)
    top = size - 1
    for i in range(size):
        for j in range(size):
            if i > top / 2 and j < top / 2:
                mat[i, j] = lower_left
    return matrix(variant, mat, "cosine", "decoder")


def losses(run: str, val: Sequence[float], variant: str | None = None) -> list[dict]:
    return [dict(run=run, variant=variant or run, step=10 * s, quantity=q, value=v)
            for s, v in enumerate(val) for q in ("val_loss", "loss")]


def train_only(run: str, loss: Sequence[float], variant: str | None = None) -> list[dict]:
    return [row for row in losses(run, loss, variant) if row["quantity"] == "loss"]


def embed(variant: str, depth: int, value: float) -> list[dict]:
    run = f"{variant}-{depth}L"
    rows = [dict(run=run, variant=variant, step=0, stack="encoder", layer=0, site="encoder.embed.out", role="embed",
                 quantity="act_grad_norm", value=value)]
    return rows + outs(variant, [1.0] * depth, stack="encoder", run=run)


def w_sigma(run: str, values: Sequence[float]) -> list[dict]:
    return [dict(run=run, variant="post_ln", step=0, stack="encoder", layer=i, site=f"encoder.layers.{i - 1}.ffn.norm",
                 quantity="ln_w_over_sigma", value=v) for i, v in enumerate(values, start=1)]


OUTCOME_OF = {True: "learned", False: "stuck at chance", None: "partial"}


def summary(rows: list[tuple]) -> pd.DataFrame:
    """(variant, init, depth, best, converged[, seed]) rows as a sweep summary."""
    return pd.DataFrame([dict(run=f"r{k}", variant=r[0], init=r[1], depth=r[2], best_val_loss=r[3],
                              converged=pd.NA if r[4] is None else r[4], seed=r[5] if len(r) > 5 else 0,
                              gap_closed=BOUNDS.gap_closed(r[3]), accuracy=np.nan, outcome=OUTCOME_OF[r[4]])
                         for k, r in enumerate(rows)], columns=list(claims.SUMMARY_COLUMNS))


AVG = np.tril(1.0 / (np.arange(5)[:, None] + 1) * np.ones((5, 5)))     # DLCL `avg` init, L = 4
SPARSE_LATE = np.tril(np.full((5, 5), 0.5))
SPARSE_LATE[3:, :] = np.tril(np.full((5, 5), 0.01))[3:, :]
SPARSE_LATE[3, 3] = SPARSE_LATE[4, 4] = 1.0                         # late rows: only the diagonal survives
DIAGONAL = AVG + np.diag(np.full(5, 2.0))

UP, DOWN = [0.1, 0.2, 0.4, 0.8], [0.8, 0.4, 0.2, 0.1]
CONV, STUCK = [5.0, 3.0, 2.0], [5.0, 4.8, 4.7]
F = claims
H, N, M = "holds", "does not hold", "inconclusive"
PARTIAL = [5.0, 3.5, 3.7]  # best 3.5: 37.5 % of the gap, neither learned nor stuck


def dl(w: np.ndarray) -> pd.DataFrame:
    return frame(matrix("dlcl_pre", w, "dlcl_weight", "encoder"))


def cos(**lower_left: float) -> pd.DataFrame:
    return frame(*(cosine(v, x) for v, x in lower_left.items()))


def loss_runs(**val: Sequence[float]) -> pd.DataFrame:
    return frame(*(losses(v, x) for v, x in val.items()))


def embeds(*pairs: tuple[int, float]) -> pd.DataFrame:
    return frame(*(embed("post_ln", d, g) for d, g in pairs))


def ws(**runs: Sequence[float]) -> pd.DataFrame:
    return frame(*(w_sigma(r, x) for r, x in runs.items()))


def sw(*rows: tuple) -> pd.DataFrame:
    return summary(list(rows))


LIN = [0.5, 0.6, 0.7, 0.8]
LOC_OK, LOC_BAD, LOC_NO_CA = [1, 2, 1, 3, 3], [1, 2, 4, 3, 3], [1, 2, np.nan, np.nan, 3]
XAV, LIP = ("post_ln", "xavier"), ("post_ln", "lipschitz")
LIPS = {"baseline_run": "base", "lipschitz_run": "lip"}

CASES: dict[str, tuple[Callable[[], Verdict], str]] = {
    "fig3 post vanishing holds": (lambda: F.takase_fig3_post_ln_vanishing(frame(outs("post_ln", UP))), H),
    "fig3 post vanishing fails": (lambda: F.takase_fig3_post_ln_vanishing(frame(outs("post_ln", DOWN))), N),
    "fig3 post vanishing missing": (lambda: F.takase_fig3_post_ln_vanishing(frame(outs("pre_ln", UP))), M),
    "fig3 pre decay holds": (lambda: F.takase_fig3_pre_ln_decay(frame(outs("pre_ln", DOWN))), H),
    "fig3 pre decay fails": (lambda: F.takase_fig3_pre_ln_decay(frame(outs("pre_ln", UP))), N),
    "fig3 pre decay one layer": (lambda: F.takase_fig3_pre_ln_decay(frame(outs("pre_ln", [1.0]))), M),
    "fig3 b2t holds": (lambda: F.takase_fig3_b2t_mitigates(frame(outs("post_ln", UP), outs("b2t", LIN))), H),
    "fig3 b2t fails": (lambda: F.takase_fig3_b2t_mitigates(frame(outs("post_ln", LIN), outs("b2t", UP))), N),
    "fig3 b2t missing": (lambda: F.takase_fig3_b2t_mitigates(frame(outs("post_ln", UP))), M),
    "fig4 holds": (lambda: F.takase_fig4_ln_drops(frame(locations({1: LOC_OK, 2: LOC_OK, 4: LOC_OK}))), H),
    "fig4 fails": (lambda: F.takase_fig4_ln_drops(frame(locations({1: LOC_OK, 2: LOC_BAD, 4: LOC_OK}))), N),
    "fig4 no cross-attn": (lambda: F.takase_fig4_ln_drops(frame(locations(dict.fromkeys((1, 2, 4), LOC_NO_CA)))), M),
    "fig4 missing layer": (lambda: F.takase_fig4_ln_drops(frame(locations({1: LOC_OK})), layers=(1, 9)), M),
    "fig5 pre higher holds": (lambda: F.takase_fig5_pre_ln_higher(cos(post_ln=0.2, pre_ln=0.8)), H),
    "fig5 pre higher fails": (lambda: F.takase_fig5_pre_ln_higher(cos(post_ln=0.8, pre_ln=0.2)), N),
    "fig5 pre higher missing": (lambda: F.takase_fig5_pre_ln_higher(cos(post_ln=0.2)), M),
    "fig5 b2t holds": (lambda: F.takase_fig5_b2t_keeps_post_ln(cos(post_ln=0.2, pre_ln=0.8, b2t=0.3)), H),
    "fig5 b2t fails": (lambda: F.takase_fig5_b2t_keeps_post_ln(cos(post_ln=0.2, pre_ln=0.8, b2t=0.9)), N),
    "fig5 b2t missing": (lambda: F.takase_fig5_b2t_keeps_post_ln(cos(post_ln=0.2, pre_ln=0.8)), M),
    "fig1 holds": (lambda: F.takase_fig1_convergence(loss_runs(post_ln=STUCK, pre_ln=CONV, b2t=CONV), BOUNDS), H),
    "fig1 partial b2t inconclusive": (
        lambda: F.takase_fig1_convergence(loss_runs(post_ln=STUCK, pre_ln=CONV, b2t=PARTIAL), BOUNDS), M),
    "fig1 partial post_ln inconclusive": (
        lambda: F.takase_fig1_convergence(loss_runs(post_ln=PARTIAL, pre_ln=CONV, b2t=CONV), BOUNDS), M),
    "fig1 diverged post holds": (
        lambda: F.takase_fig1_convergence(loss_runs(post_ln=[5.0, np.nan, 2.0], pre_ln=CONV, b2t=CONV), BOUNDS), H),
    "fig1 fails": (lambda: F.takase_fig1_convergence(loss_runs(post_ln=CONV, pre_ln=CONV, b2t=CONV), BOUNDS), N),
    "fig1 b2t stuck fails": (
        lambda: F.takase_fig1_convergence(loss_runs(post_ln=STUCK, pre_ln=CONV, b2t=STUCK), BOUNDS), N),
    "fig1 missing": (lambda: F.takase_fig1_convergence(loss_runs(post_ln=STUCK, pre_ln=CONV), BOUNDS), M),
    "fig1 no val_loss": (
        lambda: F.takase_fig1_convergence(frame(train_only("post_ln", STUCK), losses("pre_ln", CONV),
                                                losses("b2t", CONV)), BOUNDS), M),
    "sweep fails deep holds": (lambda: F.sweep_post_ln_fails_deep(sw(
        (*XAV, 6, 4.0, True), (*XAV, 18, np.nan, False), ("pre_ln", "xavier", 18, 3.0, True),
        ("b2t", "xavier", 18, 3.0, True)), min_seeds=1), H),
    "sweep fails deep one seed": (lambda: F.sweep_post_ln_fails_deep(sw(
        (*XAV, 6, 4.0, True), (*XAV, 18, np.nan, False), ("pre_ln", "xavier", 18, 3.0, True),
        ("b2t", "xavier", 18, 3.0, True))), M),
    "sweep fails deep, a train partial": (lambda: F.sweep_post_ln_fails_deep(sw(
        (*XAV, 18, np.nan, False), ("pre_ln", "xavier", 18, 3.0, True), ("b2t", "xavier", 18, 3.5, None)),
        min_seeds=1), M),
    "sweep fails deep fails": (lambda: F.sweep_post_ln_fails_deep(sw(
        (*XAV, 18, 3.5, True), ("pre_ln", "xavier", 18, 3.0, True), ("b2t", "xavier", 18, 3.0, True)),
        min_seeds=1), N),
    "sweep fails deep missing": (lambda: F.sweep_post_ln_fails_deep(sw(
        (*XAV, 18, np.nan, False), ("pre_ln", "xavier", 18, 3.0, True), ("b2t", "xavier", 12, 3.0, True)),
        min_seeds=1), M),
    "lipschitz holds": (lambda: F.sweep_lipschitz_rescues(sw(
        (*XAV, 18, np.nan, False), (*LIP, 18, 3.0, True), (*LIP, 24, 3.0, True)), min_seeds=1), H),
    "lipschitz partial inconclusive": (lambda: F.sweep_lipschitz_rescues(sw(
        (*XAV, 18, 4.9, False), (*LIP, 18, 4.1, None)), min_seeds=1), M),
    "lipschitz fails": (lambda: F.sweep_lipschitz_rescues(sw((*XAV, 18, np.nan, False), (*LIP, 18, np.nan, False)),
                                                          min_seeds=1), N),
    "lipschitz nothing to rescue": (
        lambda: F.sweep_lipschitz_rescues(sw((*XAV, 18, 3.1, True), (*LIP, 18, 3.0, True)), min_seeds=1), N),
    "lipschitz missing": (lambda: F.sweep_lipschitz_rescues(sw((*XAV, 18, np.nan, False))), M),
    "lipschitz three seeds hold": (lambda: F.sweep_lipschitz_rescues(sw(
        *[(*XAV, 18, 4.9, False, k) for k in range(3)], *[(*LIP, 18, 2.0, True, k) for k in range(3)])), H),
    "lipschitz three seeds disagree": (lambda: F.sweep_lipschitz_rescues(sw(
        *[(*XAV, 18, 4.9, False, k) for k in range(3)], (*LIP, 18, 2.0, True, 0), (*LIP, 18, 2.0, True, 1),
        (*LIP, 18, 4.9, False, 2))), M),
    "wang embed holds": (lambda: F.wang_embed_grad_vanishes(embeds((2, 1.0), (4, 0.5), (6, 0.1))), H),
    "wang embed fails": (lambda: F.wang_embed_grad_vanishes(embeds((2, 0.1), (4, 0.5), (6, 1.0))), N),
    "wang embed two depths": (lambda: F.wang_embed_grad_vanishes(embeds((2, 1.0), (4, 0.5))), M),
    "dlcl dense early holds": (lambda: F.wang_fig5_dlcl_dense_early(dl(SPARSE_LATE)), H),
    "dlcl dense early fails (avg init)": (lambda: F.wang_fig5_dlcl_dense_early(dl(AVG)), N),
    "dlcl dense early missing": (lambda: F.wang_fig5_dlcl_dense_early(dl(AVG[:2, :2])), M),
    "dlcl diagonal holds": (lambda: F.wang_fig5_dlcl_near_diagonal(dl(DIAGONAL)), H),
    "dlcl diagonal fails (avg init)": (lambda: F.wang_fig5_dlcl_near_diagonal(dl(AVG)), N),
    "dlcl diagonal small drift fails": (lambda: F.wang_fig5_dlcl_near_diagonal(dl(AVG + np.diag(np.full(5, 0.02)))), N),
    "dlcl diagonal missing": (lambda: F.wang_fig5_dlcl_near_diagonal(frame(outs("dlcl_pre", UP))), M),
    "xu shrinks holds": (lambda: F.xu_table2_post_ln_shrinks(ws(base=[0.5, 0.7, 0.9])), H),
    "xu shrinks fails": (lambda: F.xu_table2_post_ln_shrinks(ws(base=[0.9, 1.2, 1.3])), N),
    "xu shrinks missing": (lambda: F.xu_table2_post_ln_shrinks(frame(outs("post_ln", UP))), M),
    "xu lipschitz holds": (lambda: F.xu_table2_lipschitz_closer(ws(base=[0.5, 0.6], lip=[0.9, 1.05]), **LIPS), H),
    "xu lipschitz fails": (lambda: F.xu_table2_lipschitz_closer(ws(base=[0.9, 1.05], lip=[0.5, 1.6]), **LIPS), N),
    "xu lipschitz missing": (lambda: F.xu_table2_lipschitz_closer(ws(base=[0.5]), **LIPS), M),
    "nguyen holds": (
        lambda: F.nguyen_warmup_free(loss_runs(post_ln=[5.0, np.inf], pre_ln=CONV, scalenorm=CONV), BOUNDS), H),
    "nguyen post_ln partial inconclusive": (
        lambda: F.nguyen_warmup_free(loss_runs(post_ln=PARTIAL, pre_ln=CONV, scalenorm=CONV), BOUNDS), M),
    "nguyen fails": (
        lambda: F.nguyen_warmup_free(loss_runs(post_ln=[5.0, 3.0, 1.0], pre_ln=CONV, scalenorm=CONV), BOUNDS), N),
    "nguyen missing": (lambda: F.nguyen_warmup_free(loss_runs(post_ln=STUCK, pre_ln=CONV), BOUNDS), M),
}


@pytest.mark.parametrize("case", list(CASES))
def test_claim_rule(case, tmp_path):
    build, expected = CASES[case]
    v = build()
    assert v.status == expected, (v, case)
    assert (v.holds is None) == (expected == "inconclusive")
    if v.holds is not None:
        assert v.values and all(isinstance(x, float) for x in v.values.values())
    path = claims.write_claims([v], tmp_path / "figures" / "CLAIMS.md", analysis="x")
    row = next(line for line in path.read_text().splitlines() if line.startswith(f"| {v.figure}"))
    assert f"| {expected} |" in row
    line = claims.verdict_line(v)
    assert line.startswith(f"[{expected}] {v.figure}: ")


def test_claims_do_not_modify_their_input():
    df = frame(outs("post_ln", UP), outs("b2t", UP), locations({1: [1, 2, 1, 3, 3]}))
    before = df.copy()
    claims.takase_fig3_b2t_mitigates(df)
    claims.takase_fig4_ln_drops(df, layers=(1,))
    pd.testing.assert_frame_equal(df, before)


def test_ambiguous_variant_raises():
    df = frame(outs("post_ln", UP, run="a"), outs("post_ln", DOWN, run="b"))
    with pytest.raises(ValueError, match="covers runs"):
        claims.takase_fig3_post_ln_vanishing(df)


def test_fig3_values_are_the_ratio_of_micro_batch_means():
    v = claims.takase_fig3_post_ln_vanishing(frame(outs("post_ln", UP)))
    assert v.values == {"bottom/top": pytest.approx(0.1 / 0.8)}


def test_lower_left_block_and_row_density():
    s = np.arange(25, dtype=float).reshape(5, 5)
    assert claims.lower_left_mean(s) == pytest.approx(np.mean([15, 16, 20, 21]))
    np.testing.assert_allclose(claims.row_density(AVG, 0.1, 0.05), [1, 1, 1, 1, 1])
    np.testing.assert_allclose(claims.row_density(SPARSE_LATE, 0.1, 0.05), [1, 1, 1, 0.25, 0.2])


def test_run_outcome_and_sweep_summary():
    df = frame(losses("a", CONV, "post_ln"), losses("b", STUCK, "post_ln"), losses("c", [5.0, 3.0], "pre_ln"),
               [dict(run="c", variant="pre_ln", step=10, quantity="nonfinite", site="x", value=0.0)],
               train_only("d", [5.0], "pre_ln"), losses("e · seed 2", PARTIAL, "pre_ln"))
    assert claims.run_outcome(df, "a", BOUNDS).status == "learned"
    assert claims.run_outcome(df, "b", BOUNDS).status == "stuck at chance"
    out_c = claims.run_outcome(df, "c", BOUNDS)
    assert (out_c.status, out_c.converged, out_c.diverged_at) == ("diverged", False, 10)
    assert claims.run_outcome(df, "d", BOUNDS).converged is None
    assert claims.run_outcome(df, "e · seed 2", BOUNDS).status == "partial"
    meta = pd.DataFrame({"run": ["a", "b", "d", "e · seed 2"], "init": ["xavier", "lipschitz", "xavier", "xavier"],
                         "depth": [6, 18, 6, 6]})
    summ = claims.sweep_summary(df, meta, BOUNDS)
    assert tuple(summ.columns) == claims.SUMMARY_COLUMNS and tuple(summ.columns[:6]) == claims.SWEEP_COLUMNS
    np.testing.assert_array_equal(summ["best_val_loss"], [2.0, 4.7, np.nan, 3.5])
    np.testing.assert_allclose(summ["gap_closed"], [0.75, 0.075, np.nan, 0.375])
    assert summ["converged"].tolist()[:2] == [True, False] and summ["converged"].isna().tolist()[2:] == [True, True]
    assert summ["seed"].tolist() == [0, 0, 0, 2]
    assert summ["variant"].tolist() == ["post_ln", "post_ln", "pre_ln", "pre_ln"]


def test_outcome_is_anchored_to_the_task_not_the_untrained_loss():
    """A run that starts far above chance and ends just below it is stuck, however far it fell
    (the old rule, best <= 0.75 x the untrained loss, called it converged)."""
    rows = [dict(run="r", variant="dlcl_pre", step=1, quantity="loss", value=9.0, reduction="mean"),
            dict(run="r", variant="dlcl_pre", step=50, quantity="val_loss", value=4.8),
            dict(run="r", variant="dlcl_pre", step=50, quantity="val_accuracy", value=0.12)]
    out = claims.run_outcome(make_frame(rows), "r", BOUNDS)
    assert (out.initial, out.best, out.status) == (9.0, 4.8, "stuck at chance")
    assert out.gap_closed == pytest.approx(0.05) and out.accuracy == pytest.approx(0.12)


@pytest.mark.parametrize(("gap", "accuracy", "diverged", "status"), [
    (0.6, np.nan, False, "learned"), (0.6, 0.7, False, "learned"), (0.6, 0.3, False, "partial"),
    (0.3, 0.9, False, "partial"), (0.05, np.nan, False, "stuck at chance"), (-0.2, 0.0, False, "stuck at chance"),
    (0.9, 0.9, True, "diverged"), (np.nan, np.nan, False, "undecided")])
def test_outcome_thresholds(gap, accuracy, diverged, status):
    assert claims.classify(gap, accuracy, diverged) == status


def _verdict(claim: str, holds: bool | None) -> Verdict:
    return Verdict("Fig. X", claim, "a | b < 1", {"r": 0.5}, holds, "ci", "")


def test_write_claims_replaces_only_its_section(tmp_path):
    path = tmp_path / "figures" / "CLAIMS.md"
    claims.write_claims([_verdict("beta one", True)], path, analysis="beta")
    claims.write_claims([_verdict("alpha one", False), _verdict("alpha two", None)], path, analysis="alpha")
    text = path.read_text()
    assert text.index("## alpha") < text.index("## beta")
    assert "| does not hold |" in text and "| inconclusive |" in text and "| holds |" in text
    assert "a \\| b < 1" in text
    claims.write_claims([_verdict("beta new", False)], path, analysis="beta")
    new = path.read_text()
    assert "beta one" not in new and "beta new" in new
    assert new.split("## beta")[0] == text.split("## beta")[0]
    claims.write_claims([_verdict("beta new", False)], path, analysis="beta")
    assert path.read_text() == new
    assert sorted(p.name for p in path.parent.iterdir()) == ["CLAIMS.md"]


def test_write_claims_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "CLAIMS.md"
    claims.write_claims([_verdict("kept", True)], path, analysis="a")
    before = path.read_text()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        claims.write_claims([_verdict("lost", False)], path, analysis="a")
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["CLAIMS.md"]
    with pytest.raises(ValueError):
        claims.write_claims([], path, analysis="two\nlines")
