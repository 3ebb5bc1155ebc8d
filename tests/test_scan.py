"""``python -m gradscope scan``: documented flags, zoo and HuggingFace models, verdicts
computed from the recorded table."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

import gradscope
from gradscope.__main__ import main


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "gradscope", "scan", "--help"], capture_output=True, text=True, check=True).stdout
    import argparse

    from gradscope.__main__ import scan_parser

    sub = argparse.ArgumentParser().add_subparsers()
    parser = scan_parser(sub)
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in out
        if action.option_strings and action.dest != "help":
            assert action.help and "default" in action.help or action.dest == "hf", action.dest


def test_zoo_scan_verdict_matches_the_table(tmp_path, capsys):
    assert main(["scan", "--variant", "post_ln", "--n-enc", "6", "--n-dec", "6", "--d-model", "32", "--n-heads", "2",
                 "--d-ff", "64", "--vocab", "50", "--length", "10", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    table = gradscope.load(tmp_path / "scan.parquet")
    assert (tmp_path / "scan.png").stat().st_size > 0
    grads = table[(table.quantity == "act_grad_norm") & (table.micro_step == -1)]
    for stack in ("encoder", "decoder"):
        top = grads[grads.site == f"{stack}.layers.5.out"].value.item()
        bottom = grads[grads.site == f"{stack}.layers.0.out"].value.item()
        assert f"{stack}: gradient norm bottom/top layer = {bottom / top:.3g}" in printed
    gains = table[table.quantity == "ln_gain"]
    smallest = gains.loc[gains.value.idxmin()]
    assert f"{smallest.value:.3g} at {smallest.site}" in printed
    assert "non-finite sites: none" in printed


def test_hf_gpt2_scan_from_config(tmp_path, capsys):
    pytest.importorskip("transformers")
    assert main(["scan", "--hf", "gpt2", "--n-layer", "4", "--d-model", "32", "--n-heads", "2", "--vocab", "50",
                 "--length", "8", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "transformer.h: gradient norm bottom/top layer" in printed
    assert "transformer.h.3.out" in printed
    table = gradscope.load(tmp_path / "scan.parquet")
    assert set(table.variant) == {"GPT2LMHeadModel"}


def test_scan_runs_with_no_network(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "no_proxy": "*",
           "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, "-m", "gradscope", "scan", "--hf", "bert", "--n-layer", "2", "--d-model", "32",
                           "--n-heads", "2", "--vocab", "50", "--length", "8", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "bert.encoder.layer" in done.stdout
    # gradscope's warnings read as the command's, not as a line of the interpreter's runpy
    assert "gradscope scan: warning: attn_logit_max: no attention module recognised" in done.stderr, done.stderr
    assert "runpy" not in done.stderr, done.stderr


def test_the_command_line_puts_the_warning_display_back():
    before = warnings.showwarning
    with pytest.raises(SystemExit):
        main(["scan", "--d-model", "0"])
    assert warnings.showwarning is before


def test_scan_warns_on_large_attention_logits_and_gradient_rms_near_adams_eps():
    from gradscope.scan import ATTN_LOGIT_LARGE, GRAD_RMS_OVER_EPS_LOW, summarize
    from gradscope.table import make_frame

    rows = [dict(stack="decoder", layer=i, site=f"decoder.layers.{i - 1}.out", quantity="act_grad_norm", value=1.0,
                 role="layer_out") for i in (1, 2)]
    rows += [dict(stack="decoder", layer=1, site="decoder.layers.0.self_attn.fn.attn", quantity="attn_logit_max",
                  value=2 * ATTN_LOGIT_LARGE),
             dict(stack="decoder", layer=2, site="decoder.layers.1.self_attn.fn.attn", quantity="attn_logit_max", value=3.0),
             dict(stack="decoder", layer=1, site="decoder.layers.0.self_attn.fn.attn", quantity="attn_logit_max",
                  value=1e9, layer_j=0),  # a head row: the layer's row already holds the max it reports
             dict(site="decoder.layers.1", stack="decoder", layer=2, quantity="grad_rms_over_eps",
                  value=GRAD_RMS_OVER_EPS_LOW / 2),
             dict(site="", quantity="grad_rms_over_eps", value=1e3)]
    rows = [{"step": 0, **r} for r in rows]
    result = summarize(make_frame(rows))
    assert result.attn_logit_max == ("decoder.layers.0.self_attn.fn.attn", 2 * ATTN_LOGIT_LARGE)
    assert result.low_grad_rms == ("decoder.layers.1",)
    text = "\n".join(result.verdicts())
    assert "attention is near one-hot" in text and "decoder.layers.1" in text
    assert not result.healthy
    calm = summarize(make_frame([r for r in rows if r["quantity"] == "act_grad_norm"]))
    assert calm.healthy and calm.attn_logit_max is None and calm.low_grad_rms == ()


@pytest.mark.parametrize("argv, said", [
    (["--vocab", "3"], "--vocab must be >= 4 for a zoo model, got 3"),
    (["--hf", "gpt2", "--vocab", "1"], "--vocab must be >= 2 with --hf, got 1"),
    (["--device", "foo"], "--device 'foo'"),
    (["--n-enc", "0"], "--n-enc must be >= 1"),
    (["--d-model", "63"], "--d-model 63 must be a multiple of --n-heads 4"),
])
def test_bad_scan_flags_are_refused_naming_the_flag(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["scan", *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and said in err and "gradscope scan" in err, err


def test_flags_that_do_not_apply_are_said_to_be_ignored(tmp_path, capsys):
    main(["scan", "--hf", "gpt2", "--n-layer", "2", "--d-model", "16", "--n-heads", "2", "--vocab", "50",
          "--batch-size", "2", "--length", "8", "--variant", "pre_ln", "--n-enc", "3", "--out", str(tmp_path)])
    assert "--variant, --n-enc are ignored with --hf" in capsys.readouterr().err
