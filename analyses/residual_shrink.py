"""Xu 2020 Table 2: does each Post-LN LayerNorm shrink the residual (w/σ < 1)?

Two Post-LN encoder-decoders at the deep setting (18L-18L at default and paper, 6L-6L at
ci), one with the default ``xavier`` init and one with Xu's ``lipschitz`` init (the
paper's v1 and v1'), are trained on the ``reverse`` task with identical hyper-parameters,
on 3 seeds (300 steps with a 100-step warm-up at default).
``ln_w_over_sigma`` — mean over tokens and features of w/σ, σ the per-token std of the
norm's input — is recorded for every norm at initialisation (training batch 1, before
any update) and four times during training.

Claims: post_ln's mean w/σ is below 1 (at init and after training); the lipschitz run's
w/σ is closer to 1 than the xavier run's (at init and after training).

With ``--init-only`` nothing is trained: only the at-init half is recorded, concluded and
drawn (the paper preset's 50,000 steps need a GPU; its at-init half runs on a CPU).

    python -m analyses.residual_shrink --preset default --out figures
    python -m analyses.residual_shrink --preset paper --init-only --batch-size 64 --out figures/paper
"""

from __future__ import annotations

import dataclasses
import sys

import matplotlib.pyplot as plt
import pandas as pd

from analyses.outputs import tag
from analyses.runner import Analysis, entry_point
from analyses.runs import RunSpec
from gradscope import claims, plots

INITS = ("xavier", "lipschitz")
STEPS = {"ci": 100, "default": 300, "paper": 50_000}
WARMUP = {"ci": None, "default": 100, "paper": None}  # None: the preset's fraction (4k of 50k for paper)


def run_name(init: str) -> str:
    return f"post_ln+{init}"


class ResidualShrink(Analysis):
    """post_ln with each of :data:`INITS` at the deep setting, trained ``STEPS`` steps."""

    name = "residual_shrink"
    at_init = True  # --init-only: the at-init half alone
    quantities = ("ln_w_over_sigma",)
    recordings = 4
    min_train_seeds = 3

    @property
    def depth(self) -> int:
        return self.preset.deep

    def plan(self) -> list[RunSpec]:
        n, p = self.depth, self.preset
        return [self.trained(run_name(i), p.model("post_ln", n, n, init=i), STEPS[p.name], k=k,
                             warmup=WARMUP[p.name])
                for k in self.seed_indices(trained=True) for i in INITS]

    def conclude(self, df: pd.DataFrame) -> list[claims.Verdict]:
        name, base, lip = self.preset.name, run_name("xavier"), run_name("lipschitz")
        out = []
        moments = (("first", "at init"), ("last", "trained"))
        for step, when in moments[:1] if self.init_only else moments:
            setting = f"{self.depth}L-{self.depth}L, {when}"
            at_init = step == "first"  # what the inits give before any update: the method's check
            rows = [claims.over_seeds(claims.xu_table2_post_ln_shrinks, df, run=base, step=step, preset=name,
                                      min_seeds=1 if at_init else claims.MIN_SEEDS),
                    claims.over_seeds(claims.xu_table2_lipschitz_closer, df, baseline_run=base, lipschitz_run=lip,
                                      step=step, preset=name, min_seeds=1 if at_init else claims.MIN_SEEDS)]
            out += [tag(dataclasses.replace(v, kind=claims.CONTROL) if at_init else v, setting) for v in rows]
        return out

    def draw(self, df: pd.DataFrame, verdicts) -> plt.Figure:
        order, df = [run_name(i) for i in INITS], self.first_seed(df)
        setting = f"post_ln {self.depth}L-{self.depth}L · preset {self.preset.name}"
        title = "LayerNorm w/σ per layer: below 1, a Post-LN norm shrinks the residual (Xu 2020 Table 2)"
        same = "same hyper-parameters for both inits; step 0 = training batch 1 before any update"
        if self.init_only:
            fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), layout="constrained")
            for ax, stack in zip(axes, ("encoder", "decoder"), strict=True):
                plots.w_over_sigma(df, stack=stack, step="first", hue_order=order, ax=ax,
                                   title=f"Xu Table 2: {stack} w/σ at init, {setting}")
            return self.annotate(fig, title + ", at init", [same], verdicts)
        fig, axes = plt.subplots(2, 3, figsize=(20, 10), layout="constrained")
        for row, stack in enumerate(("encoder", "decoder")):
            for col, (step, when) in enumerate((("first", "at init"), ("last", "after training"))):
                plots.w_over_sigma(df, stack=stack, step=step, hue_order=order, ax=axes[row, col],
                                   title=f"Xu Table 2: {stack} w/σ {when}, {setting}")
        shared = [axes[r, c] for r in range(2) for c in range(2)]  # (one w/σ scale: at init and trained compare)
        low, high = min(a.get_ylim()[0] for a in shared), max(a.get_ylim()[1] for a in shared)
        for ax in shared:
            ax.set_ylim(low, high)
        plots.w_over_sigma_curves(df, hue_order=order, ax=axes[0, 2], title=f"w/σ during training, {setting}")
        plots.loss_curves(df, quantity="val_loss", hue="run", hue_order=order, ax=axes[1, 2],
                          title=f"validation loss, {setting}")
        return self.annotate(fig, title, [self.plan()[0].train.describe(), same], verdicts)


ANALYSIS = ResidualShrink
main = entry_point(__doc__, ResidualShrink)

if __name__ == "__main__":
    sys.exit(main())
