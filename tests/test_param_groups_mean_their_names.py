"""Parameter groups that mean what their names say (issue 50): no group holds the same
parameters as another (T5's single-child ``layer`` list), a block's sub-layers are groups
wherever the model has them (T5's ``layer.0`` / ``layer.1``, BART's attention and
feed-forward, an MoE layer's router, experts and shared expert), and each group's
``param_grad_norm`` is the norm of its members' ``p.grad`` computed here. A quantity asked
for by name that has nothing to measure warns once."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import gradscope

transformers = pytest.importorskip("transformers")


def _t5():
    config = transformers.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config), lambda m, ids: m(input_ids=ids, labels=ids).loss


def _bart():
    config = transformers.BartConfig(vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=32)
    return transformers.BartForConditionalGeneration(config), lambda m, ids: m(input_ids=ids, labels=ids).loss


def _qwen2_moe():
    config = transformers.Qwen2MoeConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=16)
    return transformers.Qwen2MoeForCausalLM(config), lambda m, ids: m(input_ids=ids, labels=ids).loss


def _recorded(make):
    torch.manual_seed(0)
    model, loss = make()
    rec = gradscope.Recorder(model, quantities=["param_grad_norm"])
    with rec.step(0):
        loss(model, torch.randint(1, 40, (2, 6))).backward()
    rec.close()
    return model, rec


def _check_groups(model, rec):
    groups = rec.layout.param_groups
    members = {g: frozenset(names) for g, (_, _, names) in groups.items()}
    by_members: dict = {}
    for g, m in members.items():
        by_members.setdefault(m, []).append(g)
    assert not [gs for gs in by_members.values() if len(gs) > 1], "groups holding the same parameters"
    grads = dict(model.named_parameters(remove_duplicate=False))
    df = rec.frame()
    rows = df[df.quantity == "param_grad_norm"].set_index("site").value
    for g, names in members.items():
        params = {id(grads[n]): grads[n] for n in names}.values()  # (a tied weight once)
        ref = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params if p.grad is not None))
        if ref > 0:
            assert abs(rows[g] - ref) <= 1e-5 * ref, (g, rows[g], ref)
    return set(groups)


def test_t5_sub_layers_are_groups_and_the_single_child_list_is_not():
    model, rec = _recorded(_t5)
    groups = _check_groups(model, rec)
    assert {"encoder.block.0.layer.0", "encoder.block.0.layer.1", "decoder.block.1.layer.2"} <= groups
    assert "encoder.block.0.layer" not in groups and "decoder.block.0.layer" not in groups


def test_bart_attention_and_feed_forward_are_groups():
    model, rec = _recorded(_bart)
    groups = _check_groups(model, rec)
    layer = "model.encoder.layers.0"
    assert {f"{layer}.self_attn", f"{layer}.fc1", f"{layer}.fc2", f"{layer}.self_attn_layer_norm"} <= groups


def test_an_moe_layer_s_router_experts_and_shared_expert_are_groups():
    model, rec = _recorded(_qwen2_moe)
    groups = _check_groups(model, rec)
    mlp = "model.layers.0.mlp"
    assert {mlp, f"{mlp}.gate", f"{mlp}.experts", f"{mlp}.shared_expert", f"{mlp}.shared_expert_gate"} <= groups


def test_a_quantity_named_with_nothing_to_measure_warns_once():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))  # two blocks, no norm
    with pytest.warns(UserWarning, match=r"ln_gain has nothing to measure.*no normalisation layer") as seen:
        rec = gradscope.Recorder(model, quantities=["ln_gain", "act_grad_norm"])
        for step in range(2):
            with rec.step(step):
                model(torch.randn(3, 4)).sum().backward()
        rec.close()
    assert sum("nothing to measure" in str(w.message) for w in seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the default set says nothing of what does not apply
        gradscope.Recorder(model).close()
