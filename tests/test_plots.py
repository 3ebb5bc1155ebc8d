"""Plot functions: assert on what was drawn, computed here from the input table."""

from __future__ import annotations

import os

os.environ.setdefault("MPLBACKEND", "Agg")

import matplotlib  # noqa: E402

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from gradscope import plots  # noqa: E402
from gradscope.table import select  # noqa: E402
from gradscope.table import make_frame  # noqa: E402

L = 4


@pytest.fixture
def ax():
    fig, axes = plt.subplots()
    yield axes
    plt.close(fig)


def grad_table(reduction: str = "mean") -> pd.DataFrame:
    """act_grad_norm at layer outputs and LN locations: two variants, two steps, two micro-batches."""
    rng = np.random.default_rng(0)
    rows = []
    for variant in ("post_ln", "pre_ln"):
        for step in (0, 5):
            for micro in (0, 1):
                def add(site, role, layer, value):
                    rows.append(dict(run=f"{variant}-{L}L", variant=variant, step=step, micro_step=micro,
                                     stack="decoder", layer=layer, site=site, role=role, quantity="act_grad_norm",
                                     value=value, reduction=reduction))
                add("decoder.embed.out", "embed", 0, rng.uniform(0.1, 1))
                for i in range(1, L + 1):
                    add(f"decoder.layers.{i - 1}.out", "layer_out", i, rng.uniform(0.1, 1))
                    add(f"decoder.layers.{i - 1}.in", "layer_in", i, rng.uniform(0.1, 1))
                    for sub in ("self_attn", "cross_attn", "ffn"):
                        for end in ("in", "out"):
                            add(f"decoder.layers.{i - 1}.{sub}.norm.{end}", f"norm_{end}", i, rng.uniform(0.1, 1))
    return make_frame(rows)


def expected_profile(df, variant, step, suffix="out"):
    sel = df[(df.variant == variant) & (df.step == step) & df.site.str.fullmatch(rf"decoder\.layers\.\d+\.{suffix}")]
    return sel.groupby(sel.layer.astype(int))["value"].mean()


def test_layer_norms_draws_mean_over_micro_batches_per_layer(ax):
    df = grad_table()
    before = df.copy()
    out = plots.layer_norms(df, ax=ax, title="preset ci")
    assert out is ax
    pd.testing.assert_frame_equal(df, before)
    assert [line.get_label() for line in ax.lines] == ["post_ln", "pre_ln"]
    for line, variant in zip(ax.lines, ("post_ln", "pre_ln")):
        exp = expected_profile(df, variant, step=0)
        np.testing.assert_array_equal(line.get_xdata(), exp.index.to_numpy(dtype=float))
        np.testing.assert_allclose(line.get_ydata(), exp.to_numpy())
    assert ax.get_yscale() == "log"
    assert ax.get_ylabel() == "‖∂L/∂h‖₂ (loss: mean over tokens, nats)"
    assert ax.get_xlabel() == "layer"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["post_ln", "pre_ln"]
    assert ax.get_title().startswith("preset ci\n") and "step 0" in ax.get_title()
    assert "micro-batches" in ax.get_title()


def test_layer_norms_last_step_embedding_and_reduction(ax):
    df = grad_table(reduction="sum")
    plots.layer_norms(df, step="last", include_embed=True, hue_order=["pre_ln"], logy=False, ax=ax)
    (line,) = ax.lines
    sites = df.site.str.fullmatch(r"decoder\.(layers\.\d+\.out|embed\.out)")
    sel = df[(df.variant == "pre_ln") & (df.step == 5) & sites]
    exp = sel.groupby(sel.layer.astype(int))["value"].mean()
    np.testing.assert_array_equal(line.get_xdata(), np.arange(L + 1, dtype=float))
    np.testing.assert_allclose(line.get_ydata(), exp.to_numpy())
    assert ax.get_yscale() == "linear"
    assert "sum over tokens" in ax.get_ylabel()
    assert "step 5" in ax.get_title() and "embedding" in ax.get_xlabel()


def test_layer_norms_refuses_to_mix_runs(ax):
    df = grad_table()
    other = df.assign(run=df.run.astype(str) + "-seed1")
    with pytest.raises(ValueError, match="mixes runs"):
        plots.layer_norms(pd.concat([df, other], ignore_index=True), ax=ax)
    with pytest.raises(ValueError, match="no rows"):
        plots.layer_norms(df, stack="encoder", ax=ax)


def test_layer_norms_other_roles_average_the_layers_sites(ax):
    df = grad_table()
    plots.layer_norms(df, role="norm_in", hue_order=["post_ln"], ax=ax)
    sel = df[(df.variant == "post_ln") & (df.step == 0) & df.site.str.fullmatch(r"decoder\.layers\.\d+\.\w+\.norm\.in")]
    np.testing.assert_allclose(ax.lines[0].get_ydata(), sel.groupby(sel.layer.astype(int))["value"].mean().to_numpy())
    assert "norm_in sites" in ax.get_title()


def test_layer_norms_select_foreign_blocks_by_role(ax):
    """Blocks of another model (``transformer.h.<i>``): layer outputs found by role, their norms left out."""
    rows = [dict(run="gpt2", variant="GPT2LMHeadModel", step=0, stack="transformer.h", layer=i, site=site, role=role,
                 quantity="act_grad_norm", value=v)
            for i in range(1, L + 1)
            for site, role, v in ((f"transformer.h.{i - 1}.out", "layer_out", float(i)),
                                  (f"transformer.h.{i - 1}.ln_1.out", "norm_out", 100.0 * i))]
    plots.layer_norms(make_frame(rows), stack="transformer.h", ax=ax)
    np.testing.assert_array_equal(ax.lines[0].get_xdata(), np.arange(1, L + 1))
    np.testing.assert_allclose(ax.lines[0].get_ydata(), np.arange(1, L + 1))


def test_sublayer_is_the_layers_child_holding_the_site():
    sites = pd.Series(["decoder.layers.3.cross_attn.norm.in", "encoder.layers.0.ffn.norm", "decoder.layers.3.out",
                       "decoder.embed.out", "model.layers.3.input_layernorm.in", "transformer.h.3.ln_1.in", ""],
                      dtype="string")
    assert select.sublayer(sites).tolist() == ["cross_attn", "ffn", "", "", "input_layernorm", "", ""]


def test_location_norms_default_layers_and_values(ax):
    df = grad_table()
    before = df.copy()
    plots.location_norms(df, ax=ax, title="ci")
    pd.testing.assert_frame_equal(df, before)
    assert [line.get_label() for line in ax.lines] == ["layer 1", "layer 2", "layer 4"]
    suffixes = ["self_attn.norm.in", "self_attn.norm.out", "cross_attn.norm.in", "cross_attn.norm.out", "ffn.norm.in"]
    post = df[(df.variant == "post_ln") & (df.step == 0)]
    for line, layer in zip(ax.lines, (1, 2, 4)):
        exp = [post[post.site == f"decoder.layers.{layer - 1}.{s}"]["value"].mean() for s in suffixes]
        np.testing.assert_array_equal(line.get_xdata(), [1.0, 2.0, 3.0, 4.0, 5.0])
        np.testing.assert_allclose(line.get_ydata(), exp)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["(1) LN1 in", "(2) LN1 out", "(3) LN2 in", "(4) LN2 out", "(5) LN3 in"]
    assert ax.get_yscale() == "log" and "nats" in ax.get_ylabel()


def test_location_norms_gaps_and_missing_layer(ax):
    df = grad_table()
    no_cross = df[~df.site.str.contains("cross_attn")]
    plots.location_norms(no_cross, layers=[3], ax=ax)
    y = ax.lines[0].get_ydata()
    assert np.isnan(y[2]) and np.isnan(y[3]) and np.isfinite(y[[0, 1, 4]]).all()
    with pytest.raises(ValueError, match="layers \\[9\\]"):
        plots.location_norms(df, layers=[1, 9], ax=ax)
    with pytest.raises(ValueError, match="covers runs"):
        plots.location_norms(pd.concat([df, df.assign(run="x")]), ax=ax)


def matrix_table(quantity: str, mats: dict[str, np.ndarray], stack: str = "decoder", step: int = 7) -> pd.DataFrame:
    rows = [dict(run=v, variant=v, step=step, stack=stack, layer=i, layer_j=j, site=f"{stack}.matrix",
                 quantity=quantity, value=float(m[i, j]))
            for v, m in mats.items() for i in range(len(m)) for j in range(i + 1)]
    return make_frame(rows)


def test_cosine_heatmap_masks_upper_triangle(ax):
    rng = np.random.default_rng(1)
    mat = rng.uniform(-0.2, 1, size=(L + 1, L + 1))
    df = matrix_table("cosine", {"post_ln": mat, "pre_ln": mat / 2})
    before = df.copy()
    plots.cosine_heatmap(df, variant="post_ln", ax=ax, title="ci · post_ln")
    pd.testing.assert_frame_equal(df, before)
    arr = ax.collections[0].get_array().reshape(L + 1, L + 1)
    upper = np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1)
    np.testing.assert_array_equal(np.ma.getmaskarray(arr), upper)
    np.testing.assert_allclose(arr.data[~upper], mat[~upper])
    assert ax.collections[0].get_clim() == (0.0, 1.0)
    assert ax.collections[0].colorbar is not None
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"$y_{{{k}}}$" for k in range(L + 1)]
    assert "step 7" in ax.get_title() and "upper triangle masked" in ax.get_title()


def test_dlcl_heatmap_masks_by_absolute_and_relative_threshold(ax):
    w = np.zeros((L + 1, L + 1))
    w[np.tril_indices(L + 1)] = 0.5
    w[3, 1] = 0.05                 # |w| < 0.1 -> masked
    w[4, 4] = 20.0                 # row max 20: 0.5 < 5% of 20 -> row 4 masked except the diagonal
    w[2, 0] = -0.6                 # negative, above both thresholds -> kept
    df = matrix_table("dlcl_weight", {"dlcl_pre": w}, stack="encoder")
    plots.dlcl_heatmap(df, variant="dlcl_pre", ax=ax)
    arr = ax.collections[0].get_array().reshape(L + 1, L + 1)
    expected = np.triu(np.ones_like(w, dtype=bool), k=1)
    expected[3, 1] = True
    expected[4, :4] = True
    np.testing.assert_array_equal(np.ma.getmaskarray(arr), expected)
    assert arr[2, 0] == -0.6
    assert ax.collections[0].get_clim() == (-1.0, 1.0)
    assert "|w| < 0.1 or |w| < 5% of row max |w|" in ax.get_title()


def test_cosine_heatmap_full_symmetric_matrix_and_errors(ax):
    """The recorder stores the full (L+1)×(L+1) matrix; the upper triangle is still masked."""
    mat = np.full((L + 1, L + 1), 0.3) + np.eye(L + 1) * 0.7
    rows = [dict(run="r", variant="pre_ln", step=s, stack="decoder", layer=i, layer_j=j, site="decoder.layers",
                 quantity="cosine", value=float(mat[i, j]) * (1 + s)) for s in (0, 1)
            for i in range(L + 1) for j in range(L + 1)]
    df = make_frame(rows)
    plots.cosine_heatmap(df, variant="pre_ln", step=0, ax=ax)
    arr = ax.collections[0].get_array().reshape(L + 1, L + 1)
    np.testing.assert_array_equal(np.ma.getmaskarray(arr), np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1))
    np.testing.assert_allclose(arr.data[np.tril_indices(L + 1)], mat[np.tril_indices(L + 1)])
    with pytest.raises(ValueError, match="no cosine rows"):
        plots.cosine_heatmap(df, variant="post_ln", ax=ax)


def test_dlcl_heatmap_site_choice_and_rectangular_weights(ax):
    """Two mixers in one stack need site=; a transparent-attention W is (N+1)×M."""
    w = np.arange(12, dtype=float).reshape(4, 3) / 10
    rows = [dict(run="ta", variant="transparent_attention", step=0, stack="decoder", layer=i, layer_j=j,
                 site=site, quantity="dlcl_weight", value=float(w[i, j]) * k)
            for k, site in ((1, "decoder.memory"), (2, "decoder.other")) for i in range(4) for j in range(3)]
    df = make_frame(rows)
    with pytest.raises(ValueError, match="pass site="):
        plots.dlcl_heatmap(df, variant="transparent_attention", stack="decoder", ax=ax)
    plots.dlcl_heatmap(df, variant="transparent_attention", stack="decoder", site="decoder.memory", ax=ax)
    arr = ax.collections[0].get_array().reshape(4, 3)
    np.testing.assert_array_equal(np.ma.getmaskarray(arr), np.abs(w) < 0.1)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["$y_{0}$", "$y_{1}$", "$y_{2}$"]


def test_dlcl_column_one_line_per_step(ax):
    w0 = np.tril(np.full((L + 1, L + 1), 0.2))
    w1 = np.tril(np.arange((L + 1) ** 2, dtype=float).reshape(L + 1, L + 1))
    df = pd.concat([matrix_table("dlcl_weight", {"d": w0}, "encoder", step=0),
                    matrix_table("dlcl_weight", {"d": w1}, "encoder", step=9)], ignore_index=True)
    plots.dlcl_column(df, column=2, variant="d", step=[0, 9], ax=ax)
    assert [line.get_label() for line in ax.lines] == ["step 0", "step 9"]
    for line, w in zip(ax.lines, (w0, w1)):
        np.testing.assert_array_equal(line.get_xdata(), [2.0, 3.0, 4.0])
        np.testing.assert_array_equal(line.get_ydata(), w[2:, 2])
    with pytest.raises(ValueError, match="outside"):
        plots.dlcl_column(df, column=L + 1, variant="d", ax=ax)


def loss_table() -> pd.DataFrame:
    rows = []
    for variant, values in (("post_ln", [5.0, 4.0, np.nan, np.inf]), ("pre_ln", [5.0, 3.0, 2.0, 1.5])):
        for step, value in enumerate(values):
            for micro in (0, 1):
                rows.append(dict(run=variant, variant=variant, step=step * 10, micro_step=micro,
                                 quantity="loss", value=value + micro))
            rows.append(dict(run=variant, variant=variant, step=step * 10, quantity="val_loss", value=value))
    return make_frame(rows)


def test_loss_curves_marks_divergence(ax):
    df = loss_table()
    before = df.copy()
    plots.loss_curves(df, ax=ax, title="ci")
    pd.testing.assert_frame_equal(df, before)
    post, pre = ax.lines[0], ax.lines[1]
    assert (post.get_label(), pre.get_label()) == ("post_ln", "pre_ln")
    np.testing.assert_array_equal(post.get_xdata(), [0, 10, 20, 30])
    np.testing.assert_allclose(post.get_ydata(), [5.5, 4.5, np.nan, np.nan])
    np.testing.assert_allclose(pre.get_ydata(), [5.5, 3.5, 2.5, 2.0])
    (mark,) = ax.lines[2:]
    np.testing.assert_array_equal(mark.get_xdata(), [20])
    assert mark.get_marker() == "x" and mark.get_color() == post.get_color()
    assert ax.get_ylabel() == "training loss (nats, mean over tokens)"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["post_ln", "pre_ln"] and "failed" in legend[2]
    assert "1 run(s) diverged" in ax.get_title()


def test_loss_unit_follows_the_tables_log_base(ax):
    df = loss_table()
    df.attrs["loss_log_base"] = "2"
    plots.loss_curves(df, ax=ax)
    assert ax.get_ylabel() == "training loss (bits, mean over tokens)"


def test_loss_curves_nonfinite_flag_and_val_loss(ax):
    df = loss_table()
    flag = make_frame([dict(run="pre_ln", variant="pre_ln", step=30, quantity="nonfinite_grad", site="y",
                            value=0.0)])  # value 0: the first non-finite site
    plots.loss_curves(pd.concat([df, flag], ignore_index=True), quantity="val_loss", ax=ax)
    np.testing.assert_allclose(ax.lines[1].get_ydata(), [5.0, 3.0, 2.0, 1.5])
    assert [m.get_xdata()[0] for m in ax.lines[2:]] == [20, 30]
    assert ax.get_ylabel().startswith("validation loss (nats")


def sweep() -> pd.DataFrame:
    rows = [("post_ln", "xavier", 6, 4.0, True), ("post_ln", "xavier", 12, 3.9, True),
            ("post_ln", "xavier", 18, np.nan, False), ("post_ln", "lipschitz", 18, 3.5, True),
            ("pre_ln", "xavier", 6, 4.1, True), ("pre_ln", "xavier", 18, 3.7, True),
            ("pre_ln", "xavier", 18, 3.9, True), ("pre_ln", "xavier", 24, np.nan, None)]
    return pd.DataFrame([dict(run=f"r{k}", variant=v, init=i, depth=d, best_val_loss=b, converged=c)
                         for k, (v, i, d, b, c) in enumerate(rows)])


def test_depth_sweep_marks_failed_runs(ax):
    summary = sweep()
    before = summary.copy()
    plots.depth_sweep(summary, ax=ax, title="ci")
    pd.testing.assert_frame_equal(summary, before)
    labels = [line.get_label() for line in ax.lines[:3]]
    assert labels == ["post_ln+lipschitz", "post_ln+xavier", "pre_ln+xavier"]
    np.testing.assert_array_equal(ax.lines[1].get_xdata(), [6, 12, 18])
    np.testing.assert_allclose(ax.lines[1].get_ydata(), [4.0, 3.9, np.nan])
    np.testing.assert_allclose(ax.lines[2].get_ydata(), [4.1, 3.8, np.nan])
    (mark,) = ax.lines[3:]
    np.testing.assert_array_equal(mark.get_xdata(), [18])
    assert mark.get_color() == ax.lines[1].get_color()
    assert "failed" in [t.get_text() for t in ax.get_legend().get_texts()][-1]
    assert "nats" in ax.get_ylabel()
    with pytest.raises(ValueError, match="converged"):
        plots.depth_sweep(summary.drop(columns="converged"), ax=ax)


def test_depth_sweep_draws_a_failed_run_at_its_loss_in_the_colour_the_order_gives(ax):
    summary = pd.concat([sweep(), pd.DataFrame([dict(run="r9", variant="pre_ln", init="xavier", depth=12,
                                                     best_val_loss=3.95, converged=False)])], ignore_index=True)
    order = ["pre_ln+xavier", "post_ln+xavier", "post_ln+lipschitz"]
    plots.depth_sweep(summary, order=order, ax=ax)
    assert [line.get_label() for line in ax.lines[:3]] == order
    assert [line.get_color() for line in ax.lines[:3]] == ["C0", "C1", "C2"]
    (hollow,) = ax.collections
    np.testing.assert_allclose(hollow.get_offsets(), [[12, 3.95]])
    np.testing.assert_allclose(hollow.get_edgecolors()[0], matplotlib.colors.to_rgba("C0"))
    with pytest.raises(ValueError, match="leaves out"):
        plots.depth_sweep(summary, order=order[:2], ax=ax)


def norm_table(quantity: str) -> pd.DataFrame:
    rows = []
    for run, scale in (("post_ln-xavier", 0.5), ("post_ln-lipschitz", 0.9)):
        for i in range(1, L + 1):
            for sub in ("self_attn", "ffn"):
                rows.append(dict(run=run, variant="post_ln", step=0, stack="encoder", layer=i,
                                 site=f"encoder.layers.{i - 1}.{sub}.norm", quantity=quantity,
                                 value=scale + 0.01 * i + (0.1 if sub == "ffn" else 0.0)))
        rows.append(dict(run=run, variant="post_ln", step=0, stack="encoder", site="encoder.final_norm",
                         quantity=quantity, value=99.0))
    return make_frame(rows)


@pytest.mark.parametrize("func, quantity", [(plots.w_over_sigma, "ln_w_over_sigma"),
                                            (plots.scalenorm_g, "scalenorm_g")])
def test_norm_profiles_average_the_norms_of_a_layer(ax, func, quantity):
    df = norm_table(quantity)
    before = df.copy()
    func(df, ax=ax, title="ci")
    pd.testing.assert_frame_equal(df, before)
    for line, run in zip(ax.lines, ("post_ln-lipschitz", "post_ln-xavier")):
        assert line.get_label() == run
        sel = df[(df.run == run) & df.layer.notna()]
        exp = sel.groupby(sel.layer.astype(int))["value"].mean()
        np.testing.assert_array_equal(line.get_xdata(), exp.index.to_numpy(dtype=float))
        np.testing.assert_allclose(line.get_ydata(), exp.to_numpy())
    assert "mean over the layer's norms" in ax.get_title()
    if func is plots.w_over_sigma:
        ref = ax.lines[-1]
        assert ref.get_label() == "w/σ = 1" and list(ref.get_ydata()) == [1.0, 1.0]
        assert "w/σ" in ax.get_ylabel()
    else:
        assert len(ax.lines) == 2 and "g" in ax.get_ylabel()


def test_ax_none_uses_current_axes():
    fig, ax = plt.subplots()
    try:
        assert plots.layer_norms(grad_table()) is ax
    finally:
        plt.close(fig)


def gain_table(stack: str, names: dict[str, str], steps=(0, 5)) -> pd.DataFrame:
    """ln_gain rows of 3 layers: value = 10·step + layer + offset of the norm (``names``:
    site of layer i as a format string -> offset)."""
    rows = [dict(run="r", variant="v", step=step, stack=stack, layer=i, site=site.format(i - 1), role="norm",
                 quantity="ln_gain", value=10.0 * step + i + offset)
            for step in steps for i in (1, 2, 3) for site, offset in names.items()]
    rows.append(dict(run="r", variant="v", step=0, stack=stack, site=f"{stack}.final_norm", role="norm",
                     quantity="ln_gain", value=99.0))  # the stack's final norm (no layer): left out
    return make_frame(rows)


@pytest.mark.parametrize("step, base", [("first", 0.0), ("last", 50.0), (5, 50.0)])
def test_ln_gains_draws_one_step_per_line(ax, step, base):
    df = gain_table("decoder", {"decoder.layers.{}.self_attn.norm": 0.1, "decoder.layers.{}.ffn.norm": 0.3})
    plots.ln_gains(df, stack="decoder", step=step, ax=ax)
    drawn = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert drawn["LN1 (after SA)"] == pytest.approx([base + 1.1, base + 2.1, base + 3.1])
    assert drawn["LN3 (after FFN)"] == pytest.approx([base + 1.3, base + 2.3, base + 3.3])
    assert "LN2 (after CA)" not in drawn  # (no cross-attention in this stack: no empty line)
    assert ax.get_title().startswith(f"step {0 if step == 'first' else 5}")


def test_ln_gains_of_a_foreign_model_draws_each_norm_name_and_names_the_stacks(ax):
    df = gain_table("transformer.h", {"transformer.h.{}.ln_1": 0.1, "transformer.h.{}.ln_2": 0.2})
    plots.ln_gains(df, stack="transformer.h", ax=ax)
    drawn = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert drawn["ln_1"] == pytest.approx([1.1, 2.1, 3.1]) and drawn["ln_2"] == pytest.approx([1.2, 2.2, 3.2])
    ax.clear()
    plots.ln_gains(df, ax=ax)  # one stack: no stack= needed (issue 52)
    assert {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()} == drawn
    with pytest.raises(ValueError, match=r"stack 'decoder'.*\['transformer.h'\]"):
        plots.ln_gains(df, stack="decoder", ax=ax)
