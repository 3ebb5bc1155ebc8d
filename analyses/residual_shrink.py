"""Xu 2020 Table 2: does each Post-LN LayerNorm shrink the residual (w/σ < 1)?

Two Post-LN encoder-decoders at the deep setting (18L-18L at default and paper, 6L-6L at
ci), one with the default ``xavier`` init and one with Xu's ``lipschitz`` init (the
paper's v1 and v1'), are trained on the ``reverse`` task with identical hyper-parameters.
``ln_w_over_sigma`` — mean over tokens and features of w/σ, σ the per-token std of the
norm's input — is recorded for every norm at initialisation (training batch 1, before
any update) and four times during training.

Claims: post_ln's mean w/σ is below 1 (at init and after training); the lipschitz run's
w/σ is closer to 1 than the xavier run's (at init and after training).

    python -m analyses.residual_shrink --preset default --out figures
"""

from __future__ import annotations

import sys

import matplotlib.pyplot as plt
import pandas as pd

from analyses import common
from analyses.common import RunSpec
from gradscope import claims, plots
from gradscope.plots import select as S

NAME = "residual_shrink"
INITS = ("xavier", "lipschitz")
QUANTITIES = ("ln_w_over_sigma",)
RECORDINGS = 4
STEPS = {"ci": 100, "default": 100, "paper": 50_000}


Settings = common.Settings


def settings(preset: str) -> Settings:
    """The analysis at ``ci``, ``default`` or ``paper``."""
    p = common.PRESETS[preset]
    return Settings(preset=p, depth=p.deep, steps=STEPS[preset])


def run_name(init: str) -> str:
    return f"post_ln+{init}"


def plan(s: Settings, *, seed: int = 0, device: str = "auto", max_steps: int | None = None) -> list[RunSpec]:
    n, p = s.depth, s.preset
    return [common.cap_steps(RunSpec(run_name(i), p.model("post_ln", n, n, init=i),
                                     p.train(s.steps, seed=seed, device=device)), max_steps) for i in INITS]


def verdicts(df: pd.DataFrame, s: Settings) -> list[claims.Verdict]:
    name, base, lip = s.preset.name, run_name("xavier"), run_name("lipschitz")
    out = []
    for step, when in (("first", "at init"), ("last", "trained")):
        setting = f"{s.depth}L-{s.depth}L, {when}"
        out.append(common.tag(claims.xu_table2_post_ln_shrinks(df, run=base, step=step, preset=name), setting))
        out.append(common.tag(claims.xu_table2_lipschitz_closer(df, baseline_run=base, lipschitz_run=lip, step=step,
                                                                preset=name), setting))
    return out


def mean_over_training(df: pd.DataFrame, *, ax: plt.Axes, title: str) -> plt.Axes:
    """Mean w/σ over every norm of a run against step, one line per run."""
    pts = S.one_per_point(S.rows(df, quantity="ln_w_over_sigma"))
    for run in (run_name(i) for i in INITS):
        series = pts.loc[pts["run"] == run].groupby("step")["value"].mean()
        ax.plot(series.index.to_numpy(float), series.to_numpy(float), marker="o", label=run)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="w/σ = 1")
    ax.set_xlabel("optimizer step (0 = init)")
    ax.set_ylabel("mean w/σ over all norms (dimensionless)")
    ax.legend(fontsize="small")
    ax.set_title(f"{title}\nmean over every LayerNorm of both stacks", fontsize="medium")
    return ax


def figure(df: pd.DataFrame, s: Settings, specs: list[RunSpec], found: list[claims.Verdict]) -> plt.Figure:
    fig, axes = plt.subplots(2, 3, figsize=(20, 10), layout="constrained")
    order = [run_name(i) for i in INITS]
    setting = f"post_ln {s.depth}L-{s.depth}L · preset {s.preset.name}"
    for row, stack in enumerate(("encoder", "decoder")):
        for col, (step, when) in enumerate((("first", "at init"), ("last", "after training"))):
            plots.w_over_sigma(df, stack=stack, step=step, hue_order=order, ax=axes[row, col],
                               title=f"Xu Table 2: {stack} w/σ {when}, {setting}")
    mean_over_training(df, ax=axes[0, 2], title=f"w/σ during training, {setting}")
    plots.loss_curves(df, quantity="val_loss", hue="run", hue_order=order, ax=axes[1, 2],
                      title=f"validation loss, {setting}")
    common.annotate(fig, "LayerNorm w/σ per layer: below 1, a Post-LN norm shrinks the residual (Xu 2020 Table 2)",
                    [s.preset.describe(), common.recipe_text(specs[0].train),
                     "same hyper-parameters for both inits; step 0 = training batch 1 before any update"], found)
    return fig


def run(args) -> list[claims.Verdict]:
    s = settings(args.preset)
    specs = plan(s, seed=args.seed, device=args.device, max_steps=args.max_steps)

    def conclude(df):
        found = verdicts(df, s)
        return figure(df, s, specs, found), found

    return common.run_analysis(args, NAME, s.preset, specs, conclude=conclude, collect=lambda spec, ctx: [
        ctx.train(spec, quantities=QUANTITIES, record_every=max(1, spec.train.steps // RECORDINGS))[1]])


main = common.entry_point(NAME, __doc__, run)


if __name__ == "__main__":
    sys.exit(main())
