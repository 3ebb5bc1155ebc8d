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
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.axes import Axes

from analyses import common
from analyses.common import RunSpec
from gradscope import claims, plots
from gradscope.plots import select as S

NAME = "grad_norms"
VARIANTS = ("post_ln", "pre_ln", "b2t")
QUANTITIES = ("act_grad_norm",)


@dataclass(frozen=True)
class Settings:
    """What this analysis runs at one preset.

    Attributes:
        preset: shared model size and data.
        depths: the (deep, shallow) settings, layers per stack.
        embed_depths: Post-LN encoder depths for Wang §5 (decoder depth ``shallow``).
    """

    preset: common.Preset
    depths: tuple[int, int]
    embed_depths: tuple[int, ...]


def settings(preset: str) -> Settings:
    """The analysis at ``ci``, ``default`` or ``paper``."""
    p = common.PRESETS[preset]
    embed = {"ci": (2, 4, 6, 8), "default": (6, 12, 18, 24, 30), "paper": (6, 12, 18, 24, 30)}[preset]
    return Settings(preset=p, depths=(p.deep, p.shallow), embed_depths=embed)


def setting_name(n: int) -> str:
    return f"{n}L-{n}L"


def plan(s: Settings) -> list[RunSpec]:
    """Init-only runs: three variants at both settings, then the Post-LN encoder sweep."""
    p = s.preset
    specs = [RunSpec(f"{v} {setting_name(n)}", p.model(v, n, n)) for n in s.depths for v in VARIANTS]
    specs += [RunSpec(f"post_ln {d}L-{p.shallow}L", p.model("post_ln", d, p.shallow)) for d in s.embed_depths]
    unique = {spec.run: spec for spec in specs}  # post_ln 6L-6L may appear twice
    return list(unique.values())


def embed_runs(s: Settings) -> list[str]:
    return [f"post_ln {d}L-{s.preset.shallow}L" for d in s.embed_depths]


def embed_vs_depth(df: pd.DataFrame, runs: list[str], *, ax: Axes, title: str) -> Axes:
    """g(encoder.embed.out) against encoder depth, one point per run (Wang 2019 §5)."""
    data = S.rows(df, quantity="act_grad_norm", stack="encoder", role="embed")
    data = S.one_per_point(data.loc[data["run"].isin(runs)])
    depth = {r: S.layer_depth(S.rows(df, run=r), "encoder") for r in runs}
    data = data.assign(depth=data["run"].map(depth)).sort_values("depth")
    ax.plot(data["depth"].to_numpy(float), data["value"].to_numpy(float), marker="o", label="post_ln")
    ax.set_yscale("log")
    ax.set_xlabel("encoder layers N")
    ax.set_ylabel("‖∂L/∂h‖₂ at encoder.embed.out (loss: mean over tokens, nats)")
    ax.legend(fontsize="small")
    ax.set_title(f"{title}\nencoder.embed.out · step 0", fontsize="medium")
    return ax


def verdicts(df: pd.DataFrame, s: Settings) -> list[claims.Verdict]:
    name, out = s.preset.name, []
    for n in s.depths:
        sub = df.loc[df["run"].isin([f"{v} {setting_name(n)}" for v in VARIANTS])]
        for rule in (claims.takase_fig3_post_ln_vanishing, claims.takase_fig3_pre_ln_decay,
                     claims.takase_fig3_b2t_mitigates):
            out.append(common.tag(rule(sub, preset=name), setting_name(n)))
    sweep = df.loc[df["run"].isin(embed_runs(s))]
    out.append(common.tag(claims.wang_embed_grad_vanishes(sweep, preset=name),
                          f"decoder {s.preset.shallow}L"))
    return out


def figure(df: pd.DataFrame, s: Settings, found: list[claims.Verdict]) -> plt.Figure:
    fig, axes = plt.subplots(2, 3, figsize=(17, 10), layout="constrained")
    for row, n in enumerate(s.depths):
        sub = df.loc[df["run"].isin([f"{v} {setting_name(n)}" for v in VARIANTS])]
        for col, stack in enumerate(("encoder", "decoder")):
            plots.layer_norms(sub, stack=stack, hue_order=VARIANTS, ax=axes[row, col],
                              title=f"Takase Fig. 3: {stack}, {setting_name(n)} · preset {s.preset.name}")
    runs = embed_runs(s)
    embed_vs_depth(df, runs, ax=axes[0, 2],
                   title=f"Wang §5: post_ln, decoder {s.preset.shallow}L · preset {s.preset.name}")
    plots.layer_norms(df.loc[df["run"].isin(runs)], stack="encoder", include_embed=True, hue="run",
                      hue_order=runs, ax=axes[1, 2],
                      title=f"post_ln encoder profiles by depth · preset {s.preset.name}")
    common.annotate(fig, "Gradient norms of layer outputs at the start of training (step 0, one batch, "
                         "before any update)",
                    [s.preset.describe(), "dropout active (training mode), seeded; xavier init"], found)
    return fig


def run(args) -> list[claims.Verdict]:
    s = settings(args.preset)

    def conclude(df):
        found = verdicts(df, s)
        return figure(df, s, found), found

    return common.run_analysis(args, NAME, s.preset, plan(s), conclude=conclude,
                               collect=lambda spec, ctx: [ctx.train(spec, quantities=QUANTITIES, progress=False)[1]])


main = common.entry_point(NAME, __doc__, run)


if __name__ == "__main__":
    sys.exit(main())
