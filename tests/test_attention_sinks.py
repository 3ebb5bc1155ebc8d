"""``attn_sink_mass`` and ``attn_softcap_saturation`` on models nobody here wrote (HF GPT-2,
Llama and Gemma 2 from their configs, a nanoGPT-style model written here), eager and
``torch.compile``d, each against a reference computed in the test: the sink mass from the
model's own attention weights (HF's ``output_attentions=True`` on its eager kernel; the
nanoGPT model's own softmax), the saturation from Gemma 2's logits recomputed from the q and k
its projections made, rotated by HF's own ``apply_rotary_pos_emb``."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import gradscope
from gradscope.recorder.capture.attention_signals import SOFTCAP_SATURATED
from gradscope.recorder.quantities.registry import QUANTITY_SETS

transformers = pytest.importorskip("transformers")

B, T, VOCAB = 2, 11, 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=32, attn_implementation="eager")
CAP = 2.0  # Gemma 2's attention soft cap here (its q and k scaled ×30 so that some logits pass 1.83·CAP)


class _NanoBlock(nn.Module):
    """nanoGPT's Block (karpathy/nanoGPT model.py), its attention the manual path, keeping its softmax."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _NanoAttention(d, n_head)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _NanoAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = nn.Linear(d, 3 * d), nn.Linear(d, d), n_head
        self.is_causal = True
        self.last_att: torch.Tensor | None = None

    def forward(self, x):
        Bx, Tx, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(Bx, Tx, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.ones(Tx, Tx, dtype=torch.bool).tril().logical_not(), float("-inf")).softmax(-1)
        if not torch.compiler.is_compiling():
            self.last_att = att.detach()
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(Bx, Tx, C))


class _NanoGPT(nn.Module):
    def __init__(self, d: int = 32, n_head: int = 4, n_layer: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(T, d)
        self.h = nn.ModuleList(_NanoBlock(d, n_head) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _model(kind: str) -> nn.Module:
    """The model in eval mode: GPT-2's attention dropout would make its returned weights another draw."""
    return _built(kind).eval()


def _built(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32,
                                                                    n_layer=2, n_head=4, attn_implementation="eager"))
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    if kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, attn_logit_softcapping=CAP))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(30.0)
        return model
    return _NanoGPT()


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _own_weights(kind: str, model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each attention's own softmax weights (B, H, T, S) in a plain eager forward."""
    with torch.no_grad():
        if kind == "nano":
            model(ids)
            return [block.attn.last_att for block in model.h]
        return list(model(ids, output_attentions=True).attentions)


def _heads(frame, quantity: str, site: str) -> torch.Tensor:
    rows = frame[(frame.quantity == quantity) & (frame.site == site) & frame.layer_j.notna()].sort_values("layer_j")
    return torch.tensor(rows.value.to_numpy(), dtype=torch.float64)


def _layer(frame, quantity: str, site: str) -> float:
    return frame[(frame.quantity == quantity) & (frame.site == site) & frame.layer_j.isna()].value.item()


def _record(model: nn.Module, ids: torch.Tensor, compiled: bool):
    rec = gradscope.Recorder(model, quantities=["attn_sink_mass", "attn_softcap_saturation", "attn_entropy"])
    run = torch.compile(model, fullgraph=True) if compiled else model
    with rec.step(0):
        _logits(run(ids)).float().logsumexp(-1).mean().backward()
    frame = rec.frame()
    rec.close()
    return frame


# compiled: GPT-2 (the fused c_attn path) and Gemma 2 (rotary, grouped-query heads, soft cap); each compile takes
# ~20 s of one core here, so Llama and the nanoGPT model, read by the same code as Gemma 2 and GPT-2, run eager only
CASES = [("gpt2", False), ("gpt2", True), ("llama", False), ("gemma2", False), ("gemma2", True), ("nano", False)]


@pytest.mark.parametrize("kind,compiled", CASES)
def test_sink_mass_and_softcap_saturation_equal_references_from_the_models_own_attention(kind, compiled):
    model = _model(kind)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    frame = _record(model, ids, compiled)
    weights = _own_weights(kind, reference, ids)
    sites = [n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    assert len(sites) == len(weights) == 2
    for site, probs in zip(sites, weights):
        sink = probs.double()[..., 0].mean(dim=(0, 2))  # (H,): mean over batch and queries of p(key 0)
        torch.testing.assert_close(_heads(frame, "attn_sink_mass", site), sink, rtol=1e-4, atol=1e-6)
        assert _layer(frame, "attn_sink_mass", site) == pytest.approx(sink.mean().item(), rel=1e-4)
    if kind == "gemma2":
        _check_saturation(frame, reference, ids)
    else:  # no soft cap: no saturation rows (and no error)
        assert frame[frame.quantity == "attn_softcap_saturation"].empty


def _gemma2_logits(model: nn.Module, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, Gemma 2's raw logits q·k·scale (B, H, T, T) from the q and k its projections
    made, rotated by HF's own apply_rotary_pos_emb; and its own attention weights."""
    from transformers.models.gemma2.modeling_gemma2 import apply_rotary_pos_emb

    caught: list[dict] = [{} for _ in model.model.layers]
    handles = []
    for e, layer in zip(caught, model.model.layers):
        handles.append(layer.self_attn.q_proj.register_forward_hook(lambda m, a, out, e=e: e.update(q=out.detach())))
        handles.append(layer.self_attn.k_proj.register_forward_hook(lambda m, a, out, e=e: e.update(k=out.detach())))
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions
    for h in handles:
        h.remove()
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(T).unsqueeze(0))
    scale = model.config.query_pre_attn_scalar ** -0.5
    logits = []
    for e in caught:
        q = e["q"].view(B, T, 4, 8).transpose(1, 2)
        k = e["k"].view(B, T, 2, 8).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        logits.append(q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2) * scale)
    return logits, list(weights)


def _check_saturation(frame, reference: nn.Module, ids: torch.Tensor) -> None:
    """attn_softcap_saturation against the share of Gemma 2's logits z with |tanh(z/CAP)| past the threshold."""
    logits, weights = _gemma2_logits(reference, ids)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i, (z, probs) in enumerate(zip(logits, weights)):
        capped = (CAP * torch.tanh(z / CAP)).masked_fill(~causal, -math.inf)
        torch.testing.assert_close(capped.softmax(-1), probs.double(), rtol=1e-4, atol=1e-6)  # (the reference is right)
        saturated = (torch.tanh(z / CAP).abs() > SOFTCAP_SATURATED) & causal
        share = saturated.sum(dim=(0, 2, 3)).double() / (B * causal.sum())  # (H,)
        assert 0.02 < share.mean() < 0.98, share  # (the case tests something: some logits saturate, some not)
        site = f"model.layers.{i}.self_attn"
        torch.testing.assert_close(_heads(frame, "attn_softcap_saturation", site), share, rtol=1e-6, atol=0)
        assert _layer(frame, "attn_softcap_saturation", site) == pytest.approx(share.mean().item(), rel=1e-6)


def test_both_are_in_the_signals_preset_only():
    assert {"attn_sink_mass", "attn_softcap_saturation"} <= set(QUANTITY_SETS["signals"])
    assert not {"attn_sink_mass", "attn_softcap_saturation"} & set(QUANTITY_SETS["default"] + QUANTITY_SETS["all"])
