"""Wang 2019 Fig. 5 a-c: the learned DLCL layer-combination weights W.

A pre-norm DLCL (``dlcl_pre``, W initialised to ``avg``: W[r, k] = 1/(r+1), learnable)
with a deep encoder and a shallow decoder, as Wang's DLCL-30L (30-layer encoder, 6-layer
decoder; here 18L-6L at default, 6L-2L at ci, 30L-6L at paper), is trained on the
``reverse`` task on 3 seeds, 600 steps with a 100-step warm-up at default (W moved by at most
0.07 in 200 steps: the trained-state claim needs the longer run). W is recorded at
initialisation and four times during training.

Figure: W of the encoder and the decoder after training and at initialisation, masked as
in the paper (|w| < 0.1 or < 5% of the row's largest |w|), and one column — the weights of
y_10 (the middle layer at ci) over its consumer rows — at each recorded step.

Claims (both stacks): after masking, early rows are denser than later rows (also checked
at init, where the ``avg`` init alone makes late rows sparse under the absolute mask);
W's mass concentrates near the diagonal.

    python -m analyses.dlcl_weights --preset default --out figures
"""

from __future__ import annotations

import dataclasses
import math
import sys

import matplotlib.pyplot as plt
import pandas as pd

from analyses.outputs import tag
from analyses.runner import Analysis, entry_point
from analyses.runs import RunSpec
from gradscope import claims, plots

VARIANT = "dlcl_pre"
STACKS = ("encoder", "decoder")
N_ENC = {"ci": 6, "default": 18, "paper": 30}
STEPS = {"ci": 100, "default": 600, "paper": 50_000}
WARMUP = {"ci": None, "default": 100, "paper": None}  # None: the preset's fraction (4k of 50k for paper)


class DLCLWeights(Analysis):
    """One ``dlcl_pre`` model, encoder ``N_ENC`` layers and decoder ``preset.shallow``, trained
    ``STEPS`` steps; ``column`` is the layer output whose weights panel (c) follows (the paper's y_10)."""

    name = "dlcl_weights"
    quantities = ("dlcl_weight",)
    recordings = 4  # W is recorded this many times during training, plus at init
    min_train_seeds = 3

    @property
    def n_enc(self) -> int:
        return N_ENC[self.preset.name]

    @property
    def column(self) -> int:
        return 10 if self.n_enc >= 10 else self.n_enc // 2

    def plan(self) -> list[RunSpec]:
        p = self.preset
        return [self.trained(f"{VARIANT} {self.n_enc}L-{p.shallow}L", p.model(VARIANT, self.n_enc, p.shallow),
                             STEPS[p.name], k=k, warmup=WARMUP[p.name]) for k in self.seed_indices(trained=True)]

    def conclude(self, df: pd.DataFrame) -> list[claims.Verdict]:
        name, out = self.preset.name, []
        for stack in STACKS:
            out.append(tag(claims.over_seeds(claims.wang_fig5_dlcl_dense_early, df, stack=stack, preset=name),
                           "trained"))
            out.append(tag(claims.over_seeds(claims.wang_fig5_dlcl_near_diagonal, df, stack=stack, preset=name),
                           "trained"))
        for stack in STACKS:  # what the avg init gives before any update: the method's check, not the paper's
            control = claims.over_seeds(claims.wang_fig5_dlcl_dense_early, df, stack=stack, step="first",
                                        min_seeds=1, preset=name)
            out.append(tag(dataclasses.replace(control, kind=claims.CONTROL), "at init, avg W"))
        return out

    def draw(self, df: pd.DataFrame, verdicts) -> plt.Figure:
        spec, df = self.plan()[0], self.first_seed(df)
        fig, axes = plt.subplots(2, 3, figsize=(20, 12), layout="constrained")
        label = f"{spec.run} · preset {self.preset.name}"
        weights = df.loc[df["quantity"] == "dlcl_weight", "value"].abs()
        vlim = max(0.05, math.ceil(float(weights.max()) * 20) / 20) if len(weights) else 1.0  # (one scale for the four)
        for col, (stack, panel) in enumerate(zip(STACKS, ("a", "b"))):
            plots.dlcl_heatmap(df, variant=VARIANT, stack=stack, vlim=vlim, ax=axes[0, col],
                               title=f"Wang Fig. 5{panel}: learned {stack} W, {label}")
            plots.dlcl_heatmap(df, variant=VARIANT, stack=stack, step="first", vlim=vlim, ax=axes[1, col],
                               title=f"{stack} W at init (avg), {label}")
        steps = sorted(int(x) for x in df.loc[df["quantity"] == "dlcl_weight", "step"].unique())
        plots.dlcl_column(df, column=self.column, variant=VARIANT, stack="encoder", step=steps, ax=axes[0, 2],
                          title=f"Wang Fig. 5c: encoder weights of y_{self.column} over training, {label}")
        plots.loss_curves(df, quantity="val_loss", ax=axes[1, 2], title=f"validation loss, {label}")
        return self.annotate(fig, "Learned DLCL weights W[r, k] (row r = input of layer r+1; r = L: stack output)",
                             [spec.train.describe(), "masking on panels a, b and the init row: |w| < 0.1 or < 5% of the "
                              "row max |w| (Wang 2019), grey; above-diagonal cells not recorded, grey"], verdicts)


ANALYSIS = DLCLWeights
main = entry_point(__doc__, DLCLWeights)

if __name__ == "__main__":
    sys.exit(main())
