"""Takase 2022 Fig. 5: cosine similarities among layer outputs of trained shallow models.

post_ln, pre_ln and b2t encoder-decoders at the shallow setting (6L-6L; 2L-2L at ci) are
trained on the ``reverse`` task with identical hyper-parameters, on 3 seeds (the B2T
margins are near-ties that one seed decided either way), with the recipe of
``analyses.convergence`` at default: 300 steps with a 100-step warm-up (8 % of the run would not
cover Adam's β₂ = 0.98 horizon). They are convergence's shallow runs: ``python -m analyses``
trains them once for both (``analyses.pool``). The trained
models (eval mode, no dropout) then read validation batch 0, and S[i, j] = mean over
sampled non-pad tokens of cos(y_i, y_j), y_0 the embedding output, is recorded for
each stack.

Claims (both stacks): Pre-LN's lower-left similarities (deep outputs vs shallow ones)
exceed Post-LN's; B2T's stay closer to Post-LN's than Pre-LN's do.

    python -m analyses.cosine --preset default --out figures
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import pandas as pd

from analyses.outputs import tag
from analyses.runner import Analysis, entry_point
from analyses.runs import RunSpec, Snapshot, TrainRequest
from gradscope import claims, plots

VARIANTS = ("post_ln", "pre_ln", "b2t")
STACKS = ("encoder", "decoder")
STEPS = {"ci": 100, "default": 300, "paper": 50_000}
WARMUP = {"ci": None, "default": 100, "paper": None}  # None: the preset's fraction (4k of 50k for paper)


class Cosine(Analysis):
    """The three variants at the shallow setting, trained ``STEPS`` steps, then cosine on validation batch 0."""

    name = "cosine"
    min_train_seeds = 3

    @property
    def depth(self) -> int:
        return self.preset.shallow

    def plan(self) -> list[RunSpec]:
        n, p = self.depth, self.preset
        return [self.trained(v, p.model(v, n, n), STEPS[p.name], k=k, warmup=WARMUP[p.name])
                for k in self.seed_indices(trained=True) for v in VARIANTS]

    def request(self, spec: RunSpec) -> TrainRequest:
        """The training table, and cosine on validation batch 0 after training (eval mode)."""
        return TrainRequest(spec, after=(Snapshot(("cosine",), split="valid", index=0, eval_mode=True),))

    def conclude(self, df: pd.DataFrame) -> list[claims.Verdict]:
        out = []
        for stack in STACKS:
            for rule in (claims.takase_fig5_pre_ln_higher, claims.takase_fig5_b2t_keeps_post_ln):
                out.append(tag(claims.over_seeds(rule, df, stack=stack, preset=self.preset.name),
                               f"{self.depth}L-{self.depth}L trained"))
        return out

    def draw(self, df: pd.DataFrame, verdicts) -> plt.Figure:
        fig, axes = plt.subplots(2, 4, figsize=(22, 10), layout="constrained")
        n, preset, df = self.depth, self.preset.name, self.first_seed(df)
        for row, stack in enumerate(STACKS):
            for col, variant in enumerate(VARIANTS):
                plots.cosine_heatmap(df, variant=variant, stack=stack, ax=axes[row, col],
                                     title=f"Takase Fig. 5: {variant} {n}L-{n}L · preset {preset}")
        for ax, quantity, label in zip(axes[:, 3], ("loss", "val_loss"), ("training", "validation")):
            plots.loss_curves(df, quantity=quantity, hue_order=VARIANTS, ax=ax,
                              title=f"{label} loss of the three models · preset {preset}")
        return self.annotate(fig, "Cosine similarities among layer outputs after training (eval mode, validation batch 0)",
                             [self.plan()[0].train.describe(), "same hyper-parameters for every variant; xavier init"],
                             verdicts)


ANALYSIS = Cosine
main = entry_point(__doc__, Cosine)

if __name__ == "__main__":
    sys.exit(main())
