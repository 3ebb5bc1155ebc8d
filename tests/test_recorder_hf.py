"""The recorder on HuggingFace models built from their config classes (random weights,
nothing downloaded): blocks and norms found, values equal autograd."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import gradscope
from recorder_ref import all_hook_dicts_empty, assert_rel, norm_gains, site_gradients

transformers = pytest.importorskip("transformers")


def gpt2():
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=50, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, "transformer.h", 3


def bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48,
                                  vocab_size=60, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(cfg)
    ids = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, "bert.encoder.layer", 2


def t5():
    cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=48, d_kv=16, num_heads=2,
                                vocab_size=60, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1, 60, (2, 9), generator=g), "labels": torch.randint(1, 60, (2, 5), generator=g)}
    return model, inputs, "encoder.block", 2


MODELS = {"gpt2": gpt2, "bert": bert, "t5": t5}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_foreign_model_values_equal_autograd(name):
    torch.manual_seed(0)
    model, inputs, first_stack, depth = MODELS[name]()
    model.train()
    run = lambda: model(**inputs).loss  # noqa: E731
    with gradscope.record(model) as rec:
        run().backward()
    df = rec.frame()
    assert all_hook_dicts_empty(model) == []
    probes = {p.name: (p.module, p.where) for p in rec.layout.sites}
    assert f"{first_stack}.0.in" in probes and f"{first_stack}.{depth - 1}.out" in probes
    assert any(n.endswith("norm.in") or "ln" in n or "layer_norm" in n.lower() or "LayerNorm" in n for n in probes)
    model.zero_grad()
    ref, _ = site_gradients(model, probes, run)
    got = df[(df.quantity == "act_grad_norm") & (df.micro_step == -1)]
    got = dict(zip(got.site, got.value))
    assert set(ref) <= set(got) | {n for n, v in ref.items() if v == 0.0}
    for site, value in ref.items():
        if site in got:
            assert_rel(got[site], value, what=site)
    norms = {n.name: n.module for n in rec.layout.norms}
    gains = df[df.quantity == "ln_gain"]
    expected = norm_gains(model, norms, run)
    for row in gains.itertuples():
        assert_rel(row.value, expected[row.site], what=row.site)
    assert len(gains) == len(norms)
    # parameter norms per block vs p.grad
    model.zero_grad()
    run().backward()
    params = dict(model.named_parameters())
    pg = df[df.quantity == "param_grad_norm"]
    pg = dict(zip(pg.site, pg.value))
    for i in range(depth):
        prefix = f"{first_stack}.{i}"
        expected_norm = math.sqrt(sum(p.grad.norm().item() ** 2 for n, p in params.items()
                                      if n.startswith(prefix + ".") and p.grad is not None))
        assert_rel(pg[prefix], expected_norm, what=prefix)
    assert df.variant.unique().tolist() == [type(model).__name__]


def test_gpt2_layers_and_cosine():
    model, inputs, stack, depth = gpt2()
    with gradscope.record(model, quantities="all", slow_every=1) as rec:
        model(**inputs).loss.backward()
    df = rec.frame()
    cos = df[(df.quantity == "cosine") & (df["stack"] == stack)]
    assert len(cos) == (depth + 1) ** 2
    diag = cos[cos.layer == cos.layer_j].value
    assert diag.sub(1.0).abs().max() < 1e-5
    out_rows = df[(df.quantity == "act_grad_norm") & df.site.str.endswith(".out") & (df["stack"] == stack)]
    assert sorted(out_rows.layer.dropna().unique().tolist()) == list(range(1, depth + 1))
    assert len(df[df.quantity == "ln_w_over_sigma"]) == 2 * depth + 1  # ln_1, ln_2 per block + ln_f


def test_gpt2_training_bit_identical():
    def train(record):
        torch.manual_seed(0)
        model, inputs, _, _ = gpt2()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        rec = gradscope.Recorder(model, quantities="all", optimizer=opt, slow_every=2)
        for step in range(4):
            with rec.step(step) if record else _null():
                model(**inputs).loss.backward()
            opt.step()
            opt.zero_grad()
        rec.close()
        return model

    a, b = train(False), train(True)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("reentrant", [True, False])
def test_llama_gradient_checkpointing_records_what_a_plain_run_does(reentrant):
    """HF checkpointing recomputes each layer inside backward (under reentrant checkpointing
    the first forward runs without grad): every row, ln_gain included, equals autograd."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    run = lambda: model(ids, labels=ids).loss  # noqa: E731
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with gradscope.record(model) as rec:
        run().backward()
    model.gradient_checkpointing_disable()
    model.zero_grad()
    df = rec.frame()
    probes = {p.name: (p.module, p.where) for p in rec.layout.sites}
    norms = {n.name: n.module for n in rec.layout.norms}
    ref, _ = site_gradients(model, probes, run)
    gains = norm_gains(model, norms, run)
    got = df[(df.quantity == "act_grad_norm") & (df.micro_step == -1)].set_index("site").value
    for site in probes:
        if ref.get(site):
            assert_rel(got[site], ref[site], what=site)
    got_gain = df[df.quantity == "ln_gain"].set_index("site").value
    assert set(got_gain.index) == set(norms)
    for n in norms:
        assert_rel(got_gain[n], gains[n], what=f"ln_gain {n}")


def test_snapshot_takes_keyword_inputs_and_puts_the_gradients_back():
    """``gradscope.snapshot`` with a dict of keyword inputs (an attention mask too): the total
    parameter-gradient norm equals autograd's on a copy, and the gradients the model held
    before (one None, one set) are back afterwards."""
    torch.manual_seed(0)
    model, inputs, _, _ = gpt2()
    inputs = {**inputs, "attention_mask": torch.ones_like(inputs["input_ids"])}
    reference = copy.deepcopy(model)
    reference(**inputs).loss.backward()
    want = math.sqrt(sum(p.grad.double().square().sum().item() for p in reference.parameters()))
    held = torch.full_like(model.lm_head.weight, 0.5)
    model.lm_head.weight.grad = held
    df = gradscope.snapshot(model, inputs, lambda out: out.loss, quantities="default")
    got = df.query("quantity == 'param_grad_norm' and site == ''").value.item()
    assert_rel(got, want, rel=1e-6, what="total param_grad_norm")
    assert model.lm_head.weight.grad is held and model.transformer.h[0].mlp.c_fc.weight.grad is None
