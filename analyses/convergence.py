"""Takase 2022 Fig. 1/6/8/9, Xu 2020 Tables 1/3, Wang 2019 Fig. 3: who trains deep?

Every (variant, init) of post_ln+xavier, post_ln+lipschitz (Xu's v1'), pre_ln, b2t and
dlcl_pre is trained on the ``reverse`` task at each depth of the sweep (layers per stack:
6 and 18 at default, 300 steps with a 100-step warm-up on 3 seeds; 2, 4, 6 at ci; 6, 12,
18, 24 at paper) with identical hyper-parameters. The deepest depth is the deep setting
whose loss curves are drawn. At default the budget goes to length and seeds, not breadth:
the claims compare the deep setting with the shallow one, so the 12-layer point is left out
(issue 49: at 150 steps with a 12-step warm-up no 18L run had learned).

A run's outcome is anchored to the task (``gradscope.claims.outcome``): *learned* when it
closed >= half the gap between the task's chance loss and its floor (and gets most tokens
right), *failed* when it diverged or stayed stuck at chance (< 10 % of the gap), *partial*
in between. Each run is repeated over ``preset.train_seeds`` seeds.

Claims: at the deep setting Post-LN fails while Pre-LN and B2T train (Fig. 1/6/9); at
the deepest depth post_ln+xavier failed while pre_ln, b2t and dlcl_pre converged (Fig. 8
and the tables); lipschitz init rescues post_ln there (Xu Table 3).

Outputs: ``convergence.{png,pdf}``, the tidy table ``convergence.parquet`` and the sweep
summary ``convergence_sweep.parquet`` (``gradscope.claims.SWEEP_COLUMNS``).

    python -m analyses.convergence --preset default --out figures
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import pandas as pd

from analyses.outputs import tag
from analyses.runner import Analysis, entry_point
from analyses.runs import RunSpec
from gradscope import claims, plots
from gradscope.train import loss_bounds

CONFIGS = (("post_ln", "xavier"), ("post_ln", "lipschitz"), ("pre_ln", "xavier"), ("b2t", "xavier"),
           ("dlcl_pre", "xavier"))
TRAINS = ("pre_ln", "b2t", "dlcl_pre")
DEPTHS = {"ci": (2, 4, 6), "default": (6, 18), "paper": (6, 12, 18, 24)}
STEPS = {"ci": 100, "default": 300, "paper": 50_000}
WARMUP = {"ci": None, "default": 100, "paper": None}  # None: the preset's fraction (4k of 50k for paper)


def run_name(variant: str, init: str, depth: int) -> str:
    return f"{variant}+{init} {depth}L-{depth}L"


class Convergence(Analysis):
    """Every config of :data:`CONFIGS` at each of ``DEPTHS`` for ``STEPS`` steps; the deepest is ``deep``."""

    name = "convergence"
    min_train_seeds = 3

    @property
    def depths(self) -> tuple[int, ...]:
        return DEPTHS[self.preset.name]

    @property
    def deep(self) -> int:
        return max(self.depths)

    def plan(self) -> list[RunSpec]:
        p = self.preset
        return [self.trained(run_name(v, i, d), p.model(v, d, d, init=i), STEPS[p.name], k=k, warmup=WARMUP[p.name])
                for k in self.seed_indices(trained=True) for d in self.depths for v, i in CONFIGS]

    def bounds(self):
        """The task's chance loss and floor under the runs' label smoothing."""
        return loss_bounds(self.task(self.seed), self.preset.train(1).label_smoothing)

    def summary(self, df: pd.DataFrame) -> pd.DataFrame:
        """The sweep summary (``gradscope.claims.SUMMARY_COLUMNS``), one row per run."""
        specs = self.plan()
        meta = pd.DataFrame({"run": [sp.run for sp in specs], "init": [sp.init for sp in specs],
                             "depth": [sp.depth for sp in specs]})
        return claims.sweep_summary(df, meta, self.bounds())

    def deep_runs(self, inits: tuple[str, ...] = ("xavier",)) -> list[str]:
        return [run_name(v, i, self.deep) for v, i in CONFIGS if i in inits]

    def conclude(self, df: pd.DataFrame) -> list[claims.Verdict]:
        name, sweep, depths = self.preset.name, self.summary(df), f"depths {list(self.depths)}"
        deep = df.loc[df["run"].map(lambda r: claims.split_run(str(r))[0]).isin(self.deep_runs())]
        return [
            tag(claims.over_seeds(claims.takase_fig1_convergence, deep, bounds=self.bounds(), preset=name),
                f"{self.deep}L-{self.deep}L"),
            tag(claims.sweep_post_ln_fails_deep(sweep, trains=TRAINS, preset=name), depths),
            tag(claims.sweep_lipschitz_rescues(sweep, preset=name), depths),
        ]

    def extra_tables(self, df: pd.DataFrame) -> dict[str, pd.DataFrame]:
        return {f"{self.name}_sweep": self.summary(df)}

    def draw(self, df: pd.DataFrame, verdicts) -> plt.Figure:
        fig, axes = plt.subplots(1, 3, figsize=(22, 6.5), layout="constrained")
        order = self.deep_runs(("xavier", "lipschitz"))
        df = self.first_seed(df)
        deep = df.loc[df["run"].isin(order)]
        setting = f"{self.deep}L-{self.deep}L · preset {self.preset.name}"
        for ax, quantity, label in zip(axes, ("loss", "val_loss"), ("training", "validation")):
            plots.loss_curves(deep, quantity=quantity, hue="run", hue_order=order, ax=ax,
                              title=f"Takase Fig. 1/6/9: {label} loss, {setting}")
        self.draw_gap(self.summary(df).loc[lambda t: t["seed"] == 0], axes[2])
        b = self.bounds()
        return self.annotate(fig, "Convergence against depth (layers per stack, encoder = decoder)", [
            self.plan()[0].train.describe(),
            f"task chance loss {b.chance:.3f} nats, floor {b.floor:.3f} (label smoothing {b.smoothing:g}); "
            f"{claims.outcome.RULE}; same hyper-parameters for every run; seed 0 drawn "
            f"({len(self.seed_indices(trained=True))} seed(s) per run)"], verdicts)


    def draw_gap(self, summary: pd.DataFrame, ax) -> None:
        """Gap closed against depth per (variant, init) (the curves' colours), with the outcome
        thresholds: below 0.1 stuck at chance, from 0.5 learned, partial between."""
        for k, (variant, init) in enumerate(CONFIGS):
            rows = summary.loc[(summary["variant"] == variant) & (summary["init"] == init)].sort_values("depth")
            ax.plot(rows["depth"], rows["gap_closed"], marker="o", color=f"C{k}", label=f"{variant}+{init}")
        for level, text in ((claims.CHANCE_GAP, "stuck at chance below"), (claims.LEARNED_GAP, "learned from")):
            ax.axhline(level, color="grey", linestyle="--", linewidth=1)
            ax.text(min(self.depths), level, f" {text} {level:g}", va="bottom", fontsize="small", color="grey")
        ax.set_xticks(list(self.depths))
        ax.set_xlabel("layers per stack")
        ax.set_ylabel("gap closed = (chance - best val loss) / (chance - floor)")
        ax.set_title(f"Takase Fig. 8 / Xu Tables 1, 3 / Wang Fig. 3 · preset {self.preset.name}\n"
                     "share of the task's chance-to-floor gap each run closed (seed 0)")
        ax.legend(fontsize="small")


ANALYSIS = Convergence
main = entry_point(__doc__, Convergence)

if __name__ == "__main__":
    sys.exit(main())
