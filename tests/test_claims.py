"""Claim rules on synthetic tables built here: holds, does not hold, not measured; CLAIMS.md."""

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


def summary(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame([dict(run=f"r{k}", variant=v, init=i, depth=d, best_val_loss=b, converged=c)
                         for k, (v, i, d, b, c) in enumerate(rows)], columns=list(claims.SWEEP_COLUMNS))


AVG = np.tril(1.0 / (np.arange(5)[:, None] + 1) * np.ones((5, 5)))     # DLCL `avg` init, L = 4
SPARSE_LATE = np.tril(np.full((5, 5), 0.5))
SPARSE_LATE[3:, :] = np.tril(np.full((5, 5), 0.01))[3:, :]
SPARSE_LATE[3, 3] = SPARSE_LATE[4, 4] = 1.0                         # late rows: only the diagonal survives
DIAGONAL = AVG + np.diag(np.full(5, 2.0))

UP, DOWN = [0.1, 0.2, 0.4, 0.8], [0.8, 0.4, 0.2, 0.1]
CONV, STUCK = [5.0, 3.0, 2.0], [5.0, 4.8, 4.7]
F = claims
H, N, M = "holds", "does not hold", "not measured"


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
    "fig1 holds": (lambda: F.takase_fig1_convergence(loss_runs(post_ln=STUCK, pre_ln=CONV, b2t=[5.0, 3.5, 3.7])), H),
    "fig1 diverged post holds": (
        lambda: F.takase_fig1_convergence(loss_runs(post_ln=[5.0, np.nan, 2.0], pre_ln=CONV, b2t=CONV)), H),
    "fig1 fails": (lambda: F.takase_fig1_convergence(loss_runs(post_ln=CONV, pre_ln=CONV, b2t=CONV)), N),
    "fig1 b2t stuck fails": (lambda: F.takase_fig1_convergence(loss_runs(post_ln=STUCK, pre_ln=CONV, b2t=STUCK)), N),
    "fig1 missing": (lambda: F.takase_fig1_convergence(loss_runs(post_ln=STUCK, pre_ln=CONV)), M),
    "fig1 no val_loss": (
        lambda: F.takase_fig1_convergence(frame(train_only("post_ln", STUCK), losses("pre_ln", CONV),
                                                losses("b2t", CONV))), M),
    "sweep fails deep holds": (lambda: F.sweep_post_ln_fails_deep(sw(
        (*XAV, 6, 4.0, True), (*XAV, 18, np.nan, False), ("pre_ln", "xavier", 18, 3.0, True),
        ("b2t", "xavier", 18, 3.0, True))), H),
    "sweep fails deep fails": (lambda: F.sweep_post_ln_fails_deep(sw(
        (*XAV, 18, 3.5, True), ("pre_ln", "xavier", 18, 3.0, True), ("b2t", "xavier", 18, 3.0, True))), N),
    "sweep fails deep missing": (lambda: F.sweep_post_ln_fails_deep(sw(
        (*XAV, 18, np.nan, False), ("pre_ln", "xavier", 18, 3.0, True), ("b2t", "xavier", 12, 3.0, True))), M),
    "lipschitz holds": (lambda: F.sweep_lipschitz_rescues(sw(
        (*XAV, 18, np.nan, False), (*LIP, 18, 3.0, True), (*LIP, 24, 3.0, True))), H),
    "lipschitz fails": (lambda: F.sweep_lipschitz_rescues(sw((*XAV, 18, np.nan, False), (*LIP, 18, np.nan, False))), N),
    "lipschitz nothing to rescue": (
        lambda: F.sweep_lipschitz_rescues(sw((*XAV, 18, 3.1, True), (*LIP, 18, 3.0, True))), N),
    "lipschitz missing": (lambda: F.sweep_lipschitz_rescues(sw((*XAV, 18, np.nan, False))), M),
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
    "nguyen holds": (lambda: F.nguyen_warmup_free(loss_runs(post_ln=[5.0, np.inf], pre_ln=CONV, scalenorm=CONV)), H),
    "nguyen higher loss holds": (
        lambda: F.nguyen_warmup_free(loss_runs(post_ln=[5.0, 3.0, 2.5], pre_ln=CONV, scalenorm=CONV)), H),
    "nguyen fails": (lambda: F.nguyen_warmup_free(loss_runs(post_ln=[5.0, 3.0, 1.0], pre_ln=CONV, scalenorm=CONV)), N),
    "nguyen missing": (lambda: F.nguyen_warmup_free(loss_runs(post_ln=STUCK, pre_ln=CONV)), M),
}


@pytest.mark.parametrize("case", list(CASES))
def test_claim_rule(case, tmp_path):
    build, expected = CASES[case]
    v = build()
    assert v.status == expected, (v, case)
    assert (v.holds is None) == (expected == "not measured")
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
               train_only("d", [5.0], "pre_ln"))
    assert claims.run_outcome(df, "a").converged is True
    assert claims.run_outcome(df, "b").converged is False
    out_c = claims.run_outcome(df, "c")
    assert (out_c.converged, out_c.diverged_at) == (False, 10)
    assert claims.run_outcome(df, "d").converged is None
    assert claims.run_outcome(df, "b", max_fraction=0.95).converged is True
    meta = pd.DataFrame({"run": ["a", "b", "d"], "init": ["xavier", "lipschitz", "xavier"], "depth": [6, 18, 6]})
    summ = claims.sweep_summary(df, meta)
    assert tuple(summ.columns) == claims.SWEEP_COLUMNS
    np.testing.assert_array_equal(summ["best_val_loss"], [2.0, 4.7, np.nan])
    assert summ["converged"].tolist()[:2] == [True, False] and pd.isna(summ["converged"].iloc[2])
    assert summ["variant"].tolist() == ["post_ln", "post_ln", "pre_ln"]


def test_run_outcome_measures_from_the_untrained_loss():
    """The first evaluation comes after training started; the reference is step 1's training loss."""
    rows = [dict(run="r", variant="pre_ln", step=1, quantity="loss", value=6.0, reduction="mean"),
            dict(run="r", variant="pre_ln", step=50, quantity="val_loss", value=4.0),
            dict(run="r", variant="pre_ln", step=100, quantity="val_loss", value=3.9)]
    out = claims.run_outcome(make_frame(rows), "r")
    assert (out.initial, out.best, out.converged) == (6.0, 3.9, True)
    assert claims.run_outcome(make_frame(rows), "r", quantity="loss").converged is False


def _verdict(claim: str, holds: bool | None) -> Verdict:
    return Verdict("Fig. X", claim, "a | b < 1", {"r": 0.5}, holds, "ci", "")


def test_write_claims_replaces_only_its_section(tmp_path):
    path = tmp_path / "figures" / "CLAIMS.md"
    claims.write_claims([_verdict("beta one", True)], path, analysis="beta")
    claims.write_claims([_verdict("alpha one", False), _verdict("alpha two", None)], path, analysis="alpha")
    text = path.read_text()
    assert text.index("## alpha") < text.index("## beta")
    assert "| does not hold |" in text and "| not measured |" in text and "| holds |" in text
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
