"""Bad config values raise ValueError naming the field (and the valid choices)."""

from __future__ import annotations

import dataclasses

import pytest

from gradscope import ModelConfig, presets


@pytest.mark.parametrize(
    "changes,field,also",
    [
        ({"variant": "postln"}, "variant", "post_ln"),
        ({"init": "he"}, "init", "lipschitz"),
        ({"arch": "seq2seq"}, "arch", "encoder_decoder"),
        ({"d_model": 30, "n_heads": 4}, "d_model", "n_heads"),
        ({"n_enc": 0}, "n_enc", ">= 1"),
        ({"n_dec": -2}, "n_dec", ">= 1"),
        ({"n_heads": 0}, "n_heads", ">= 1"),
        ({"vocab": 2.5}, "vocab", "integer"),
        ({"dropout": 1.0}, "dropout", "[0, 1)"),
        ({"pad_id": 1000}, "pad_id", "vocab"),
        ({"dlcl_weight_init": "avg"}, "dlcl_weight_init", "dlcl_pre"),
        ({"dlcl_extra_ln": False}, "dlcl_extra_ln", "dlcl_post"),
        ({"fixnorm": True}, "fixnorm", "scalenorm"),
        ({"variant": "dlcl_pre", "dlcl_embed_ln": True}, "dlcl_embed_ln", "dlcl_post"),
        ({"deepnorm_init": "paper"}, "deepnorm_init", "deepnorm"),
        ({"variant": "deepnorm", "deepnorm_init": "fairseq"}, "deepnorm_init", "torchscale"),
        ({"ds_init_form": "code"}, "ds_init_form", "ds_init"),
        ({"variant": "dlcl_pre", "dlcl_weight_init": "zero"}, "dlcl_weight_init", "one"),
        ({"init": "ds_init", "ds_init_form": "both"}, "ds_init_form", "paper"),
        ({"arch": "decoder", "variant": "transparent_attention"}, "arch", "encoder_decoder"),
    ],
)
def test_bad_values_name_the_field(changes, field, also):
    with pytest.raises(ValueError) as err:
        ModelConfig(**changes)
    message = str(err.value)
    assert message.startswith(f"{field}:"), message
    assert also in message


def test_unused_depth_is_not_checked():
    assert ModelConfig(arch="decoder", n_enc=0).n_enc == 0
    assert ModelConfig(arch="encoder", n_dec=0).n_dec == 0


def test_config_is_frozen_and_keyword_only():
    config = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 3
    with pytest.raises(TypeError):
        ModelConfig("encoder_decoder")  # the dataclass is keyword-only


def test_replace_validates():
    with pytest.raises(ValueError, match="^variant:"):
        ModelConfig().replace(variant="nope")


def test_presets():
    base = presets.base(variant="b2t", n_enc=18, n_dec=18)
    assert (base.d_model, base.n_heads, base.d_ff, base.n_enc, base.variant) == (512, 8, 2048, 18, "b2t")
    assert presets.tiny().d_model < presets.small().d_model < presets.base().d_model


def test_run_presets_share_one_family():
    ci = presets.get("ci")
    assert ci.size == presets.tiny(vocab=32, max_len=10)
    model = ci.model("b2t", 6, 4, init="lipschitz")
    assert (model.variant, model.n_enc, model.n_dec, model.d_model, model.init) == ("b2t", 6, 4, 32, "lipschitz")
    config = presets.get("paper").train(50_000)
    assert (config.warmup, config.betas, config.label_smoothing) == (4000, (0.9, 0.98), 0.1)
    assert presets.get("default").task().vocab == presets.default().size.vocab
    with pytest.raises(ValueError, match="preset: unknown 'huge'"):
        presets.get("huge")
