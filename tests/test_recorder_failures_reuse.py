"""Failure classes measured on the recorder with non-zoo models, part 2 (part 1:
tests/test_recorder_failures.py): in-place ops after a site, a module shared between blocks, a
norm called three times, hand-written norms' w/σ, parameter norms under autocast and T5's
padding mask. References are computed here (autograd, p.grad, closed forms), never pasted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradscope
from failure_helpers import B, D, Chain, MLPBlock, grad_norm_of, inputs, tap, values_by_site
from recorder_ref import assert_rel


class InplaceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)

    def forward(self, x):
        o = self.ln(x + self.fc(x))
        o.mul_(0.5)
        return o


def inplace_model():
    return Chain([InplaceBlock(), InplaceBlock()])


def test_inplace_op_after_a_site():
    torch.manual_seed(0)
    model, x = inplace_model(), inputs()
    run = lambda: model(x).pow(2).mean()  # noqa: E731
    with gradscope.record(model) as rec:
        run().backward()
    df = rec.frame()
    # reference: the ln output is captured and a clone passed on, so mul_ leaves the captured
    # (pre-mul) tensor alone; the block output is captured after the mul.
    taps = {}
    for i in range(2):
        taps[f"blocks.{i}.ln.out"] = (model.blocks[i].ln, "out_clone")
        taps[f"blocks.{i}.ln.in"] = (model.blocks[i].ln, "in_iso")
        taps[f"blocks.{i}.out"] = (model.blocks[i], "out")
    ref, act, _ = tap(run, taps)
    for i in range(2):  # the reference itself tells the two sites apart
        assert_rel(act[f"blocks.{i}.ln.out"], 2 * act[f"blocks.{i}.out"], what="reference act")
        assert_rel(ref[f"blocks.{i}.out"], 2 * ref[f"blocks.{i}.ln.out"], what="reference grad")
    got, got_act, gain = values_by_site(df, "act_grad_norm"), values_by_site(df, "act_norm"), values_by_site(df, "ln_gain")
    for i in range(2):
        for site in (f"blocks.{i}.ln.out", f"blocks.{i}.out"):
            assert_rel(got_act[site], act[site], what=f"act_norm {site}")
            assert_rel(got[site], ref[site], what=f"act_grad_norm {site}")
        expected_gain = ref[f"blocks.{i}.ln.in"] / ref[f"blocks.{i}.ln.out"]
        assert_rel(gain[f"blocks.{i}.ln"], expected_gain, what=f"ln_gain blocks.{i}.ln")


# -- 8a. a module shared by two blocks --------------------------------------------------------------
class SharedBlock(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.own(x) + self.shared(x))


class SharedModel(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(D, D)
        self.blocks = nn.ModuleList([SharedBlock(shared), SharedBlock(shared)])

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def test_shared_module_counts_in_each_block_and_once_in_total():
    torch.manual_seed(0)
    model, x = SharedModel(), inputs()
    with gradscope.record(model) as rec:
        model(x).pow(3).mean().backward()
    pg = values_by_site(rec.frame(), "param_grad_norm")
    assert model.blocks[0].shared is model.blocks[1].shared
    for i in range(2):
        assert_rel(pg[f"blocks.{i}"], grad_norm_of(model.blocks[i].parameters()), what=f"blocks.{i}")
    assert_rel(pg[""], grad_norm_of(model.parameters()), what="total")  # parameters() yields the shared ones once


# -- 8b. a norm called three times per forward ----------------------------------------------------
class ThriceNormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.3)
            self.norm.bias.normal_(0.0, 0.1)

    def forward(self, x):
        a = self.norm(self.fc1(x))
        b = self.norm(self.fc2(a))
        return self.norm(self.fc3(b) + 2 * a)


def test_norm_called_three_times_has_a_site_per_call():
    torch.manual_seed(0)
    model, x = ThriceNormModel(), inputs()
    run = lambda: model(x).pow(3).mean()  # noqa: E731
    with gradscope.record(model) as rec:
        run().backward()
    df = rec.frame()
    ref_out, act_out, _ = tap(run, {"norm.out": (model.norm, "out")})
    ref_in, _, _ = tap(run, {"norm.in": (model.norm, "in_iso")})
    assert sorted(ref_out) == ["norm.out", "norm.out#2", "norm.out#3"]
    got, got_act = values_by_site(df, "act_grad_norm"), values_by_site(df, "act_norm")
    for site in ref_out:
        assert site in got, f"no row for {site}; sites: {sorted(set(df.site))}"
        assert_rel(got[site], ref_out[site], what=site)
        assert_rel(got_act[site], act_out[site], what=f"act_norm {site}")
    for site in ref_in:
        assert_rel(got[site], ref_in[site], what=f"{site} (through the norm alone)")


# -- 9. ln_w_over_sigma for common hand-written norm classes -------------------------------------------
class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        return (output * (1.0 + self.weight.float())).type_as(x)


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


NORM_CLASSES = {  # name -> (build, sigma kind, eps, effective gain from weight)
    "nanogpt": (lambda: LayerNorm(D, bias=True), "var", 1e-5, lambda w: w),
    "nanogpt_nobias": (lambda: LayerNorm(D, bias=False), "var", 1e-5, lambda w: w),
    "llama": (lambda: LlamaRMSNorm(D), "rms", 1e-6, lambda w: w),
    "gemma": (lambda: GemmaRMSNorm(D), "rms", 1e-6, lambda w: 1 + w),
    "t5": (lambda: T5LayerNorm(D), "rms", 1e-6, lambda w: w),
}


class NormModel(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.norm = norm
        self.head = nn.Linear(D, D)

    def forward(self, x):
        return self.head(self.norm(self.inp(x) + 1.0))  # non-zero token means: variance != mean square


@pytest.mark.parametrize("kind", sorted(NORM_CLASSES))
def test_ln_w_over_sigma_for_hand_written_norms(kind):
    torch.manual_seed(0)
    build, sigma_kind, eps, gain_of = NORM_CLASSES[kind]
    model = NormModel(build())
    with torch.no_grad():
        model.norm.weight.add_(0.3 * torch.randn(D))  # a gain that is neither all ones nor all zeros
    x = inputs()
    with gradscope.record(model, quantities="all") as rec:
        model(x).pow(2).mean().backward()
    _, _, seen = tap(lambda: model(x).pow(2).mean(), {"norm.in": (model.norm, "in")})
    h = seen["norm.in"].double()
    if sigma_kind == "var":
        sigma = torch.sqrt(h.var(dim=-1, unbiased=False) + eps)
    else:
        sigma = torch.sqrt(h.pow(2).mean(dim=-1) + eps)
    g = gain_of(model.norm.weight.detach().double())
    expected = (g / sigma[..., None]).mean().item()  # mean over tokens and features of g_f / σ_t
    got = values_by_site(rec.frame(), "ln_w_over_sigma")
    assert "norm" in got, f"no ln_w_over_sigma for {type(model.norm).__name__}"
    assert_rel(got["norm"], expected, rel=1e-5, what=f"ln_w_over_sigma {kind}")


# -- 10. leaving the step inside autocast -------------------------------------------------------------
def blocks_model(depth=2):
    return Chain([MLPBlock() for _ in range(depth)])


def test_param_grad_norm_in_fp32_when_the_step_closes_under_autocast():
    torch.manual_seed(0)
    model, x = blocks_model(), inputs()
    rec = gradscope.Recorder(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with rec.step(0):
            loss = model(x).float().pow(2).mean()
            loss.backward()
    rec.close()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    pg = values_by_site(rec.frame(), "param_grad_norm")
    assert_rel(pg[""], grad_norm_of(model.parameters()), rel=1e-6, what="total")
    for i in range(2):
        assert_rel(pg[f"blocks.{i}"], grad_norm_of(model.blocks[i].parameters()), rel=1e-6, what=f"blocks.{i}")


# -- 11. encoder padding mask must not weight the decoder's cosine ------------------------------------
def test_t5_encoder_padding_mask_does_not_weight_decoder_cosine():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=48, d_kv=16, num_heads=2,
                                vocab_size=60, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    n_tok = 8  # encoder and decoder lengths equal: a (B, T) encoder mask has the decoder's token count
    ids = torch.randint(1, 60, (B, n_tok), generator=g)
    labels = torch.randint(1, 60, (B, n_tok), generator=g)
    mask = torch.zeros(B, n_tok, dtype=torch.long)
    mask[0, :3] = 1
    mask[1, :1] = 1
    run = lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss  # noqa: E731
    # cosine_tokens far above the 16 decoder tokens: every decoder token is in the sample
    with gradscope.record(model, quantities="all", options=gradscope.RecorderOptions(cosine_tokens=4096)) as rec:
        run().backward()
    df = rec.frame()
    blocks = model.decoder.block
    _, _, seen = tap(run, {"y0": (blocks[0], "in"), **{f"y{i + 1}": (blocks[i], "out") for i in range(len(blocks))}})
    ys = [F.normalize(seen[f"y{i}"].double().reshape(-1, cfg.d_model), dim=-1) for i in range(len(blocks) + 1)]
    expected = torch.stack([torch.stack([(a * b).sum(-1).mean() for b in ys]) for a in ys])  # all decoder tokens
    cos = df[(df.quantity == "cosine") & (df["stack"] == "decoder.block") & (df.micro_step == -1)]
    assert len(cos) == (len(blocks) + 1) ** 2, f"decoder cosine rows: {len(cos)}"
    worst = max(abs(r.value - expected[int(r.layer), int(r.layer_j)].item()) for r in cos.itertuples())
    assert worst < 1e-2, f"decoder cosine differs from the all-token reference by {worst}"
