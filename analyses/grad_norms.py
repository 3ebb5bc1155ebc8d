"""Takase 2022 Fig. 3 and Wang 2019 §5: gradient norms of layer outputs at the start of training.

For post_ln, pre_ln and b2t at the deep (18L-18L at default and paper, 6L-6L at ci) and
shallow (6L-6L; 2L-2L at ci) settings, one forward/backward on training batch 1 of the
``reverse`` task, before any update, records ‖∂L/∂y_i‖₂ at every layer output. A Post-LN
encoder of several depths (decoder fixed at the shallow depth, as Wang's deep-encoder
models) gives the embedding-output gradient against encoder depth.

Claims: Takase Fig. 3 (Post-LN decoder vanishing toward shallow layers, Pre-LN decaying
toward deep layers, B2T mitigating Post-LN) at both settings; Wang §5 (Post-LN embedding
gradient falls with encoder depth).

    python -m analyses.grad_norms --preset default --out figures
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analyses.outputs import tag
from analyses.runner import Analysis, entry_point
from analyses.runs import RunSpec
from gradscope import claims, plots

VARIANTS = ("post_ln", "pre_ln", "b2t")
EMBED_DEPTHS = {"ci": (2, 4, 6, 8), "default": (6, 12, 18, 24, 30), "paper": (6, 12, 18, 24, 30)}


def setting_name(n: int) -> str:
    return f"{n}L-{n}L"


class GradNorms(Analysis):
    """Takase Fig. 3 at the deep and shallow settings; Wang §5 over Post-LN encoder depths
    (``embed_depths``, decoder depth ``preset.shallow``)."""

    name = "grad_norms"
    at_init = True  # every run is init-only
    quantities = ("act_grad_norm",)

    @property
    def depths(self) -> tuple[int, int]:
        return self.preset.deep, self.preset.shallow

    @property
    def embed_depths(self) -> tuple[int, ...]:
        return EMBED_DEPTHS[self.preset.name]

    def embed_runs(self) -> list[str]:
        return [f"post_ln {d}L-{self.preset.shallow}L" for d in self.embed_depths]

    def plan(self) -> list[RunSpec]:
        """Init-only runs: three variants at both settings, then the Post-LN encoder sweep."""
        p = self.preset
        specs = [RunSpec(f"{v} {setting_name(n)}", p.model(v, n, n)) for n in self.depths for v in VARIANTS]
        specs += [RunSpec(f"post_ln {d}L-{p.shallow}L", p.model("post_ln", d, p.shallow)) for d in self.embed_depths]
        unique = {spec.run: spec for spec in specs}  # post_ln 6L-6L may appear twice
        return list(unique.values())

    def setting(self, df: pd.DataFrame, n: int) -> pd.DataFrame:
        return df.loc[df["run"].isin([f"{v} {setting_name(n)}" for v in VARIANTS])]

    def conclude(self, df: pd.DataFrame) -> list[claims.Verdict]:
        name, out = self.preset.name, []
        for n in self.depths:
            for rule in (claims.takase_fig3_post_ln_vanishing, claims.takase_fig3_pre_ln_decay,
                         claims.takase_fig3_b2t_mitigates):
                out.append(tag(rule(self.setting(df, n), preset=name), setting_name(n)))
        sweep = df.loc[df["run"].isin(self.embed_runs())]
        out.append(tag(claims.wang_embed_grad_vanishes(sweep, preset=name), f"decoder {self.preset.shallow}L"))
        return out

    def draw(self, df: pd.DataFrame, verdicts) -> plt.Figure:
        fig, axes = plt.subplots(2, 3, figsize=(17, 10), layout="constrained")
        preset = self.preset.name
        for row, n in enumerate(self.depths):
            for col, stack in enumerate(("encoder", "decoder")):
                plots.layer_norms(self.setting(df, n), stack=stack, hue_order=VARIANTS, ax=axes[row, col],
                                  title=f"Takase Fig. 3: {stack}, {setting_name(n)} · preset {preset}")
        runs = self.embed_runs()
        plots.embed_grad_vs_depth(df, runs, ax=axes[0, 2],
                                  title=f"Wang §5: post_ln, decoder {self.preset.shallow}L · preset {preset}")
        depth_colors = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, len(runs)))  # (not the variants' colours)
        plots.layer_norms(df.loc[df["run"].isin(runs)], stack="encoder", include_embed=True, hue="run",
                          hue_order=runs, colors=depth_colors, ax=axes[1, 2],
                          title=f"post_ln encoder profiles by depth · preset {preset}")
        return self.annotate(fig, "Gradient norms of layer outputs at the start of training (step 0, one batch, "
                                  "before any update)", ["dropout active (training mode), seeded; xavier init"], verdicts)


ANALYSIS = GradNorms
main = entry_point(__doc__, GradNorms)

if __name__ == "__main__":
    sys.exit(main())
