"""Takase 2022 Fig. 4 / 7: gradient norms at locations (1)-(5) inside Post-LN decoder layers.

A Post-LN encoder-decoder at the deep setting (18L-18L at default and paper, 6L-6L at
ci), one forward/backward on training batch 1 of the ``reverse`` task before any update.
In decoder layers 1, L/2 and L, ‖∂L/∂h‖₂ at (1) LN1 input x+SA(x), (2) LN1 output,
(3) LN2 input h1+CA(h1), (4) LN2 output, (5) LN3 input (the last residual sum). The right
panel draws ``ln_gain`` = ‖grad in‖/‖grad out‖ of every decoder norm by layer.

Claim: the norm drops each time backward passes a LayerNorm, (2)→(1) and (4)→(3).

    python -m analyses.ln_locations --preset default --out figures
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import pandas as pd

from analyses.outputs import tag
from analyses.runner import Analysis, entry_point
from analyses.runs import RunSpec
from gradscope import claims, plots
from gradscope.table import select as S


class LNLocations(Analysis):
    """The deep Post-LN model (``preset.deep`` layers per stack) at step 0."""

    name = "ln_locations"
    at_init = True  # every run is init-only
    quantities = ("act_grad_norm", "ln_gain")

    @property
    def depth(self) -> int:
        return self.preset.deep

    def plan(self) -> list[RunSpec]:
        n = self.depth
        return [self.init_run(f"post_ln {n}L-{n}L", self.preset.model("post_ln", n, n), k=k)
                for k in self.seed_indices(trained=False)]

    def conclude(self, df: pd.DataFrame) -> list[claims.Verdict]:
        return [tag(claims.over_seeds(claims.takase_fig4_ln_drops, df, preset=self.preset.name),
                    f"{self.depth}L-{self.depth}L")]

    def draw(self, df: pd.DataFrame, verdicts) -> plt.Figure:
        fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), layout="constrained")
        setting, df = f"post_ln {self.depth}L-{self.depth}L · preset {self.preset.name}", self.first_seed(df)
        plots.location_norms(df, ax=left, title=f"Takase Fig. 4/7: decoder layers {list(S.default_layers(self.depth))}, "
                                                f"{setting}")
        plots.ln_gains(df, stack="decoder", ax=right, title=f"backward gain of each decoder LayerNorm, {setting}")
        return self.annotate(fig, "Gradient norms inside Post-LN decoder layers at the start of training "
                                  "(step 0, one batch, before any update)",
                             ["dropout active (training mode), seeded; xavier init"], verdicts)


ANALYSIS = LNLocations
main = entry_point(__doc__, LNLocations)

if __name__ == "__main__":
    sys.exit(main())
