"""Takase 2022 Fig. 3 and Wang 2019 §5: gradient norms of layer outputs at the start of training.

For post_ln, pre_ln and b2t at the deep (18L-18L at default and paper, 6L-6L at ci) and
shallow (6L-6L; 2L-2L at ci) settings, one forward/backward on training batch 1 of the
``reverse`` task, before any update, records ‖∂L/∂y_i‖₂ at every layer output. A Post-LN
encoder of several depths (decoder fixed at the shallow depth, as Wang's deep-encoder
models) gives the embedding-output gradient against encoder depth.

Wang's observation is of a deep Post-LN run whose *training* failed, so a deep
(``WANG_DEPTH``-layer encoder) and a shallow Post-LN model, decoder at the shallow depth, are
also trained for their first ``WANG_STEPS`` steps with the recipe of ``analyses.convergence``
(the first steps of those runs exactly: same lr, warm-up and schedule), recording the
encoder embedding's gradient at every step. Every run is repeated over ``preset.seeds``
seeds (run names ``· seed k``); the figures draw seed 0.

Claims: Takase Fig. 3 (Post-LN decoder vanishing toward shallow layers, Pre-LN decaying
toward deep layers, B2T mitigating Post-LN) at both settings; Wang §4.2 (the embedding
gradient of the deep Post-LN run approaches 0 in training while the shallow run's does not).
Control: the embedding gradient at init against encoder depth (no training).

    python -m analyses.grad_norms --preset default --out figures
"""

from __future__ import annotations

import dataclasses
import sys

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analyses.outputs import tag
from analyses.runner import Analysis, entry_point
from analyses.convergence import STEPS as CONVERGENCE_STEPS
from analyses.runs import RunSpec, TrainRequest
from gradscope import claims, plots

VARIANTS = ("post_ln", "pre_ln", "b2t")
EMBED_DEPTHS = {"ci": (2, 4, 6, 8), "default": (6, 12, 18, 24, 30), "paper": (6, 12, 18, 24, 30)}
WANG_STEPS = {"ci": 20, "default": 40, "paper": 200}  # "the first tens of training steps"


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

    def wang_runs(self) -> tuple[str, str]:
        """The trained deep and shallow Post-LN runs (seed 0's names)."""
        p = self.preset
        return f"post_ln {max(self.embed_depths)}L-{p.shallow}L trained", f"post_ln {p.shallow}L-{p.shallow}L trained"

    def plan(self) -> list[RunSpec]:
        """Init-only runs: three variants at both settings, then the Post-LN encoder sweep; then
        Wang's deep and shallow Post-LN runs, trained ``WANG_STEPS``; every one per seed."""
        p, specs = self.preset, []
        for k in self.seed_indices(trained=False):
            specs += [self.init_run(f"{v} {setting_name(n)}", p.model(v, n, n), k=k) for n in self.depths for v in VARIANTS]
            specs += [self.init_run(f"post_ln {d}L-{p.shallow}L", p.model("post_ln", d, p.shallow), k=k)
                      for d in self.embed_depths]
            for run, depth in zip(self.wang_runs(), (max(self.embed_depths), p.shallow)):
                spec = self.trained(run, p.model("post_ln", depth, p.shallow), CONVERGENCE_STEPS[p.name], k=k)
                if spec.train is not None:  # the first WANG_STEPS steps of the convergence recipe, exactly
                    spec = dataclasses.replace(spec, train=spec.train.replace(steps=WANG_STEPS[p.name], eval_every=0))
                specs.append(spec)
        unique = {spec.run: spec for spec in specs}  # post_ln 6L-6L may appear twice
        return list(unique.values())

    def request(self, spec: RunSpec) -> TrainRequest:
        """Init-only runs at step 0; Wang's trained runs at every step."""
        return TrainRequest(spec, self.quantities, record_every=1 if spec.train else 0)

    def setting(self, df: pd.DataFrame, n: int) -> pd.DataFrame:
        names = [f"{v} {setting_name(n)}" for v in VARIANTS]
        return df.loc[df["run"].map(lambda r: claims.split_run(str(r))[0] in names)]

    def conclude(self, df: pd.DataFrame) -> list[claims.Verdict]:
        name, out = self.preset.name, []
        for n in self.depths:
            for rule in (claims.takase_fig3_post_ln_vanishing, claims.takase_fig3_pre_ln_decay,
                         claims.takase_fig3_b2t_mitigates):
                out.append(tag(claims.over_seeds(rule, self.setting(df, n), preset=name), setting_name(n)))
        plain = df["run"].map(lambda r: claims.split_run(str(r))[0])
        sweep = df.loc[plain.isin(self.embed_runs())]
        control = claims.over_seeds(claims.wang_embed_grad_vanishes, sweep, min_seeds=1, preset=name)
        deep, shallow = self.wang_runs()
        trained = df.loc[plain.isin([deep, shallow])]
        out.append(tag(claims.over_seeds(claims.wang_embed_grad_collapses_in_training, trained, deep=deep,
                                         shallow=shallow, preset=name),
                       f"first {WANG_STEPS[self.preset.name]} steps of the convergence recipe"))
        out.append(tag(dataclasses.replace(control, kind=claims.CONTROL), f"at init, decoder {self.preset.shallow}L"))
        return out

    def draw(self, df: pd.DataFrame, verdicts) -> plt.Figure:
        fig, axes = plt.subplots(2, 4, figsize=(22, 10), layout="constrained")
        preset, df = self.preset.name, self.first_seed(df)
        for row, n in enumerate(self.depths):
            for col, stack in enumerate(("encoder", "decoder")):
                plots.layer_norms(self.setting(df, n), stack=stack, hue_order=VARIANTS, ax=axes[row, col],
                                  title=f"Takase Fig. 3: {stack}, {setting_name(n)} · preset {preset}")
        runs = self.embed_runs()
        plots.embed_grad_vs_depth(df, runs, ax=axes[0, 2],
                                  title=f"Wang §4.2 at init (a control): post_ln, decoder {self.preset.shallow}L · "
                                        f"preset {preset}")
        depth_colors = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, len(runs)))  # (not the variants' colours)
        plots.layer_norms(df.loc[df["run"].isin(runs)], stack="encoder", include_embed=True, hue="run",
                          hue_order=runs, colors=depth_colors, ax=axes[1, 2],
                          title=f"post_ln encoder profiles by depth · preset {preset}")
        plots.signal_over_training(df.loc[(df["stack"] == "encoder") & (df["role"] == "embed")],
                                   quantity="act_grad_norm", runs=list(self.wang_runs()), logy=True, ax=axes[0, 3],
                                   title=f"Wang §4.2: encoder embedding gradient in training · preset {preset}")
        axes[1, 3].axis("off")
        return self.annotate(fig, "Gradient norms of layer outputs at the start of training (step 0, one batch, "
                                  "before any update)", ["dropout active (training mode), seeded; xavier init",
                                                         f"{self.preset.seeds} seeds per run; seed 0 drawn"], verdicts)


ANALYSIS = GradNorms
main = entry_point(__doc__, GradNorms)

if __name__ == "__main__":
    sys.exit(main())
