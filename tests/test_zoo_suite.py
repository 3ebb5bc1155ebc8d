"""One suite over every variant × arch (STYLE §9): shape, finite loss and gradients,
determinism, state-dict round trip, option handling."""

from __future__ import annotations

import io

import pytest
import torch

import gradscope
from zoo_cases import ALL_CASES, batch, loss_of, tiny


def test_every_variant_is_registered():
    expected = {
        "post_ln", "pre_ln", "b2t", "b2t_noln", "dlcl_pre", "dlcl_post", "transparent_attention",
        "scalenorm", "admin", "deepnorm", "tfixup", "rezero",
    }
    assert set(gradscope.VARIANTS) == expected
    assert set(gradscope.INITS) == {"xavier", "lipschitz", "small", "ds_init"}


def test_transparent_attention_is_encoder_decoder_only():
    assert [a for v, a in ALL_CASES if v == "transparent_attention"] == ["encoder_decoder"]
    assert len(ALL_CASES) == 11 * 3 + 1


@pytest.mark.parametrize("variant,arch", ALL_CASES)
def test_shape_finite_loss_and_gradients(variant, arch):
    torch.manual_seed(0)
    config = tiny(variant, arch)
    model = gradscope.build_model(config)
    inputs = batch(config)
    logits = model(*inputs)
    assert logits.shape == (*inputs[-1].shape, config.vocab)
    loss = loss_of(logits, config)
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
    # every layer receives some gradient (ReZero's branch weights start gated by α=0, but α itself learns)
    assert sum(p.grad.abs().sum() for p in model.parameters()) > 0


@pytest.mark.parametrize("variant,arch", ALL_CASES)
def test_same_seed_same_outputs_with_dropout(variant, arch):
    config = tiny(variant, arch, dropout=0.2)
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        model = gradscope.build_model(config)
        outs.append(model(*batch(config)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.manual_seed(124)
    other = gradscope.build_model(config)
    assert not torch.equal(outs[0], other(*batch(config)))


@pytest.mark.parametrize("variant,arch", ALL_CASES)
def test_state_dict_round_trip(variant, arch):
    config = tiny(variant, arch)
    torch.manual_seed(1)
    source = gradscope.build_model(config)
    with torch.no_grad():  # make variant-owned parameters non-default too
        for p in source.parameters():
            p.add_(0.01 * torch.randn_like(p))
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    torch.manual_seed(2)
    target = gradscope.build_model(config)
    target.load_state_dict(torch.load(buffer, weights_only=True))
    inputs = batch(config)
    torch.testing.assert_close(target(*inputs), source(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("init", sorted(gradscope.INITS))
@pytest.mark.parametrize("variant", ["post_ln", "pre_ln", "b2t"])
def test_every_init_with_any_wiring(init, variant):
    torch.manual_seed(0)
    config = tiny(variant, init=init)
    logits = gradscope.build_model(config)(*batch(config))
    assert torch.isfinite(logits).all()


def test_model_keeps_its_config():
    config = tiny("b2t")
    assert gradscope.build_model(config).config is config


def test_padding_does_not_leak_into_other_positions():
    torch.manual_seed(0)
    config = tiny("pre_ln", "encoder")
    model = gradscope.build_model(config)
    tokens = torch.randint(3, config.vocab, (1, 6))
    padded = torch.cat([tokens, torch.full((1, 3), config.pad_id)], dim=1)
    torch.testing.assert_close(model(padded)[:, :6], model(tokens), rtol=1e-5, atol=1e-6)


def test_decoder_is_causal():
    torch.manual_seed(0)
    config = tiny("post_ln", "decoder")
    model = gradscope.build_model(config)
    tokens = torch.randint(3, config.vocab, (1, 8))
    changed = tokens.clone()
    changed[0, 5:] = 3 + (changed[0, 5:] - 2) % (config.vocab - 3)
    torch.testing.assert_close(model(changed)[:, :5], model(tokens)[:, :5], rtol=1e-5, atol=1e-6)


def test_fixnorm_normalises_embedding_rows():
    torch.manual_seed(0)
    model = gradscope.build_model(tiny("scalenorm", "decoder", fixnorm=True))
    rows = model.decoder.embed.token_weight()
    torch.testing.assert_close(rows.norm(dim=-1), torch.ones(rows.shape[0]))


@pytest.mark.parametrize(
    "options,learnable,weight_row2",
    [({}, True, [1 / 3] * 3), ({"dlcl_weight_init": "one", "dlcl_learnable": False}, False, [1.0] * 3)],
)
def test_dlcl_weight_options(options, learnable, weight_row2):
    model = gradscope.build_model(tiny("dlcl_pre", "encoder", **options))
    combine = model.encoder.combine
    assert isinstance(combine.weight, torch.nn.Parameter) is learnable
    torch.testing.assert_close(combine.mixing_weights()[2, :3], torch.tensor(weight_row2))
    assert torch.count_nonzero(torch.triu(combine.mixing_weights(), diagonal=1)) == 0


def test_dlcl_no_extra_ln_has_no_extra_norms():
    with_ln = gradscope.build_model(tiny("dlcl_post", "encoder"))
    without = gradscope.build_model(tiny("dlcl_post", "encoder", dlcl_extra_ln=False))
    assert sorted(with_ln.encoder.combine.norms) == ["1", "2"]  # LN'_1, LN'_2: the embedding has none (official code)
    assert len(without.encoder.combine.norms) == 0
    embed_ln = gradscope.build_model(tiny("dlcl_post", "encoder", dlcl_embed_ln=True))
    assert sorted(embed_ln.encoder.combine.norms) == ["0", "1", "2"]
