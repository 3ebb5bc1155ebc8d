"""Golden site names per variant (SPEC §2, STYLE §3). The lists are written out here from
the SPEC, not read back from the model."""

from __future__ import annotations

import pytest

import gradscope
from zoo_cases import ALL_CASES, tiny

NORMED = ["norm.in", "norm.out", "branch", "sum"]  # module order: the norm is registered first
NO_NORM = ["branch", "sum"]
SUBLAYER_SITES = {
    "post_ln": NORMED, "pre_ln": NORMED, "b2t": NORMED, "dlcl_pre": NORMED, "dlcl_post": NORMED,
    "transparent_attention": NORMED, "scalenorm": NORMED, "admin": NORMED, "deepnorm": NORMED,
    "b2t_noln": NO_NORM, "tfixup": NO_NORM, "rezero": NO_NORM,
}
FINAL_NORM = ["final_norm.in", "final_norm.out"]


def stack_tail(variant: str, depth: int) -> list[str]:
    """Stack-level sites after the layers."""
    if variant == "dlcl_pre":
        extra = [f"combine.norms.{k}.{s}" for k in range(1, depth + 1) for s in ("in", "out")]
        return extra + ["combine.out"] + FINAL_NORM
    if variant == "dlcl_post":
        return [f"combine.norms.{k}.{s}" for k in range(1, depth + 1) for s in ("in", "out")] + ["combine.out"]
    if variant in ("pre_ln", "scalenorm"):
        return FINAL_NORM
    return []


def expected_sites(variant: str, arch: str, n_enc: int, n_dec: int) -> list[str]:
    stacks = {"encoder_decoder": [("encoder", n_enc, False), ("decoder", n_dec, True)],
              "decoder": [("decoder", n_dec, False)], "encoder": [("encoder", n_enc, False)]}[arch]
    names = []
    for stack, depth, cross in stacks:
        names.append(f"{stack}.embed.out")
        subs = ["self_attn"] + (["cross_attn"] if cross else []) + ["ffn"]
        for i in range(depth):
            names.append(f"{stack}.layers.{i}.in")
            names += [f"{stack}.layers.{i}.{sub}.{site}" for sub in subs for site in SUBLAYER_SITES[variant]]
            names.append(f"{stack}.layers.{i}.out")
        names += [f"{stack}.{s}" for s in stack_tail(variant, depth)]
    if variant == "transparent_attention":
        names += [f"memory.out.{j}" for j in range(n_dec)]
    return names


@pytest.mark.parametrize("variant,arch", ALL_CASES)
def test_site_names(variant, arch):
    model = gradscope.build_model(tiny(variant, arch))
    assert gradscope.site_names(model) == expected_sites(variant, arch, 2, 3)


def test_one_list_spelled_out():
    model = gradscope.build_model(tiny("pre_ln", "decoder", n_dec=1))
    assert gradscope.site_names(model) == [
        "decoder.embed.out",
        "decoder.layers.0.in",
        "decoder.layers.0.self_attn.norm.in",
        "decoder.layers.0.self_attn.norm.out",
        "decoder.layers.0.self_attn.branch",
        "decoder.layers.0.self_attn.sum",
        "decoder.layers.0.ffn.norm.in",
        "decoder.layers.0.ffn.norm.out",
        "decoder.layers.0.ffn.branch",
        "decoder.layers.0.ffn.sum",
        "decoder.layers.0.out",
        "decoder.final_norm.in",
        "decoder.final_norm.out",
    ]


@pytest.mark.parametrize("variant,arch", ALL_CASES)
def test_every_site_fires_once_per_forward(variant, arch):
    from zoo_cases import batch

    model = gradscope.build_model(tiny(variant, arch))
    counts = {}
    for name, m in model.named_modules():
        if isinstance(m, gradscope.Site):
            m.register_forward_hook(lambda mod, a, o, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
    model(*batch(model.config))
    assert counts == {name: 1 for name in gradscope.site_names(model)}


def test_takase_locations_exist_in_post_ln_decoder():
    """Takase Fig. 4 locations (1)–(5) of a Post-LN decoder layer."""
    names = set(gradscope.site_names(gradscope.build_model(tiny("post_ln"))))
    p = "decoder.layers.0"
    for loc in ("self_attn.norm.in", "self_attn.norm.out", "cross_attn.norm.in", "cross_attn.norm.out", "ffn.norm.in"):
        assert f"{p}.{loc}" in names
