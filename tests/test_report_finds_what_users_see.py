"""Issue 52 part 6: the report finds what a user sees. A real run (a GPT-2 built from its
config) with a warm-up transient and a planted 50× jump of every gradient at step 90: the
mean/std rule misses it (checked here), the report flags it, grouped by step. MoE and outlier
panels appear when their rows are in the table, and nothing otherwise."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import gradscope  # noqa: E402
from gradscope.plots.quantity_sets import expert_load_by_layer, quantity_by_site  # noqa: E402
from gradscope.report import report  # noqa: E402
from gradscope.table import COLUMNS, make_frame  # noqa: E402

SPIKE_AT, STEPS, LAYERS = 90, 100, 3


def _transient_run(log_dir):
    """Adam on a tiny GPT-2; the loss is scaled 1000× → 2× over steps 0–9 (an early transient
    of every gradient) and 50× at step 90 (the planted spike)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=16, n_head=2, vocab_size=40, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scale = np.ones(STEPS)
    scale[:10] = np.geomspace(1000, 2, 10)
    scale[SPIKE_AT] = 50.0
    tokens = torch.randint(0, 40, (STEPS, 4, 12), generator=torch.Generator().manual_seed(0))
    rec = gradscope.Recorder(model, quantities=["act_grad_norm", "param_grad_norm", "spike"], log_dir=log_dir, run="gpt2")
    for step in range(STEPS):
        with rec.step(step):
            (model(tokens[step], labels=tokens[step]).loss * float(scale[step])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec.close()


def _mean_std_misses(series: np.ndarray, t: int, window: int = 128, sigmas: float = 6.0) -> bool:
    past = series[max(0, t - window):t]
    return not series[t] - past.mean() > sigmas * past.std(ddof=1)


def test_the_report_flags_a_planted_50x_spike_after_a_warm_up_transient(tmp_path):
    _transient_run(tmp_path / "run")
    df = gradscope.load(tmp_path / "run")
    outs = df[(df.quantity == "act_grad_norm") & (df.role == "layer_out") & (df.micro_step == -1)]
    assert outs.site.nunique() == LAYERS
    series = outs.pivot_table(index="step", columns="site", values="value").sort_index()
    ratio = series.loc[SPIKE_AT] / series.loc[SPIKE_AT - 1]
    assert ratio.between(20, 80).all()  # the plant is a ~50× jump of every layer output
    assert all(_mean_std_misses(series[c].to_numpy(), SPIKE_AT) for c in series)  # the earlier rule was blind to it

    spikes = df[df.quantity == "spike"]
    assert set(spikes.step) == {SPIKE_AT}
    assert set(spikes[spikes.role == "layer_out"].site) == set(series.columns)

    summary = report(tmp_path / "run", tmp_path / "out", progress=False).read_text()
    assert f"| {SPIKE_AT} | all {LAYERS} layer outputs; " in summary
    assert "at 1 step (steps before 64 not judged" in summary and "no spikes" not in summary.lower()
    assert not list((tmp_path / "out").glob("*_moe.png")) and "Mixture of experts" not in summary


def _rows(quantity, values, *, sites, layer_j=None, role=""):
    """Rows in the table's shape: values[step][i] at sites[i] (and expert layer_j[i])."""
    return [dict(run="r", variant="m", step=s, micro_step=-1, rank=0, stack="model", layer=i + 1, site=site,
                 quantity=quantity, value=float(v), layer_j=None if layer_j is None else layer_j[i], role=role)
            for s, row in enumerate(values) for i, (site, v) in enumerate(zip(sites, row))]


def _moe_and_outlier_frame(rng):
    steps, experts, layers = 6, 4, 2
    moe_sites = [f"model.layers.{i}.mlp" for i in range(layers)]
    load = rng.dirichlet(np.ones(experts), size=(steps, layers))  # (step, layer, expert)
    rows = _rows("act_grad_norm", rng.uniform(0.5, 1, (steps, layers)), sites=[f"model.layers.{i}" for i in range(layers)],
                 role="layer_out")
    rows += _rows("moe_load", load.reshape(steps, -1), sites=[s for s in moe_sites for _ in range(experts)],
                  layer_j=[e for _ in moe_sites for e in range(experts)])
    rows += _rows("moe_imbalance", load.max(-1) * experts, sites=moe_sites)
    rows += _rows("router_entropy", rng.uniform(0.5, 1.3, (steps, layers)), sites=moe_sites)
    act_max = rng.uniform(1, 500, (steps, layers))
    rows += _rows("act_abs_max", act_max, sites=[f"model.layers.{i}" for i in range(layers)], role="layer_out")
    df = make_frame(rows)
    assert list(df.columns) == list(COLUMNS)
    return df, load, act_max


def test_moe_and_outlier_panels_draw_the_rows_they_are_given(tmp_path):
    from gradscope.sinks.parquet import to_arrow, write_part

    df, load, act_max = _moe_and_outlier_frame(np.random.default_rng(0))
    ax = expert_load_by_layer(df, ax=plt.subplots()[1])  # (its own Axes: an earlier test's figure may be current)
    np.testing.assert_allclose(ax.collections[0].get_array().reshape(2, 4), load[-1])  # row = MoE layer, column = expert
    plt.close(ax.figure)
    ax = quantity_by_site(df, "act_abs_max", ax=plt.subplots()[1])
    for k, line in enumerate(ax.lines):
        np.testing.assert_allclose(line.get_ydata(), act_max[:, k])
    assert ax.get_yscale() == "log" if act_max.max() > 100 * act_max.min() else "linear"
    plt.close(ax.figure)

    (tmp_path / "run").mkdir()
    write_part(to_arrow(df), tmp_path / "run" / "part-r0-0-5-x.parquet")
    summary = report(tmp_path / "run", tmp_path / "out", progress=False).read_text()
    assert "### Mixture of experts (routing)" in summary and "### Activation outliers" in summary
    top = int(np.argmax(load[-1].max(-1)))
    assert f"`moe_imbalance` at step 5: largest {load[-1].max(-1)[top] * 4:.4g} at `model.layers.{top}.mlp`" in summary
    assert f"`act_abs_max` at step 5: largest {act_max[-1].max():.4g}" in summary
    assert {p.name for p in (tmp_path / "out").glob("*.png")} == {"r_heatmap.png", "r_series.png", "r_moe.png",
                                                                   "r_outliers.png"}


def test_a_run_without_moe_or_outlier_rows_gets_no_panel_and_no_error(tmp_path):
    from gradscope.report import set_section

    df, _, _ = _moe_and_outlier_frame(np.random.default_rng(1))
    plain = df[df.quantity == "act_grad_norm"]
    assert set_section(plain, ("moe_load", "moe_imbalance"), tmp_path, "x_moe.png", "t") == ([], None)
    assert not (tmp_path / "x_moe.png").exists()
    only_outliers = pd.concat([plain, df[df.quantity == "act_abs_max"]])
    lines, path = set_section(only_outliers, ("act_abs_max", "act_kurtosis", "massive_act_count"), tmp_path, "x.png", "t")
    assert len(lines) == 1 and path.exists()


def test_spikes_are_grouped_by_step_the_busiest_steps_listed_and_the_rest_counted():
    from gradscope.plots.over_time import layer_series
    from gradscope.report import spike_table

    outs = [f"m.layers.{i}" for i in range(49)]
    rows = [dict(step=90, site=s, quantity="spike", value=50.0 + i, role="layer_out") for i, s in enumerate(outs)]
    rows += [dict(step=90, site="m.layers.0.attn", quantity="spike", value=9.0, role="")]  # a parameter group
    rows += [dict(step=100 + k, site=outs[k], quantity="spike", value=7.0, role="layer_out") for k in range(20)]
    spikes = make_frame(rows)
    lines = spike_table(spikes, limit=15, layer_outs=49, looked_from=64)
    assert lines[0] == "70 spikes at 21 steps (steps before 64 not judged: the rule needs 64 earlier values)."
    assert "| 90 | all 49 layer outputs; 1 parameter group | 98 | `m.layers.48`, `m.layers.47`, `m.layers.46` … |" in lines
    listed = [int(line.split("|")[1]) for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert listed == [90, *range(100, 114)]  # the busiest first (90), then the rest in step order: 15 steps
    assert lines[-1] == "\n… and 6 more steps (6 spikes; steps 114–119)."

    values = np.ones((2, 80))  # the series drawn have no spike; others do: the title says where
    df = make_frame([dict(run="r", step=s, stack="m", layer=i + 1, site=f"m.{i}", quantity="act_grad_norm",
                          value=values[i, s], role="layer_out") for s in range(80) for i in range(2)])
    fig, ax = plt.subplots()
    layer_series(df, spikes=spikes, ax=ax)
    assert "no spikes at these layers from step 64 on (earlier steps not judged; 70 spikes at other sites)" in ax.get_title()
    plt.close(fig)
