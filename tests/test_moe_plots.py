"""gradscope.plots.expert_load and routing_series draw what the table holds (asserted on the
drawn arrays and lines, never on pixels), and refuse a table they cannot draw."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from gradscope import plots  # noqa: E402
from gradscope.table import make_frame  # noqa: E402


def table():
    rng = np.random.default_rng(0)
    rows, load = [], {}
    for run in ("a", "b"):
        for step in (0, 5, 10):
            for layer, site in ((1, "model.layers.0.mlp"), (2, "model.layers.1.mlp")):
                share = rng.dirichlet(np.ones(4))
                load[run, step, site] = share
                at = dict(run=run, step=step, stack="model.layers", layer=layer, site=site)
                rows += [dict(at, quantity="moe_load", layer_j=e, value=float(v)) for e, v in enumerate(share)]
                rows.append(dict(at, quantity="moe_imbalance", value=float(share.max() * 4)))
    return make_frame(rows), load


def test_expert_load_draws_experts_by_steps():
    df, load = table()
    fig, ax = plt.subplots()
    plots.expert_load(df, run="b", site="model.layers.1.mlp", ax=ax)
    drawn = ax.images[0].get_array()
    want = np.stack([load["b", s, "model.layers.1.mlp"] for s in (0, 5, 10)], axis=1)  # (experts, steps)
    np.testing.assert_allclose(np.asarray(drawn), want, rtol=1e-6)
    plt.close(fig)


def test_routing_series_one_line_per_run_and_layer():
    df, load = table()
    fig, ax = plt.subplots()
    plots.routing_series(df, quantity="moe_imbalance", ax=ax)
    assert len(ax.lines) == 4
    line = next(ln for ln in ax.lines if ln.get_label() == "a model.layers.0.mlp")
    np.testing.assert_allclose(line.get_ydata(), [load["a", s, "model.layers.0.mlp"].max() * 4 for s in (0, 5, 10)],
                               rtol=1e-6)
    plt.close(fig)


def test_bad_input_names_the_choices():
    df, _ = table()
    with pytest.raises(ValueError, match="pass run="):
        plots.expert_load(df)
    with pytest.raises(ValueError, match="valid: \\['model.layers.0.mlp', 'model.layers.1.mlp'\\]"):
        plots.expert_load(df, run="a", site="nope")
    with pytest.raises(ValueError, match="no 'router_z' rows"):
        plots.routing_series(df, quantity="router_z")
