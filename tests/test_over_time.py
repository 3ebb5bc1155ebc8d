"""A run over time: the spike rule (against a slow reference written here), the Recorder's
spike rows, the over-time plots (asserted on what was drawn) and the report's summary."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from matplotlib.colors import LogNorm

import gradscope
from gradscope.plots.over_time import layer_heatmap, layer_series
from gradscope.recorder.quantities.spike import SpikeDetector, find_spikes
from gradscope.table import make_frame

SITES = [f"decoder.layers.{i}.out" for i in range(3)]


def _series(n=400, seed=0, planted=()):
    """Smooth noisy positive series, one per site, with (step, site index, factor) spikes planted."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n)
    values = np.stack([1 + 0.3 * np.sin(steps / 400 + i) + 0.02 * rng.standard_normal(n) for i in range(len(SITES))])
    for step, i, factor in planted:
        values[i, step] *= factor
    return values


def _frame(values, *, quantity="act_grad_norm", extra=()):
    rows = [dict(run="r", variant="post_ln", step=s, stack="decoder", layer=i + 1, site=site, quantity=quantity,
                 value=float(values[i, s]), role="layer_out")
            for s in range(values.shape[1]) for i, site in enumerate(SITES)]
    return make_frame(rows + list(extra))


def _slow_spikes(values, window=128, sigmas=6.0):
    """Reference: the robust rule, one value at a time: z = (ln v − median)/(1.4826·MAD) of the
    logs of the previous ``window`` values that are finite and > 0 (at least half a window)."""
    found = {}
    for i, series in enumerate(values):
        for t in range(len(series)):
            past = series[max(0, t - window):t]
            past = np.log(past[np.isfinite(past) & (past > 0)])
            if len(past) >= window // 2 and math.isfinite(series[t]) and series[t] > 0:
                median = np.median(past)
                scale = max(1.4826 * np.median(np.abs(past - median)), 5e-3)
                z = (math.log(series[t]) - median) / scale
                if z > sigmas:
                    found[(t, SITES[i])] = z
    return found


def _online(values):
    detector, found = SpikeDetector(), {}
    for t in range(values.shape[1]):
        keys = [(-1, "decoder", i + 1, site, "act_grad_norm", None, "layer_out") for i, site in enumerate(SITES)]
        spike_keys, z = detector.rows(keys, values[:, t])
        found.update({(t, k[3]): v for k, v in zip(spike_keys, z)})
    return found


def test_a_planted_spike_is_found_and_a_smooth_series_has_none():
    smooth = _series()
    assert _online(smooth) == {} and find_spikes(_frame(smooth)).empty and _slow_spikes(smooth) == {}
    planted = _series(planted=[(300, 1, 2.0), (40, 0, 3.0)])  # step 40: before the 64-value warm-up, not judged
    online = _online(planted)
    assert list(online) == [(300, SITES[1])] and online[(300, SITES[1])] > 6
    offline = find_spikes(_frame(planted))
    assert offline[["step", "site", "quantity", "role"]].values.tolist() == [[300, SITES[1], "spike", "layer_out"]]
    assert offline.value.iloc[0] == pytest.approx(online[(300, SITES[1])], rel=1e-9)


def _mean_std_rule(series, t, window=128, sigmas=6.0):
    """The earlier rule (OLMo-core's mean + 6·std): whether it flags value t."""
    past = series[max(0, t - window):t]
    return series[t] - past.mean() > sigmas * past.std(ddof=1)


def test_a_warm_up_transient_does_not_blind_the_rule():
    """Issue 52: the first 10 values 1000× larger (decaying), then a 50× jump at step 90 in
    every series. The mean and std of the window are blinded by the transient (checked here);
    the robust rule flags step 90 in every series, and nothing else."""
    values = _series(200)
    values[:, :10] *= np.geomspace(1000, 2, 10)
    values[:, 90] *= 50
    assert not any(_mean_std_rule(series, 90) for series in values)  # the earlier rule misses it
    assert set(_online(values)) == set(_slow_spikes(values)) == {(90, site) for site in SITES}
    assert set(zip(find_spikes(_frame(values)).step, find_spikes(_frame(values)).site)) == {(90, s) for s in SITES}


def test_a_series_that_barely_moves_needs_a_3_percent_rise():
    """σ̂'s floor: float noise and bf16 rounding steps on a flat series are no spike, 10% is."""
    rng = np.random.default_rng(1)
    flat = np.ones((3, 150)) * (1 + 1e-7 * rng.standard_normal((3, 150)))
    flat[1] = torch.tensor(2 + 0.004 * rng.standard_normal(150)).bfloat16().double().numpy()  # a few bf16 steps
    flat[:, 120] *= [1.02, 1.02, 1.10]
    assert set(_online(flat)) == set(_slow_spikes(flat)) == {(120, SITES[2])}


def test_online_and_offline_spikes_equal_the_slow_reference():
    rng = np.random.default_rng(3)
    values = np.exp(np.cumsum(0.05 * rng.standard_normal((3, 600)), axis=1))  # a random walk: the window matters
    values[:, rng.integers(100, 600, 12)] *= 4.0
    values[2, 350] = np.nan  # a non-finite value is never a spike and stays out of the window
    want = _slow_spikes(values)
    assert len(want) >= 5
    online = _online(values)
    assert online.keys() == want.keys()
    np.testing.assert_allclose([online[k] for k in want], list(want.values()), rtol=1e-9)
    offline = find_spikes(_frame(values))
    assert set(zip(offline.step, offline.site)) == set(want)


def test_the_recorder_records_a_spike_where_the_loss_was_scaled():
    torch.manual_seed(0)
    model = gradscope.build_model(gradscope.presets.tiny(variant="pre_ln", arch="decoder"))
    rec = gradscope.Recorder(model, quantities=["act_grad_norm", "param_grad_norm", "spike"])
    tokens = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    for step in range(80):  # fixed weights and batch: every series is constant but for float noise, then a 1000x step
        with rec.step(step):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            (loss * (1000.0 if step == 79 else 1.0 + 1e-3 * math.sin(step))).backward()
        model.zero_grad(set_to_none=True)
    df = rec.frame()
    spikes = df[df.quantity == "spike"]
    assert set(spikes.step) == {79}
    watched = df[(df.step == 79) & df.quantity.isin(["act_grad_norm", "param_grad_norm"]) & (df.value > 0)]
    assert set(spikes.site) == set(watched.site)
    offline = find_spikes(df[df.quantity != "spike"])
    pd.testing.assert_frame_equal(offline.drop(columns="value").sort_values(["site"]).reset_index(drop=True),
                                  spikes.drop(columns="value").sort_values(["site"]).reset_index(drop=True))


def _run_with_events():
    values = _series(300, planted=[(250, 1, 2.0)])
    values[0] *= 0.01  # the bottom layer's gradient is 100x smaller: vanishing
    nonfinite = [dict(run="r", variant="post_ln", step=s, stack="decoder", layer=2, site=SITES[1], quantity=q, value=0.0,
                      role="layer_out") for s in (280, 281) for q in ("nonfinite", "nonfinite_grad")]
    return values, _frame(values, extra=nonfinite)


def test_heatmap_draws_layers_by_steps_on_a_log_scale_and_stars_nonfinite_origins():
    import matplotlib.pyplot as plt

    values, df = _run_with_events()
    ax = layer_heatmap(df)
    mesh = ax.collections[0]
    assert isinstance(mesh.norm, LogNorm)
    np.testing.assert_allclose(mesh.get_array().reshape(3, 300), values)  # row k = layer k + 1, column = step
    assert [t.get_text() for t in ax.get_yticklabels()] == ["decoder 1", "decoder 2", "decoder 3"]
    stars = ax.collections[1].get_offsets()
    np.testing.assert_allclose(stars, [[280, 1.5], [281, 1.5]])  # at layer 2's row
    plt.close(ax.figure)
    ax = layer_heatmap(df, max_bins=100)  # binned: each column the mean of 3 steps
    np.testing.assert_allclose(mesh_values := ax.collections[0].get_array().reshape(3, 100), values.reshape(3, 100, 3).mean(-1))
    assert mesh_values.shape == (3, 100) and "mean over bins of 3 steps" in ax.get_title()
    plt.close(ax.figure)


def test_series_draws_each_layer_and_marks_its_spikes():
    import matplotlib.pyplot as plt

    values, df = _run_with_events()
    spikes = find_spikes(df)
    ax = layer_series(df, spikes=spikes)
    assert [line.get_label() for line in ax.lines] == ["decoder 1", "decoder 2", "decoder 3"]
    for line, series in zip(ax.lines, values):
        np.testing.assert_allclose(line.get_ydata(), series)
    marks = ax.collections[0].get_offsets()
    np.testing.assert_allclose(marks, [[250, values[1, 250]]])
    np.testing.assert_allclose(ax.collections[1].get_offsets()[:, 0], [280, 281])  # non-finite origins, top edge
    assert ax.get_yscale() == "log" and "1 shown" in ax.get_title()
    plt.close(ax.figure)


def test_report_summarises_vanishing_spikes_and_the_first_nonfinite_site(tmp_path):
    from gradscope.report import report
    from gradscope.sinks.parquet import to_arrow, write_part

    _, df = _run_with_events()
    (tmp_path / "run").mkdir()
    write_part(to_arrow(df), tmp_path / "run" / "part-r0-0-299-x.parquet")
    summary = report(tmp_path / "run", tmp_path / "out", progress=False).read_text()
    assert "300 recorded steps, 0–299" in summary
    assert "- step 0, decoder: bottom/top = 0.0" in summary and "**vanishing** toward the bottom" in summary
    assert "1 spike at 1 step (steps before 64 not judged" in summary
    assert "| 250 | 1 of 3 layer outputs | " in summary and f"| `{SITES[1]}` |" in summary
    assert f"Step 280: first at `{SITES[1]}` (forward activation" in summary
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["r_heatmap.png", "r_series.png"]


def test_report_warns_on_attention_logit_growth_and_gradient_rms_near_eps():
    from gradscope.report import LOGIT_GROWTH, signal_lines
    from gradscope.scan import GRAD_RMS_OVER_EPS_LOW
    from gradscope.table import make_frame

    rows = [dict(step=s, site="d.layers.0.attn", quantity="attn_logit_max", value=v) for s, v in ((0, 2.0), (10, 3.0))]
    rows.append(dict(step=10, site="d.layers.0", quantity="grad_rms_over_eps", value=GRAD_RMS_OVER_EPS_LOW * 2))
    calm = signal_lines(make_frame(rows))
    assert len(calm) == 1 and "WARNING" not in calm[0]
    rows += [dict(step=20, site="d.layers.0.attn", quantity="attn_logit_max", value=2.0 * LOGIT_GROWTH * 1.5),
             dict(step=20, site="d.layers.0", quantity="grad_rms_over_eps", value=GRAD_RMS_OVER_EPS_LOW / 2)]
    text = "\n".join(signal_lines(make_frame(rows)))
    assert f"grew more than {LOGIT_GROWTH:g}" in text and "peak 30 at step 20" in text
    assert "gradient RMS below" in text and "`d.layers.0`" in text and "from step 20" in text
    assert signal_lines(make_frame([])) == []


def test_a_checkpoint_of_the_mean_std_rule_resumes_with_its_windows_as_logs():
    """A spike state saved before the robust rule held raw values (and no "values" key)."""
    values = _series(300, planted=[(250, 0, 3.0)])
    keys = [(-1, "decoder", i + 1, site, "act_grad_norm", None, "layer_out") for i, site in enumerate(SITES)]
    first, second = SpikeDetector(), SpikeDetector()
    for t in range(200):
        first.rows(keys, values[:, t])
    state = first.state_dict()
    old = {"keys": state["keys"], "ring": torch.from_numpy(np.exp(state["ring"].numpy())), "seen": state["seen"]}
    second.load_state_dict(old)
    for t in range(200, 300):
        a, za = first.rows(keys, values[:, t])
        b, zb = second.rows(keys, values[:, t])
        assert a == b and np.allclose(za, zb, rtol=1e-12)
        assert [k.site for k in a] == ([SITES[0]] if t == 250 else [])
