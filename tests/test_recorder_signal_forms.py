"""Attention signals of the forms a new-user review found read wrongly (each against the
model's own attention weights, or q and k recomputed here): a q/k norm applied after the
heads' transpose (Gemma 3: it crashed the user's forward, or read heads as tokens when T
equals the head count), a soft cap on the logits (Gemma 2), an interleaved rotary form
(Cohere), a rotary embedding applied inside a hand-written forward, a fused ``c_attn`` that
says it is not causal; and ``sublayer_out_rms`` beside q/k norms (Qwen 3) and BERT's
``intermediate`` as wide as the block."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import gradscope
from test_recorder_signals import _head_values, _NanoAttention, _rows, _stats, nano_attention_frame

transformers = pytest.importorskip("transformers")


def _entropy_of(probs: torch.Tensor) -> torch.Tensor:
    """Mean over batch and queries of the entropy of HF's own softmax weights (B, H, T, S), per head."""
    probs = probs.double()
    return -(probs * probs.clamp_min(1e-300).log()).sum(-1).mean(dim=(0, 2))


def _record(model, ids, quantities):
    rec = gradscope.Recorder(model, quantities=quantities)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with rec.step(0):
            model(ids).logits.float().logsumexp(-1).mean().backward()
        frame = rec.frame()
    rec.close()
    return frame, [str(w.message) for w in said]


def _gemma(kind: str, **extra):
    small = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, attn_implementation="eager", **extra)
    if kind == "gemma3":
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**small))
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**small))


@pytest.mark.parametrize("kind, T", [("gemma3", 12), ("gemma3", 4), ("gemma2", 12), ("qwen3", 4)])
def test_attention_entropy_equals_the_models_own_weights(kind, T):
    """Gemma 3 normalises q and k after the transpose to (B, H, T, dh); with T = 4 = the head
    count only the layout of the norm's input tells heads from tokens. Gemma 2 soft-caps its
    logits at 5 here (q scaled ×20, so the cap bites). Qwen 3 normalises before the transpose."""
    torch.manual_seed(0)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, attn_implementation="eager"))
    else:
        model = _gemma(kind, **({"attn_logit_softcapping": 5.0} if kind == "gemma2" else {}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("q_proj.weight") or kind == "gemma2" and name.endswith("k_proj.weight"):
                p.mul_(20.0)  # (Gemma 2 scales q·k by 1/16 here: its cap bites with k scaled too)
    ids = torch.randint(0, 50, (2, T))
    frame, said = _record(model, ids, ["attn_entropy", "attn_logit_max"])
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions
    names = [n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    assert len(names) == len(weights) == 2 and not [s for s in said if "attention" in s], said
    for name, probs in zip(names, weights):
        torch.testing.assert_close(_head_values(frame, "attn_entropy", name), _entropy_of(probs), rtol=1e-4, atol=1e-6)


def test_gemma2_max_logit_is_before_the_soft_cap():
    """The max logit is q·k·scale before the cap (docs/signals.md): above the cap here."""
    torch.manual_seed(0)
    model = _gemma("gemma2", attn_logit_softcapping=5.0)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(50.0)
        model.model.layers[0].self_attn.k_proj.weight.mul_(50.0)
    frame, _ = _record(model, torch.randint(0, 50, (2, 6)), ["attn_logit_max"])
    assert _head_values(frame, "attn_logit_max", "model.layers.0.self_attn").max() > 5.0


@pytest.mark.parametrize("kind", ["cohere", "helium"])
def test_an_interleaved_rotary_form_has_no_rows_and_says_why(kind):
    torch.manual_seed(0)
    small = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config = transformers.CohereConfig(**small) if kind == "cohere" else transformers.HeliumConfig(**small, head_dim=8)
    model = transformers.AutoModelForCausalLM.from_config(config)
    frame, said = _record(model, torch.randint(0, 50, (2, 6)), ["attn_entropy", "attn_logit_max"])
    assert _rows(frame, "attn_entropy").empty and _rows(frame, "attn_logit_max").empty
    assert any("another form than HF Llama's rotate_half" in s for s in said), said


class _RotaryInside(torch.nn.Module):
    """A hand-written causal attention with q_proj/k_proj that rotates q and k itself (RoPE)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(d, d) for _ in range(3))
        self.n_heads, self.is_causal = heads, True
        inv = 1.0 / 10000 ** (torch.arange(0, d // heads, 2).float() / (d // heads))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        angles = torch.arange(T).float()[:, None] * self.inv_freq  # (T, dh/2)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

        def rotate(t):
            a, b = t.chunk(2, -1)
            return t * cos + torch.cat((-b, a), -1) * sin
        q, k = rotate(q), rotate(k)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)


def test_a_rotary_embedding_inside_a_hand_written_forward_has_no_rows_and_says_why():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_RotaryInside(), _RotaryInside())
    rec = gradscope.Recorder(model, quantities=["attn_entropy"])
    with pytest.warns(UserWarning, match="applies a rotary embedding of its own"):
        with rec.step(0):
            model(torch.randn(2, 5, 16)).sum().backward()
    assert _rows(rec.frame(), "attn_entropy").empty
    rec.close()


def test_a_fused_c_attn_that_says_it_is_not_causal_is_read_bidirectionally():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_NanoAttention(16, 2), _NanoAttention(16, 2))
    for m in model:
        m.is_causal = False  # (its forward still attends causally: only what it says is read)
    x = torch.randn(3, 7, 16)
    frame = nano_attention_frame(model, x)
    q, k, _ = model[0].c_attn(x).detach().split(16, dim=-1)
    q, k = (t.view(3, 7, 2, 8).transpose(1, 2) for t in (q, k))
    top, entropy = _stats(q @ k.transpose(-1, -2) / math.sqrt(8), torch.ones(3, 2, 7, 7, dtype=torch.bool))
    torch.testing.assert_close(_head_values(frame, "attn_logit_max", "0"), top, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_head_values(frame, "attn_entropy", "0"), entropy, rtol=1e-5, atol=1e-6)


def test_sublayer_rms_of_an_attention_with_q_and_k_norms_is_its_branch():
    """Qwen 3's self_attn holds q_norm and k_norm: its output is still the residual branch
    (it had no row, with a warning that called it a Post-LN block)."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8))
    outs = {}
    handles = [model.model.layers[i].self_attn.register_forward_hook(
        lambda m, a, out, i=i: outs.__setitem__(i, out[0].detach().double())) for i in range(2)]
    frame, said = _record(model, torch.randint(0, 50, (2, 6)), ["sublayer_out_rms"])
    for h in handles:
        h.remove()
    assert not [s for s in said if "hold a norm" in s], said
    rows = _rows(frame, "sublayer_out_rms").set_index("site").value
    for i in range(2):
        assert rows[f"model.layers.{i}.self_attn"] == pytest.approx(outs[i].square().mean().sqrt().item(), rel=1e-5)


@pytest.mark.parametrize("kind", ["stablelm", "sandwich"])
def test_sublayer_rms_keeps_branches_of_blocks_with_norms_of_their_own(kind):
    """A block with norms of its own adds its residuals itself: norms inside its children (StableLM's
    per-head q/k LayerNorms, a sandwich norm ending an mlp) do not make them Post-LN sub-layers (a
    review: the rule for BERT dropped these rows)."""
    torch.manual_seed(0)
    if kind == "stablelm":
        model = transformers.StableLmForCausalLM(transformers.StableLmConfig(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, qk_layernorm=True))
        layers, names = model.model.layers, ("self_attn", "mlp")
        run = lambda: model(torch.randint(0, 50, (2, 6))).logits.float().logsumexp(-1).mean()  # noqa: E731
    else:
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.ln1, self.ln2 = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
                self.attn = _NanoAttention(16, 2)
                self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16),
                                               torch.nn.LayerNorm(16))  # (a sandwich norm ending the branch)

            def forward(self, x):
                x = x + self.attn(self.ln1(x))
                return x + self.mlp(self.ln2(x))
        model = torch.nn.Sequential(Block(), Block())
        layers, names = model, ("attn", "mlp")
        run = lambda: model(torch.randn(2, 5, 16)).square().mean()  # noqa: E731
    outs = {}
    handles = [getattr(layer, n).register_forward_hook(
        lambda m, a, out, key=(i, n): outs.__setitem__(key, (out[0] if isinstance(out, tuple) else out).detach().double()))
        for i, layer in enumerate(layers) for n in names]
    rec = gradscope.Recorder(model, quantities=["sublayer_out_rms"])
    with rec.step(0):
        run().backward()
    rec.close()
    for h in handles:
        h.remove()
    rows = _rows(rec.frame(), "sublayer_out_rms").set_index("site").value
    prefix = "model.layers." if kind == "stablelm" else ""
    for (i, n), out in outs.items():
        assert rows[f"{prefix}{i}.{n}"] == pytest.approx(out.square().mean().sqrt().item(), rel=1e-5)


class _SaysNoRope(_NanoAttention):
    def forward(self, x):
        """Plain causal attention: no RoPE, no rotary embedding (the words are in a docstring only)."""
        return super().forward(x)  # rotary: none


def test_rotary_words_in_a_docstring_or_comment_are_no_rotary():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_SaysNoRope(16, 2), _SaysNoRope(16, 2))
    rec = gradscope.Recorder(model, quantities=["attn_entropy"])
    with rec.step(0):
        model(torch.randn(2, 5, 16)).sum().backward()
    rec.close()
    assert len(_rows(rec.frame(), "attn_entropy")) == 2 * 3  # (2 heads and the layer's mean, per layer)
