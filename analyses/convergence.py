"""Takase 2022 Fig. 1/6/8/9, Xu 2020 Tables 1/3, Wang 2019 Fig. 3: who trains deep?

Every (variant, init) of post_ln+xavier, post_ln+lipschitz (Xu's v1'), pre_ln, b2t and
dlcl_pre is trained on the ``reverse`` task at each depth of the sweep (layers per stack:
6, 12, 18 at default; 2, 4, 6 at ci; 6, 12, 18, 24 at paper) with identical
hyper-parameters. The deepest depth is the deep setting whose loss curves are drawn.

A run *converged* when its losses stayed finite and its best validation loss is at most
``gradscope.claims.MAX_FRACTION`` (0.75) of the untrained model's loss; otherwise it
*failed* (``gradscope.claims.run_outcome``).

Claims: at the deep setting Post-LN fails while Pre-LN and B2T train (Fig. 1/6/9); at
the deepest depth post_ln+xavier failed while pre_ln, b2t and dlcl_pre converged (Fig. 8
and the tables); lipschitz init rescues post_ln there (Xu Table 3).

Outputs: ``convergence.{png,pdf}``, the tidy table ``convergence.parquet`` and the sweep
summary ``convergence_sweep.parquet`` (``gradscope.claims.SWEEP_COLUMNS``).

    python -m analyses.convergence --preset default --out figures
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd

from analyses import common
from analyses.common import RunSpec
from gradscope import claims, plots

NAME = "convergence"
CONFIGS = (("post_ln", "xavier"), ("post_ln", "lipschitz"), ("pre_ln", "xavier"), ("b2t", "xavier"),
           ("dlcl_pre", "xavier"))
TRAINS = ("pre_ln", "b2t", "dlcl_pre")
DEPTHS = {"ci": (2, 4, 6), "default": (6, 12, 18), "paper": (6, 12, 18, 24)}
STEPS = {"ci": 100, "default": 150, "paper": 50_000}


@dataclass(frozen=True)
class Settings:
    """What this analysis runs at one preset: every config at each of ``depths`` for ``steps`` steps."""

    preset: common.Preset
    depths: tuple[int, ...]
    steps: int

    @property
    def deep(self) -> int:
        return max(self.depths)


def settings(preset: str) -> Settings:
    """The analysis at ``ci``, ``default`` or ``paper``."""
    return Settings(preset=common.PRESETS[preset], depths=DEPTHS[preset], steps=STEPS[preset])


def run_name(variant: str, init: str, depth: int) -> str:
    return f"{variant}+{init} {depth}L-{depth}L"


def plan(s: Settings, *, seed: int = 0, device: str = "auto", max_steps: int | None = None) -> list[RunSpec]:
    p = s.preset
    config = p.train(s.steps, seed=seed, device=device)
    return [common.cap_steps(RunSpec(run_name(v, i, d), p.model(v, d, d, init=i), config), max_steps)
            for d in s.depths for v, i in CONFIGS]


def summary(df: pd.DataFrame, specs: list[RunSpec]) -> pd.DataFrame:
    meta = pd.DataFrame({"run": [sp.run for sp in specs], "init": [sp.init for sp in specs],
                         "depth": [sp.depth for sp in specs]})
    return claims.sweep_summary(df, meta)


def deep_runs(s: Settings, inits: tuple[str, ...] = ("xavier",)) -> list[str]:
    return [run_name(v, i, s.deep) for v, i in CONFIGS if i in inits]


def verdicts(df: pd.DataFrame, sweep: pd.DataFrame, s: Settings) -> list[claims.Verdict]:
    name = s.preset.name
    deep = df.loc[df["run"].isin(deep_runs(s))]
    return [
        common.tag(claims.takase_fig1_convergence(deep, preset=name), f"{s.deep}L-{s.deep}L"),
        common.tag(claims.sweep_post_ln_fails_deep(sweep, trains=TRAINS, preset=name), f"depths {list(s.depths)}"),
        common.tag(claims.sweep_lipschitz_rescues(sweep, preset=name), f"depths {list(s.depths)}"),
    ]


def figure(df: pd.DataFrame, sweep: pd.DataFrame, s: Settings, specs: list[RunSpec],
           found: list[claims.Verdict]) -> plt.Figure:
    fig, axes = plt.subplots(1, 3, figsize=(22, 6.5), layout="constrained")
    order = deep_runs(s, ("xavier", "lipschitz"))
    deep = df.loc[df["run"].isin(order)]
    setting = f"{s.deep}L-{s.deep}L · preset {s.preset.name}"
    plots.loss_curves(deep, quantity="loss", hue="run", hue_order=order, ax=axes[0],
                      title=f"Takase Fig. 1/6/9: training loss, {setting}")
    plots.loss_curves(deep, quantity="val_loss", hue="run", hue_order=order, ax=axes[1],
                      title=f"Takase Fig. 1/6/9: validation loss, {setting}")
    plots.depth_sweep(sweep, ax=axes[2], title=f"Takase Fig. 8 / Xu Tables 1, 3 / Wang Fig. 3 · preset "
                                               f"{s.preset.name}")
    common.annotate(fig, "Convergence against depth (layers per stack, encoder = decoder)",
                    [s.preset.describe(), common.recipe_text(specs[0].train),
                     f"converged = finite losses and best val loss <= {claims.MAX_FRACTION:g} x the run's own "
                     "untrained (step-1) loss: runs that start higher pass more easily; same hyper-parameters "
                     "for every run"],
                    found)
    return fig


def run(args) -> list[claims.Verdict]:
    s = settings(args.preset)
    specs = plan(s, seed=args.seed, device=args.device, max_steps=args.max_steps)

    def conclude(df):
        sweep = summary(df, specs)
        found = verdicts(df, sweep, s)
        common.save_plain_table(sweep, args.out, f"{NAME}_sweep")
        return figure(df, sweep, s, specs, found), found

    return common.run_analysis(args, NAME, s.preset, specs, conclude=conclude,
                               collect=lambda spec, ctx: [ctx.train(spec)[1]])


main = common.entry_point(NAME, __doc__, run)


if __name__ == "__main__":
    sys.exit(main())
