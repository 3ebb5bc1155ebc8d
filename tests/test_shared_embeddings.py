"""``share_embeddings``: one token matrix for source, target and output (issue 49, a task
closer to WMT), checked against the same model with two matrices holding equal weights."""

from __future__ import annotations

import pytest
import torch

import gradscope
from gradscope import ModelConfig


def config(**changes) -> ModelConfig:
    base = dict(variant="pre_ln", n_enc=2, n_dec=2, d_model=16, n_heads=2, d_ff=32, vocab=40, dropout=0.0, max_len=12)
    return ModelConfig(**{**base, **changes})


@pytest.mark.parametrize("variant", ["pre_ln", "post_ln", "scalenorm"])
def test_one_matrix_gets_both_stacks_gradients(variant):
    extra = {"fixnorm": True} if variant == "scalenorm" else {}
    torch.manual_seed(0)
    shared = gradscope.build_model(config(variant=variant, share_embeddings=True, **extra))
    assert shared.encoder.embed.tokens is shared.decoder.embed.tokens
    names = [n for n, _ in shared.named_parameters() if "embed.tokens" in n]
    assert names == ["encoder.embed.tokens.weight"]

    two = gradscope.build_model(config(variant=variant, **extra))
    two.load_state_dict(shared.state_dict())  # both embedding keys hold the one matrix
    assert torch.equal(two.encoder.embed.tokens.weight, two.decoder.embed.tokens.weight)

    src, tgt = torch.randint(1, 40, (3, 7)), torch.randint(1, 40, (3, 6))
    out_shared, out_two = shared(src, tgt), two(src, tgt)
    torch.testing.assert_close(out_shared, out_two, rtol=0, atol=0)
    out_shared.square().mean().backward()
    out_two.square().mean().backward()
    expected = two.encoder.embed.tokens.weight.grad + two.decoder.embed.tokens.weight.grad
    torch.testing.assert_close(shared.encoder.embed.tokens.weight.grad, expected, rtol=1e-6, atol=1e-9)


def test_recorder_lists_the_shared_matrix_once():
    torch.manual_seed(0)
    model = gradscope.build_model(config(share_embeddings=True))
    src, tgt = torch.randint(1, 40, (3, 7)), torch.randint(1, 40, (3, 6))
    frame = gradscope.snapshot(model, (src, tgt), lambda logits: logits.square().mean(), quantities=["param_grad_norm"])
    groups = frame[frame.quantity == "param_grad_norm"].set_index("site")["value"]
    assert "encoder.embed" in groups and "decoder.embed" not in groups
    model(src, tgt).square().mean().backward()  # the reference: autograd on the same weights
    expected = model.encoder.embed.tokens.weight.grad.norm().item()
    assert groups["encoder.embed"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_only_an_encoder_decoder_shares(arch):
    with pytest.raises(ValueError, match="share_embeddings: only arch='encoder_decoder'"):
        config(arch=arch, share_embeddings=True)
