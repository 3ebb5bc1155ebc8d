"""Zoo layers against PyTorch's reference layers and against each other (weights copied,
dropout 0); references are computed here, never pasted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradscope
from gradscope.models.sublayers import Context
from zoo_cases import batch, tiny

TOL = dict(rtol=1e-5, atol=1e-5)


def copy_attention(ours, ref: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        d = ours.q_proj.weight.shape[0]
        for i, proj in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
            proj.weight.copy_(ref.in_proj_weight[i * d : (i + 1) * d])
            proj.bias.copy_(ref.in_proj_bias[i * d : (i + 1) * d])
        ours.out_proj.load_state_dict(ref.out_proj.state_dict())


def randomise(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p.shape[0] == 16 else 0.0))


@pytest.mark.parametrize("variant,norm_first", [("post_ln", False), ("pre_ln", True)])
def test_encoder_layer_equals_torch(variant, norm_first):
    torch.manual_seed(0)
    config = tiny(variant, "encoder")
    layer = gradscope.build_model(config).encoder.layers[0]
    ref = nn.TransformerEncoderLayer(16, 2, 24, dropout=0.0, batch_first=True, norm_first=norm_first)
    randomise(ref)
    copy_attention(layer.self_attn.fn.attn, ref.self_attn)
    layer.ffn.fn.fc1.load_state_dict(ref.linear1.state_dict())
    layer.ffn.fn.fc2.load_state_dict(ref.linear2.state_dict())
    layer.self_attn.norm.inner.load_state_dict(ref.norm1.state_dict())
    layer.ffn.norm.inner.load_state_dict(ref.norm2.state_dict())
    x = torch.randn(3, 7, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[-1, -2:] = True
    ours = layer(x, Context(self_mask=~pad[:, None, None, :]))
    torch.testing.assert_close(ours, ref(x, src_key_padding_mask=pad), **TOL)


@pytest.mark.parametrize("variant,norm_first", [("post_ln", False), ("pre_ln", True)])
def test_decoder_layer_equals_torch(variant, norm_first):
    torch.manual_seed(0)
    config = tiny(variant, "encoder_decoder")
    layer = gradscope.build_model(config).decoder.layers[0]
    ref = nn.TransformerDecoderLayer(16, 2, 24, dropout=0.0, batch_first=True, norm_first=norm_first)
    randomise(ref)
    copy_attention(layer.self_attn.fn.attn, ref.self_attn)
    copy_attention(layer.cross_attn.fn.attn, ref.multihead_attn)
    layer.ffn.fn.fc1.load_state_dict(ref.linear1.state_dict())
    layer.ffn.fn.fc2.load_state_dict(ref.linear2.state_dict())
    for ours, theirs in ((layer.self_attn, ref.norm1), (layer.cross_attn, ref.norm2), (layer.ffn, ref.norm3)):
        ours.norm.inner.load_state_dict(theirs.state_dict())
    x, memory = torch.randn(3, 6, 16), torch.randn(3, 7, 16)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    expected = ref(x, memory, tgt_mask=nn.Transformer.generate_square_subsequent_mask(6))
    ours = layer(x, Context(self_mask=causal, memory=memory))
    torch.testing.assert_close(ours, expected, **TOL)


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder", "encoder"])
def test_dlcl_pre_with_plain_residual_weights_equals_pre_ln(arch):
    torch.manual_seed(0)
    pre = gradscope.build_model(tiny("pre_ln", arch))
    dlcl = gradscope.build_model(tiny("dlcl_pre", arch, dlcl_extra_ln=False))
    missing, unexpected = dlcl.load_state_dict(pre.state_dict(), strict=False)
    assert not unexpected and all(k.endswith("combine.weight") for k in missing)
    with torch.no_grad():
        for stack in dlcl.stacks().values():
            stack.combine.weight.copy_(torch.eye(stack.combine.weight.shape[0]))
    inputs = batch(pre.config)
    torch.testing.assert_close(dlcl(*inputs), pre(*inputs), rtol=1e-6, atol=1e-6)


def capture_sites(model, inputs):
    seen = {}
    handles = [
        m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, out.detach()))
        for name, m in model.named_modules()
        if isinstance(m, gradscope.Site)
    ]
    model(*inputs)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("arch", ["encoder_decoder", "decoder", "encoder"])
def test_b2t_last_sum_is_layer_input_plus_h_plus_ffn(arch):
    """Takase 2022 Eq. 5: the last residual sum is x + h + FFN(h), h the previous LN output."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("b2t", arch))
    sites = capture_sites(model, batch(model.config))
    for stack_name, stack in model.stacks().items():
        for i, layer in enumerate(stack.layers):
            p = f"{stack_name}.layers.{i}"
            h = sites[f"{p}.{layer.sublayer_names[-2]}.norm.out"]
            expected = sites[f"{p}.in"] + h + sites[f"{p}.ffn.branch"]
            torch.testing.assert_close(sites[f"{p}.ffn.sum"], expected, rtol=1e-6, atol=1e-6)
            ln2 = layer.ffn.norm.inner
            torch.testing.assert_close(sites[f"{p}.out"], ln2(expected), rtol=1e-5, atol=1e-5)


def test_b2t_noln_last_sum_uses_alpha_and_beta():
    """Takase App. D Eq. 6: y = α·x + β·(h + FFN(h)), h = x + SA(x)."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("b2t_noln", "encoder", n_enc=5))
    sites = capture_sites(model, batch(model.config))
    alpha, beta = min(5 / 12, 5**-0.15), 16**-0.2
    for i in range(5):
        p = f"encoder.layers.{i}"
        x, h = sites[f"{p}.in"], sites[f"{p}.self_attn.sum"]
        torch.testing.assert_close(h, x + sites[f"{p}.self_attn.branch"], rtol=1e-6, atol=1e-6)
        expected = alpha * x + beta * (h + sites[f"{p}.ffn.branch"])
        torch.testing.assert_close(sites[f"{p}.out"], expected, rtol=1e-6, atol=1e-6)


def test_transparent_attention_memory_is_softmax_weighted_encoder_outputs():
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("transparent_attention"))
    with torch.no_grad():
        model.memory.weight.copy_(torch.randn_like(model.memory.weight))
    sites = capture_sites(model, batch(model.config))
    ys = [sites["encoder.embed.out"]] + [sites[f"encoder.layers.{i}.out"] for i in range(2)]
    for j in range(3):
        w = torch.softmax(model.memory.weight[:, j], dim=0)
        expected = sum(w[i] * ys[i] for i in range(3))
        torch.testing.assert_close(sites[f"memory.out.{j}"], expected, rtol=1e-5, atol=1e-6)


def test_dlcl_post_combination_formula():
    """Wang 2019 §3: x_{l+1} = LN'_l(Σ_k W[l,k]·y_k)."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("dlcl_post", "encoder", n_enc=3))
    comb = model.encoder.combine
    with torch.no_grad():
        comb.weight.copy_(torch.randn_like(comb.weight))
    sites = capture_sites(model, batch(model.config))
    ys = [sites["encoder.embed.out"]] + [sites[f"encoder.layers.{i}.out"] for i in range(3)]
    W = comb.weight.detach()
    for l in range(1, 3):
        expected = comb.norms[str(l)].inner(sum(W[l, k] * ys[k] for k in range(l + 1)))
        torch.testing.assert_close(sites[f"encoder.layers.{l}.in"], expected, rtol=1e-5, atol=1e-5)
    final = comb.norms["3"].inner(sum(W[3, k] * ys[k] for k in range(4)))
    torch.testing.assert_close(sites["encoder.combine.out"], final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sites["encoder.layers.0.in"], W[0, 0] * ys[0])  # the official code: no LN'_0


def test_dlcl_post_embedding_ln_option():
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("dlcl_post", "encoder", n_enc=2, dlcl_embed_ln=True))
    comb = model.encoder.combine
    sites = capture_sites(model, batch(model.config))
    expected = comb.norms["0"].inner(comb.weight.detach()[0, 0] * sites["encoder.embed.out"])
    torch.testing.assert_close(sites["encoder.layers.0.in"], expected, rtol=1e-5, atol=1e-5)


def test_scalenorm_formula():
    """Nguyen & Salazar 2019 Eq. 7: g·x/max(‖x‖, 1e-5), g starts at sqrt(d)."""
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("scalenorm", "encoder"))
    norm = model.encoder.layers[0].self_attn.norm.inner
    assert norm.g.item() == pytest.approx(16**0.5)
    x = torch.randn(2, 5, 16)
    x[0, 0] = 0.0
    expected = 4.0 * x / x.norm(dim=-1, keepdim=True).clamp_min(1e-5)
    torch.testing.assert_close(norm(x), expected)
