"""The learning-rate sensitivity claims (gradscope.claims.instability) on planted sweeps:
each rule holds where it should, fails where it should, and says when it cannot decide."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from gradscope import claims
from gradscope.table import make_frame


def _run_rows(run, losses, logits, log_z):
    rows = [dict(run=run, step=s, quantity="loss", value=v) for s, v in enumerate(losses, start=1)]
    rows += [dict(run=run, step=s, quantity="attn_logit_max", value=v, site="a") for s, v in logits.items()]
    rows += [dict(run=run, step=s, site="a", quantity="attn_logit_max", value=1e9, layer_j=0) for s in logits]  # a head row
    rows += [dict(run=run, step=s, quantity="output_logit_log_z", value=v) for s, v in log_z.items()]
    return rows


def _sweep(qk_growth=2.0, plain_blowup=True, z_log_z=0.5):
    """pre_ln diverges at lr 1 (logits x50); qk_norm and z-loss runs stay finite there."""
    runs, rows = {}, []
    for lr in (1e-2, 1.0):
        high = lr == 1.0
        for setting, qk, z in (("pre_ln", False, 0.0), ("pre_ln+qk_norm", True, 0.0), ("pre_ln+z_loss", False, 1e-4)):
            name = f"{setting} lr={lr:g}"
            runs[name] = (setting, qk, z, lr)
            diverges = high and not qk and not z and plain_blowup
            losses = [3.0, 2.5, math.nan] if diverges else [3.0, 2.0, 1.5]
            logits = {0: 2.0, 10: 2.0 * (qk_growth if qk else (50.0 if diverges else 3.0))}
            rows += _run_rows(name, losses, logits, {10: z_log_z if z else 3.0})
    return make_frame(rows), runs


def test_lr_summary_reads_divergence_growth_and_log_z():
    df, runs = _sweep()
    s = claims.lr_summary(df, runs).set_index("run")
    assert s.at["pre_ln lr=1", "diverged"] and not s.at["pre_ln lr=1", "stable"]
    assert s.at["pre_ln lr=1", "logit_growth"] == 50.0  # head rows (1e9) are not the layer's
    assert s.at["pre_ln+qk_norm lr=1", "stable"] and s.at["pre_ln+qk_norm lr=1", "final_loss"] == 1.5
    assert s.at["pre_ln+z_loss lr=0.01", "log_z_last"] == 0.5


def test_the_claims_hold_on_a_sweep_that_shows_them():
    df, runs = _sweep()
    s = claims.lr_summary(df, runs)
    sens = claims.qk_norm_lowers_lr_sensitivity(s)
    assert sens.holds is True  # plain: (0 + (3.0 - 1.5)) / 2 = 0.75 nats; qk_norm: 0
    assert sens.values == {"LR sensitivity qk_norm": 0.0, "LR sensitivity plain": 0.75} and sens.margin == 0.75
    logits = claims.qk_norm_bounds_logits(s)
    assert logits.holds is True and logits.margin == pytest.approx(math.log(3.0 / 2.0))  # the smaller of the two lrs'
    assert claims.logits_grow_before_divergence(s).holds is True
    assert claims.z_loss_keeps_log_z_near_zero(s).holds is True


def test_the_claims_fail_or_are_inconclusive_when_the_sweep_does_not_show_them():
    df, runs = _sweep(qk_growth=20.0, z_log_z=2.9)
    s = claims.lr_summary(df, runs)
    assert claims.qk_norm_bounds_logits(s).holds is False  # qk_norm logits grew 20x, plain's 3x at lr 0.01
    z = claims.z_loss_keeps_log_z_near_zero(s)
    assert z.holds is None and "did not act" in z.detail  # |log Z| moved 0.1 nat: too little to judge
    calm, runs = _sweep(plain_blowup=False)
    s = claims.lr_summary(calm, runs)
    assert claims.logits_grow_before_divergence(s).holds is None  # nothing became unstable
    assert claims.qk_norm_lowers_lr_sensitivity(s).holds is False  # no lower sensitivity: both 0
    empty = claims.lr_summary(make_frame([]), {})
    assert isinstance(empty, pd.DataFrame) and claims.z_loss_keeps_log_z_near_zero(empty).holds is None
