"""The signals before instability (attention logits and entropy, output log Z, sub-layer RMS,
gradient RMS over Adam's ε), each against a direct computation in the test: attention logits
recomputed from q and k taken by hooks on a plain forward, entropies from HuggingFace's own
eager attention weights, log Z from the logits, RMS from the branch outputs, ‖g‖ from p.grad."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import gradscope
from gradscope.recorder.capture.signals import QUERIES
from zoo_cases import batch, tiny


def _rows(frame, quantity):
    return frame[frame.quantity == quantity]


def _head_values(frame, quantity, site):
    rows = _rows(frame, quantity)
    rows = rows[(rows.site == site) & rows.layer_j.notna()].sort_values("layer_j")
    return torch.tensor(rows.value.to_numpy(), dtype=torch.float64)


def _stats(logits: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head (dim 1): max allowed logit and mean entropy over queries, from (B, H, T, S)."""
    masked = logits.double().masked_fill(~allowed, -math.inf)
    p = masked.softmax(-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return masked.amax(dim=(0, 2, 3)), entropy.mean(dim=(0, 2))


def _stats_of_queries(logits: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_stats`, the entropy a mean over the queries with an allowed key only."""
    masked = logits.double().masked_fill(~allowed, -math.inf)
    p = masked.softmax(-1).nan_to_num(0.0)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    valid = allowed.any(-1)
    return masked.amax(dim=(0, 2, 3)), (entropy * valid).sum(dim=(0, 2)) / valid.sum(dim=(0, 2))


def _zoo_reference(model, inputs):
    """Every zoo attention's (q, k, mask), from hooks on a plain forward of ``model``."""
    seen = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, gradscope.models.sublayers.MultiheadAttention):
            entry = seen.setdefault(name, {})
            handles.append(m.register_forward_pre_hook(lambda mod, args, e=entry: e.update(mask=args[2])))
            q_src, k_src = getattr(m, "q_norm", m.q_proj), getattr(m, "k_norm", m.k_proj)  # QK-LayerNorm's output
            handles.append(q_src.register_forward_hook(lambda mod, a, out, e=entry: e.update(q=out.detach())))
            handles.append(k_src.register_forward_hook(lambda mod, a, out, e=entry: e.update(k=out.detach())))
    with torch.no_grad():
        out = model(*inputs)
    for h in handles:
        h.remove()
    return seen, out


@pytest.mark.parametrize("T,qk_norm", [(6, False), (80, False), (6, True)])
def test_zoo_attention_logits_and_entropy_equal_a_recomputation_from_q_and_k(T, qk_norm):
    torch.manual_seed(0)
    config = tiny("pre_ln", "encoder_decoder", dropout=0.0, max_len=96, qk_norm=qk_norm)
    model = gradscope.build_model(config)
    reference = copy.deepcopy(model)
    inputs = batch(config, S=9, T=T)
    rec = gradscope.Recorder(model, quantities=["attn_logit_max", "attn_entropy"])
    with rec.step(0):
        model(*inputs).sum().backward()
    frame = rec.frame()
    rec.close()
    seen, _ = _zoo_reference(reference, inputs)
    assert len(seen) == config.n_enc + 2 * config.n_dec  # self per encoder layer, self and cross per decoder layer
    for name, e in seen.items():
        H = config.n_heads
        B, Tq = e["q"].shape[:2]
        d = config.d_model
        q = e["q"].reshape(B, Tq, H, d // H).transpose(1, 2)
        k = e["k"].reshape(B, -1, H, d // H).transpose(1, 2)
        n = min(Tq, QUERIES)
        idx = torch.arange(n) * Tq // n  # the documented sample: evenly spaced queries
        logits = q[:, :, idx] @ k.transpose(-1, -2) / math.sqrt(d // H)
        mask = e["mask"]
        allowed = torch.ones_like(logits, dtype=torch.bool) if mask is None else \
            (mask[..., idx, :] if mask.shape[-2] == Tq else mask).expand(logits.shape)
        if k.shape[2] == Tq:  # self-attention: a padded position (its own key masked) is no query
            allowed = allowed & allowed[:, :, torch.arange(n), idx].unsqueeze(-1)
            allowed = allowed.expand(logits.shape)
        top, entropy = _stats_of_queries(logits, allowed)
        torch.testing.assert_close(_head_values(frame, "attn_logit_max", name), top, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(_head_values(frame, "attn_entropy", name), entropy, rtol=1e-5, atol=1e-6)
        layer = _rows(frame, "attn_logit_max")
        assert layer[(layer.site == name) & layer.layer_j.isna()].value.item() == pytest.approx(top.max().item(), rel=1e-5)


def test_output_log_z_sublayer_rms_and_grad_rms_over_eps_equal_direct_computations():
    torch.manual_seed(0)
    config = tiny("post_ln", "decoder", dropout=0.0)
    model = gradscope.build_model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    inputs = batch(config)
    branches = {}
    handles = [m.register_forward_hook(lambda mod, a, out, n=n: branches.__setitem__(n, out.detach()))
               for n, m in model.named_modules() if n.endswith(".branch")]
    rec = gradscope.Recorder(model, quantities=["output_logit_log_z", "output_logit_log_z_max", "sublayer_out_rms",
                                                "grad_rms_over_eps", "param_grad_norm"], optimizer=opt)
    with rec.step(0):
        logits = model(*inputs)
        logits.square().mean().backward()
    frame = rec.frame()
    rec.close()
    for h in handles:
        h.remove()
    log_z = torch.logsumexp(logits.detach().double(), dim=-1)
    assert _rows(frame, "output_logit_log_z").value.item() == pytest.approx(log_z.mean().item(), rel=1e-5)
    assert _rows(frame, "output_logit_log_z_max").value.item() == pytest.approx(log_z.max().item(), rel=1e-5)
    rms = _rows(frame, "sublayer_out_rms").set_index("site").value
    assert set(rms.index) == set(branches) and len(branches) == 2 * config.n_dec
    for name, out in branches.items():
        assert rms[name] == pytest.approx(out.double().square().mean().sqrt().item(), rel=1e-5)
    assert (_rows(frame, "sublayer_out_rms").role == "branch").all()
    grads = [p.grad.double() for p in model.parameters()]
    total = math.sqrt(sum(g.square().sum().item() for g in grads) / sum(g.numel() for g in grads)) / 1e-6
    ratio = _rows(frame, "grad_rms_over_eps").set_index("site").value
    assert ratio[""] == pytest.approx(total, rel=1e-5)
    layer = "decoder.layers.1"
    params = [p for n, p in model.named_parameters() if n.startswith(f"{layer}.")]
    expected = math.sqrt(sum(p.grad.double().square().sum().item() for p in params) / sum(p.numel() for p in params)) / 1e-6
    assert ratio[layer] == pytest.approx(expected, rel=1e-5)


def test_grad_rms_over_eps_without_an_optimizer_warns_and_gives_no_rows():
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    rec = gradscope.Recorder(model, quantities=["grad_rms_over_eps", "loss"])
    with pytest.warns(UserWarning, match="needs the optimizer"):
        with rec.step(0):
            model(*batch(model.config)).sum().backward()
    assert _rows(rec.frame(), "grad_rms_over_eps").empty
    rec.close()


def _hf_attention_reference(model, ids, attention_cls_attr):
    """(q, k) per attention module from hooks on q_proj/k_proj (Llama) or c_attn (GPT-2)."""
    caught = {}
    handles = []
    for name, m in model.named_modules():
        if type(m).__name__.endswith("Attention"):
            entry = caught.setdefault(name, {})
            if attention_cls_attr == "llama":
                handles.append(m.q_proj.register_forward_hook(lambda mod, a, out, e=entry: e.update(q=out.detach())))
                handles.append(m.k_proj.register_forward_hook(lambda mod, a, out, e=entry: e.update(k=out.detach())))
            else:
                handles.append(m.c_attn.register_forward_hook(lambda mod, a, out, e=entry: e.update(qkv=out.detach())))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    for h in handles:
        h.remove()
    return caught, out


def test_hf_llama_attention_signals_equal_its_rotated_q_k_and_its_own_attention_weights():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 11))
    rec = gradscope.Recorder(model, quantities=["attn_logit_max", "attn_entropy", "output_logit_log_z"])
    with rec.step(0):
        out = model(ids)
        out.logits.float().logsumexp(-1).mean().backward()
    frame = rec.frame()
    rec.close()
    caught, ref_out = _hf_attention_reference(reference, ids, "llama")
    cos, sin = reference.model.rotary_emb(torch.zeros(1), torch.arange(11).unsqueeze(0))
    for i, (name, e) in enumerate(sorted(caught.items())):
        q = e["q"].view(2, 11, 4, 8).transpose(1, 2)
        k = e["k"].view(2, 11, 2, 8).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(2, dim=1)
        logits = q @ k.transpose(-1, -2) / math.sqrt(8)
        allowed = torch.ones(11, 11, dtype=torch.bool).tril().expand(logits.shape)
        top, _ = _stats(logits, allowed)
        torch.testing.assert_close(_head_values(frame, "attn_logit_max", name), top, rtol=1e-5, atol=1e-6)
        probs = ref_out.attentions[i].double()  # HF's own softmax weights (B, H, T, T)
        entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1).mean(dim=(0, 2))
        torch.testing.assert_close(_head_values(frame, "attn_entropy", name), entropy, rtol=1e-4, atol=1e-6)
    log_z = ref_out.logits.double().logsumexp(-1).mean().item()
    assert _rows(frame, "output_logit_log_z").value.item() == pytest.approx(log_z, rel=1e-5)


def test_hf_gpt2_attention_signals_equal_its_fused_q_k_and_its_own_attention_weights():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg)
    model.eval()  # no dropout: the reference forward must see the same numbers
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 9))
    rec = gradscope.Recorder(model, quantities=["attn_logit_max", "attn_entropy"])
    with rec.step(0):
        model(ids).logits.sum().backward()
    frame = rec.frame()
    rec.close()
    caught, ref_out = _hf_attention_reference(reference, ids, "gpt2")
    assert len(caught) == 2
    for i, (name, e) in enumerate(sorted(caught.items())):
        q, k, _ = e["qkv"].split(32, dim=-1)
        q, k = (t.view(2, 9, 4, 8).transpose(1, 2) for t in (q, k))
        logits = q @ k.transpose(-1, -2) / math.sqrt(8)
        top, _ = _stats(logits, torch.ones(9, 9, dtype=torch.bool).tril().expand(logits.shape))
        torch.testing.assert_close(_head_values(frame, "attn_logit_max", name), top, rtol=1e-5, atol=1e-6)
        probs = ref_out.attentions[i].double()
        entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1).mean(dim=(0, 2))
        torch.testing.assert_close(_head_values(frame, "attn_entropy", name), entropy, rtol=1e-4, atol=1e-6)


def test_unrecognised_attention_warns_and_recording_changes_nothing():
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                        enable_nested_tensor=False)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    rec = gradscope.Recorder(model, quantities=["attn_logit_max", "sublayer_out_rms", "loss"])
    with pytest.warns(UserWarning, match="no attention module recognised"):
        with rec.step(0):
            model(x).sum().backward()
    twin(x).sum().backward()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), n
    frame = rec.frame()
    rec.close()
    assert _rows(frame, "attn_logit_max").empty
    assert not _rows(frame, "sublayer_out_rms").empty  # nn.MultiheadAttention's output: a sub-layer holding modules


def test_signals_quantity_preset_and_unknown_names():
    model = gradscope.build_model(tiny("pre_ln", "decoder"))
    rec = gradscope.Recorder(model, quantities="signals")
    assert {"attn_logit_max", "grad_rms_over_eps", "act_grad_norm"} <= set(rec.quantities)
    rec.close()
    with pytest.raises(ValueError, match="'signals'"):
        gradscope.Recorder(model, quantities="signal")


def test_z_loss_adds_its_term_to_the_gradient_and_keeps_the_logged_loss_the_cross_entropy():
    from gradscope.train import TrainConfig, train
    from gradscope.train.optim import z_loss
    from gradscope.train.tasks import make_task

    logits = torch.randn(2, 5, 11, requires_grad=True)
    target = torch.randint(1, 11, (2, 5))
    target[0, -1] = 0  # a pad
    expected = torch.logsumexp(logits, -1).square()[target != 0].mean()
    assert z_loss(logits, target, pad_id=0).item() == pytest.approx(expected.item(), rel=1e-6)

    config = tiny("pre_ln", "decoder", dropout=0.0)
    runs = {}
    for coef in (0.0, 1e-2):
        torch.manual_seed(0)
        model = gradscope.build_model(config)
        tc = TrainConfig(steps=3, batch_size=4, eval_every=0, device="cpu", z_loss=coef)
        runs[coef] = (train(model, make_task("markov_lm", vocab=config.vocab, max_len=config.max_len), tc, progress=False), model)
    (plain, m0), (with_z, m1) = runs[0.0], runs[1e-2]
    first = lambda r: r.history.query("quantity == 'loss'").sort_values("step").value.iloc[0]  # noqa: E731
    assert first(plain) == pytest.approx(first(with_z), rel=1e-6)  # step 1: same weights, same cross entropy
    assert any(not torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))  # the z term trained


class _NanoAttention(torch.nn.Module):
    """nanoGPT's CausalSelfAttention, written here: one c_attn Linear to 3d, n_head heads."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        return self.c_proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                           .transpose(1, 2).reshape(B, T, C))


def nano_attention_frame(model: torch.nn.Module, x: torch.Tensor):
    """The attention signals of one recorded step of ``model`` (nanoGPT-style blocks) on ``x``."""
    rec = gradscope.Recorder(model, quantities=["attn_logit_max", "attn_entropy"])
    with rec.step(0):
        model(x).sum().backward()
    rec.close()
    return rec.frame()


def test_nanogpt_style_attention_logits_equal_a_recomputation_from_its_c_attn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_NanoAttention(16, 2), _NanoAttention(16, 2))
    reference = copy.deepcopy(model)
    x = torch.randn(3, 7, 16)
    frame = nano_attention_frame(model, x)
    h = x
    for i, m in enumerate(reference):
        q, k, _ = m.c_attn(h).detach().split(16, dim=-1)
        q, k = (t.view(3, 7, 2, 8).transpose(1, 2) for t in (q, k))
        top, entropy = _stats(q @ k.transpose(-1, -2) / math.sqrt(8), torch.ones(7, 7, dtype=torch.bool).tril().expand(3, 2, 7, 7))
        torch.testing.assert_close(_head_values(frame, "attn_logit_max", str(i)), top, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(_head_values(frame, "attn_entropy", str(i)), entropy, rtol=1e-5, atol=1e-6)
        h = m(h)


class _LossFirst(torch.nn.Module):
    """A model whose output puts the 0-d loss first, as HF's ``return_dict=False`` with labels
    does, or returns only the loss (nanoGPT-style)."""

    def __init__(self, only_loss: bool) -> None:
        super().__init__()
        self.only_loss = only_loss
        self.embed = torch.nn.Embedding(11, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, ids, targets):
        logits = self.head(self.norm(self.embed(ids)))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss if self.only_loss else (loss, logits)


@pytest.mark.parametrize("only_loss", [False, True])
def test_output_log_z_of_a_model_whose_loss_comes_first(only_loss):
    torch.manual_seed(0)
    model, ids = _LossFirst(only_loss), torch.randint(0, 11, (2, 5))
    rec = gradscope.Recorder(model, quantities=["output_logit_log_z", "act_grad_norm"])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with rec.step(0):
            out = model(ids, ids)
            (out if only_loss else out[0]).backward()
    rec.close()
    rows = _rows(rec.frame(), "output_logit_log_z")
    if only_loss:
        assert rows.empty
        assert any("held no logits" in str(w.message) for w in said)
    else:
        want = torch.logsumexp(out[1].detach().double(), -1).mean().item()
        assert rows.value.tolist() == pytest.approx([want], rel=1e-6)


def test_sublayer_rms_says_which_branches_it_cannot_measure():
    """nn.TransformerEncoderLayer's feed-forward is two bare Linear children: no sub-layer
    module to read, so no row, and a warning names them (it was silent)."""
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                        enable_nested_tensor=False)
    rec = gradscope.Recorder(model, quantities=["sublayer_out_rms"])
    with pytest.warns(UserWarning, match=r"layers.0: \['linear1', 'linear2'\] hold parameters outside the sub-layers"):
        with rec.step(0):
            model(torch.randn(2, 5, 16)).sum().backward()
        frame = rec.frame()
    rec.close()
    assert sorted(frame.site.unique()) == ["layers.0.self_attn", "layers.1.self_attn"]


@pytest.mark.parametrize("d_ff", [32, 16])
def test_sublayer_rms_has_no_rows_for_what_is_no_residual_branch(d_ff):
    """BERT adds the residual and normalises inside `attention` and `output`, and
    `intermediate` is the feed-forward's hidden activation: none is a branch, so no row (their
    RMS read ≈ 1.000 or the activation's), and the warning says why; also when d_ff is the
    block's width (a review: `intermediate` then had a row)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                           num_attention_heads=2, intermediate_size=d_ff))
    rec = gradscope.Recorder(model, quantities=["sublayer_out_rms"])
    with pytest.warns(UserWarning) as said:
        with rec.step(0):
            model(torch.randint(0, 50, (2, 5))).last_hidden_state.sum().backward()
        frame = rec.frame()
    rec.close()
    assert frame[frame.quantity == "sublayer_out_rms"].empty
    text = " ".join(str(w.message) for w in said)
    assert "['attention', 'output'] hold a norm" in text and "['intermediate'] sit beside sub-layers" in text
