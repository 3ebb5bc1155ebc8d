"""Issue 52 part 7: ``gradscope scan --model pkg.module:factory`` on a model written here
(checked against autograd), its errors naming the part that failed, and plots that need no
``stack=`` on a model with one block list (HF GPT-2), while one with two stacks names them."""

from __future__ import annotations

import sys
import textwrap

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gradscope  # noqa: E402
from gradscope import plots  # noqa: E402
from gradscope.__main__ import main  # noqa: E402
from gradscope.model_spec import ModelSpecError, load_model  # noqa: E402

USER_MODELS = textwrap.dedent('''
    import torch
    from torch import nn

    class Block(nn.Module):  # a nanoGPT-style pre-LN block
        def __init__(self, d):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            h = self.ln_1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self, vocab=40, d=16, n=3):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.h = nn.ModuleList(Block(d) for _ in range(n))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            x = self.wte(idx)
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    class Builders:
        @staticmethod
        def small():
            return GPT(n=2)

    def small():
        return GPT()

    def encoder():  # torch's own encoder stack, on (batch, length, d) values
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def broken():
        raise RuntimeError("no weights here")

    def not_a_model():
        return 3

    SIZE = 3
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``gs_user_models_52.py`` in a fresh current directory; sys.path and sys.modules restored after."""
    (tmp_path / "gs_user_models_52.py").write_text(USER_MODELS)
    (tmp_path / "gs_bad_dep_52.py").write_text("import gs_no_such_dependency_52\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name in ("gs_user_models_52", "gs_bad_dep_52"):
        sys.modules.pop(name, None)


def test_scan_model_records_the_users_model_as_autograd_sees_it(user_module, capsys):
    assert main(["scan", "--model", "gs_user_models_52:small", "--vocab", "40", "--batch-size", "2", "--length", "8",
                 "--seed", "3", "--out", str(user_module / "out")]) == 0
    assert "loss: next-token cross-entropy" in capsys.readouterr().out
    table = gradscope.load(user_module / "out" / "scan.parquet")
    outs = table[(table.quantity == "act_grad_norm") & (table.role == "layer_out")].sort_values("layer")

    torch.manual_seed(3)  # the reference: the same factory, seed and batch, gradients by autograd
    model = load_model("gs_user_models_52:small").train()
    ids = torch.randint(1, 40, (2, 8), generator=torch.Generator().manual_seed(3))
    kept = []
    for block in model.h:
        block.register_forward_hook(lambda m, a, out: kept.append(out))
    logits = model(ids)
    grads = torch.autograd.grad(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()), kept)
    assert outs.site.tolist() == [f"h.{i}.out" for i in range(3)]
    np.testing.assert_allclose(outs.value.to_numpy(), [g.norm().item() for g in grads], rtol=1e-5)


def test_scan_model_of_a_file_a_nested_factory_and_float_input(user_module, capsys):
    assert len(load_model("gs_user_models_52.py:small").h) == 3
    assert len(load_model("gs_user_models_52:Builders.small").h) == 2
    assert main(["scan", "--model", "gs_user_models_52.py:encoder", "--input", "float", "--d-model", "16",
                 "--batch-size", "2", "--length", "4", "--out", str(user_module / "out")]) == 0
    assert "loss: mean of the squares of the output (2, 4, 16)" in capsys.readouterr().out
    table = gradscope.load(user_module / "out" / "scan.parquet")
    assert sorted(table[(table.quantity == "act_grad_norm") & (table.role == "layer_out")].site) == [
        "layers.0.out", "layers.1.out"]


@pytest.mark.parametrize("spec, said", [
    ("gs_user_models_52", "expected 'package.module:factory'"),
    (":small", "expected 'package.module:factory'"),
    ("gs_no_such_module_52:small", "cannot import module 'gs_no_such_module_52': no module named 'gs_no_such_module_52'"),
    ("gs_bad_dep_52:f", "module 'gs_bad_dep_52' was found but importing it failed: no module named "
                        "'gs_no_such_dependency_52'"),
    ("no_such_file_52.py:small", "no such file 'no_such_file_52.py'"),
    ("gs_user_models_52:nope", "'gs_user_models_52' has no attribute 'nope'; its callables: ['Block', 'Builders', 'GPT'"),
    ("gs_user_models_52:SIZE", "gs_user_models_52:SIZE is a int, not a callable"),
    ("gs_user_models_52:broken", "calling gs_user_models_52:broken() raised RuntimeError: no weights here"),
    ("gs_user_models_52:not_a_model", "gs_user_models_52:not_a_model() returned a int, not a torch.nn.Module"),
])
def test_a_bad_model_spec_names_the_part_that_failed(user_module, capsys, spec, said):
    with pytest.raises(ModelSpecError) as caught:
        load_model(spec)
    assert said in str(caught.value) and f"--model {spec!r}" in str(caught.value)
    with pytest.raises(SystemExit) as stop:
        main(["scan", "--model", spec, "--out", str(user_module / "out")])
    assert stop.value.code == 2 and said in capsys.readouterr().err


def test_a_model_that_fails_on_the_synthetic_batch_says_which_flags_set_it(user_module, capsys):
    with pytest.raises(SystemExit):  # ids up to --vocab 1000 in an embedding of 40
        main(["scan", "--model", "gs_user_models_52:small", "--batch-size", "2", "--length", "4",
              "--out", str(user_module / "out")])
    err = capsys.readouterr().err
    assert "the model on --input tokens of shape (2, 4) (ids in [1, 1000)) failed: IndexError" in err and "--vocab" in err


def _hf_table(transformers, model):
    ids = torch.randint(1, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids
    with gradscope.record(model, quantities=["act_grad_norm", "ln_gain", "ln_w_over_sigma", "cosine"], slow_every=1) as rec:
        model(**inputs).loss.backward()
    return rec.frame()


def test_plots_need_no_stack_on_a_model_with_one_block_list():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=40,
                                                                n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                attn_pdrop=0.0))
    df = _hf_table(transformers, gpt2)
    want = df[(df.quantity == "act_grad_norm") & (df.role == "layer_out")].sort_values("layer").value.to_numpy()
    for draw in (plots.layer_norms, plots.ln_gains, plots.w_over_sigma, plots.cosine_heatmap):
        fig, ax = plt.subplots()
        draw(df, ax=ax)  # no stack=: the table's one stack, transformer.h
        assert "transformer.h" in ax.get_title() or draw is plots.ln_gains
        if draw is plots.layer_norms:
            np.testing.assert_allclose(ax.lines[0].get_ydata(), want)
        plt.close(fig)

    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=16, d_ff=32, d_kv=8, num_heads=2, vocab_size=40,
        decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0))
    two = _hf_table(transformers, t5)
    stacks = sorted(set(two.loc[two.quantity == "act_grad_norm", "stack"]) - {""})
    assert len(stacks) == 2
    with pytest.raises(ValueError) as caught:
        plots.layer_norms(two)
    assert f"layer_norms: the table has act_grad_norm rows in several stacks {stacks}; pass stack=" in str(caught.value)
    plt.close("all")
