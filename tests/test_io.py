"""Loading tables written before the ``role`` column: the roles come out as the recorder gives them."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import gradscope
from gradscope import claims
from gradscope.io import FORMAT_KEY, FORMAT_VERSION
from gradscope.table import COLUMNS
from zoo_cases import batch, loss_of, tiny

FIGURES = Path(__file__).parent.parent / "figures"


def save_without_role(df, path: Path) -> None:
    """The table as a file of the time before the role column: every other column, tagged."""
    table = pa.Table.from_pandas(df.drop(columns="role"), preserve_index=False)
    pq.write_table(table.replace_schema_metadata({FORMAT_KEY: FORMAT_VERSION}), path)


def zoo_frame(variant: str, arch: str = "encoder_decoder"):
    model = gradscope.build_model(tiny(variant, arch))
    inputs = batch(model.config)
    with gradscope.record(model, quantities=["act_grad_norm", "act_norm", "ln_gain", "param_grad_norm"],
                          run=variant) as rec:
        loss = loss_of(model(*inputs), model.config)
        loss.backward()
        rec.log("loss", loss)
    return rec.frame()


def foreign_frame():
    """``nn.TransformerEncoder``: blocks ``layers.<i>`` and norms ``layers.<i>.norm1`` found by the layout."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 24, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(16), enable_nested_tensor=False)
    with gradscope.record(model, quantities=["act_grad_norm", "ln_gain"], run="torch") as rec:
        model(torch.randn(2, 5, 16)).pow(2).mean().backward()
    return rec.frame()


@pytest.mark.parametrize("make", [
    lambda: zoo_frame("post_ln"), lambda: zoo_frame("dlcl_pre"), lambda: zoo_frame("transparent_attention"),
    lambda: zoo_frame("b2t", "decoder"), foreign_frame,
], ids=["post_ln", "dlcl_pre", "transparent_attention", "b2t_decoder", "nn.TransformerEncoder"])
def test_old_table_gets_the_recorders_roles(make, tmp_path):
    df = make()
    assert set(df["role"]) - {""}, "the recorder wrote roles"
    save_without_role(df, tmp_path / "old.parquet")
    loaded = gradscope.load(tmp_path / "old.parquet")
    assert list(loaded.columns) == list(COLUMNS)
    both = loaded[["quantity", "site", "role"]].assign(recorded=df["role"])
    # a foreign model's final norm: its sites' names do not tell it, so an old table reads norm_in/norm_out
    told = both["recorded"].str.replace("final_norm_", "norm_") if df["variant"].iloc[0] not in gradscope.VARIANTS else both["recorded"]
    mismatch = both.loc[both["role"] != told].drop_duplicates()
    assert mismatch.empty, mismatch.head(10)


def test_new_table_keeps_its_roles(tmp_path):
    df = zoo_frame("pre_ln")
    gradscope.save_frame(df.assign(role=df["role"].where(df["role"] == "", "other")), tmp_path / "new.parquet")
    assert set(gradscope.load(tmp_path / "new.parquet")["role"]) <= {"", "other"}  # read, not derived


def test_committed_figure_tables_load_and_feed_the_claims():
    df = gradscope.load(FIGURES / "ln_locations.parquet")
    sites = df.loc[df["quantity"] == "act_grad_norm"]
    assert (sites["role"] != "").all() and (df.loc[df["quantity"] != "act_grad_norm", "role"] == "").all()
    assert set(sites.loc[sites["role"] == "layer_out", "site"]) == {f"{s}.layers.{i}.out" for s in ("encoder", "decoder")
                                                                  for i in range(int(sites["layer"].max()))}
    assert claims.over_seeds(claims.takase_fig4_ln_drops, df).holds is not None  # the locations are found by role
    grads = gradscope.load(FIGURES / "grad_norms.parquet")
    assert set(grads.loc[grads["role"] == "embed", "site"]) == {"encoder.embed.out", "decoder.embed.out"}
